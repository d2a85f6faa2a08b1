"""What the commands that read a checkpoint (``eval``, ``generate --checkpoint``) may set on top
of its config: not another model, cut, adapter kind or base format (its weights are that run's:
each refused by name, with what to do instead); the model directory its run read, where that has
moved (``checkpoint.export.moved_model_dir``)."""

from __future__ import annotations

from ..checkpoint.export import moved_model_dir, relocate_model_dir
from ..config import ConfigError

__all__ = ["checked_given"]


def checked_given(given: dict, stored: dict, flag: str = "--checkpoint") -> None:
    """Refuse in ``given`` (the sections of --config and the flags) what would run another model
    than checkpoint config ``stored``'s; a moved model directory given is set in ``stored`` (and
    taken out of ``given``)."""
    refuse_other_model(given, flag)
    hf = moved_model_dir(stored, (given.get("model") or {}).pop("hf_dir", None), flag)
    if hf is not None:
        relocate_model_dir(stored, hf)
    refuse_other_cut(given, stored, flag)
    refuse_other_adapter(given, stored, flag)
    refuse_other_base(given, stored, flag)


# what names the model a checkpoint holds: set with --checkpoint, it would run another model
# (--model.hf_dir: that directory's config and tokenizer) on the checkpoint's weights
_MODEL_FIELDS = (
    "kind", "hf_dir", "from_scratch", "init_from", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff",
    "vocab_size", "max_seq_len", "tie_embeddings",
)  # fmt: skip


def refuse_other_model(given: dict, flag: str = "--checkpoint") -> None:
    """``given`` (the sections of --config and the flags, set on top of a checkpoint's config)
    must not name another model: the model is the checkpoint's (``model.hf_dir``: where its
    directory moved, ``moved_model_dir``)."""
    named = [f for f in _MODEL_FIELDS if f in (given.get("model") or {}) and f != "hf_dir"]
    if named:
        raise ConfigError(
            f"model.{named[0]} = {given['model'][named[0]]!r} with {flag}: the model is the checkpoint's (its "
            f"config and weights); drop model.{named[0]}, or leave out {flag} to run the model it names"
        )


# what lays out a checkpoint's weights by unit: a forward-only run of it must cut as it was trained
_CUT_FIELDS = ("layer_pieces", "vocab_pieces")


def refuse_other_cut(given: dict, stored: dict, flag: str = "--checkpoint") -> None:
    """``given`` (as in ``refuse_other_model``) must not cut the model otherwise than the
    checkpoint's run (``stored``, its config): its weights file holds that run's units."""
    for f in _CUT_FIELDS:
        want, had = (given.get("model") or {}).get(f), (stored.get("model") or {}).get(f)
        if f in (given.get("model") or {}) and want != had:
            raise ConfigError(
                f"model.{f} = {want!r} with {flag}: the checkpoint's weights are laid out by the units its run "
                f"trained (model.{f} = {had!r}); drop model.{f} to use its cut, or export the checkpoint "
                f"(tiertrain export --checkpoint ... --out DIR) and run --model.hf_dir=DIR cut as you like"
            )


_BASE_FIELDS = ("base_dtype", "base_double_quant")


def refuse_other_base(given: dict, stored: dict, flag: str = "--checkpoint") -> None:
    """``given`` (as in ``refuse_other_model``) must not store the frozen base otherwise than the
    checkpoint's run did (``stored``): its weights are that base as it trained (a bf16 base
    quantized again to NF4 changed the loss without a word; an NF4 one given another dtype had
    the flag ignored)."""
    if (stored.get("adapter") or {}).get("kind", "none") == "none":
        return  # no frozen base: the config refuses a base format without adapters, saying to unset it
    for f in _BASE_FIELDS:
        model = given.get("model") or {}
        had = (stored.get("model") or {}).get(f)
        if f in model and (model[f] or None) != (had or None):  # (double quantisation: false is unset)
            raise ConfigError(
                f"model.{f} = {model[f]!r} with {flag}: the checkpoint's base is read as its run trained it "
                f"(model.{f} = {had!r}); drop model.{f}, or export the checkpoint merged (tiertrain export --merge) "
                f"and run --model.hf_dir=DIR --model.{f}=... on that"
            )


def refuse_other_adapter(given: dict, stored: dict, flag: str = "--checkpoint") -> None:
    """``given`` (as in ``refuse_other_model``) must not turn off the adapters a checkpoint was
    trained with (``stored``): it is read with them (else the checkpoint's adapter settings
    were refused, by name, as if set by hand)."""
    kind = (stored.get("adapter") or {}).get("kind", "none")
    if kind != "none" and (given.get("adapter") or {}).get("kind", kind) != kind:
        raise ConfigError(
            f"adapter.kind = {given['adapter']['kind']!r} with {flag}: the checkpoint was trained with adapter.kind = "
            f"{kind!r} and is read with its adapters; leave --adapter.kind out (for the base alone, point "
            "--model.hf_dir at the base; for one model, `tiertrain export --merge`)"
        )
