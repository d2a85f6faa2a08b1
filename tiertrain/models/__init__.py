"""Models cut into units (embed, blocks, head) whose weights live in the parameter store.

``build_model`` makes the skeleton (no weight memory) and a ``WeightSource`` for its
initial weights: seeded random initialisation unit by unit, or a local Hugging Face
directory of safetensors files read one unit at a time. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from typing import Any, Callable

import torch

from ..config import ConfigError, ModelConfig
from ..errors import one_line
from .base import LayeredModel, WeightSource, materialize_placeholders, skeleton_init, unit_param_names
from .buffers import load_buffers
from .convert import Sources, conversion_plan, convert
from .families import FAMILIES, supported_names
from .gpt import build_gpt
from .hf import hf_layout_problem, hf_problem, layer_hf
from .pieces import cut_vocab, rows_per_piece
from .routers import describe_experts
from .sublayers import cut_layers, cut_problem

__all__ = [
    "LayeredModel",
    "WeightSource",
    "build_model",
    "hf_config_from",
    "unit_param_names",
    "random_source",
    "safetensors_source",
    "vocab_size_of",
    "model_name",
    "tensor_source",
    "auto_pieces",
]


def hf_config_from(cfg: ModelConfig) -> Any:
    """The transformers config of an HF model kind: from ``hf_dir``, or from the sizes in ``cfg``."""
    from transformers import AutoConfig, GPT2Config, LlamaConfig

    if cfg.hf_dir is not None:
        try:
            hf_cfg = AutoConfig.from_pretrained(cfg.hf_dir, local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError ... for a bad config.json
            raise ConfigError(
                f"model.hf_dir = {cfg.hf_dir!r}: its config.json does not load ({type(exc).__name__}: {one_line(exc)})"
            ) from None
    elif cfg.kind == "llama":
        hf_cfg = LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.d_ff or _llama_ff(cfg.d_model),
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
            max_position_embeddings=cfg.max_seq_len,
            tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.init_std,
        )
    else:
        hf_cfg = GPT2Config(
            vocab_size=cfg.vocab_size,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_inner=cfg.d_ff,
            n_positions=cfg.max_seq_len,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            initializer_range=cfg.init_std,
        )
    family = FAMILIES.get(hf_cfg.model_type)
    hf_cfg._attn_implementation = family.attention if family is not None else "sdpa"  # as transformers needs it
    hf_cfg.use_cache = False
    return hf_cfg


def _llama_ff(d: int) -> int:
    return 256 * ((int(8 * d / 3) + 255) // 256)


def _build_hf(cfg: ModelConfig) -> LayeredModel:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    hf_cfg = hf_config_from(cfg)
    where = f"model.hf_dir = {cfg.hf_dir!r}" if cfg.hf_dir else f"model.kind = {cfg.kind!r}"
    arch = (getattr(hf_cfg, "architectures", None) or [hf_cfg.model_type])[0]
    if hf_problem(hf_cfg):
        raise _unsupported(where, arch, hf_cfg.model_type, hf_problem(hf_cfg))
    # parameters on meta, buffers (rotary) real. Not within skeleton_init: transformers keeps
    # torch's initialisers as it finds them when its modules are first imported (here, lazily)
    try:
        with init_empty_weights(include_buffers=False):
            hf = AutoModelForCausalLM.from_config(hf_cfg)
    except (ValueError, KeyError, ImportError, TypeError) as exc:  # transformers' refusals: not a causal LM,
        # an attention implementation it does not take for this model, remote code
        raise _unsupported(where, arch, hf_cfg.model_type, f"transformers does not build it: {one_line(exc)}") from None
    # accelerate re-creates parameters assigned inside its context, which unties them
    hf.tie_weights()
    if getattr(hf_cfg, "tie_word_embeddings", False):
        if hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
            raise RuntimeError(f"{type(hf).__name__}: could not tie the output head to the input embedding")
    problem = hf_layout_problem(hf)
    if problem:
        raise _unsupported(where, type(hf).__name__, hf_cfg.model_type, problem)
    return layer_hf(hf)


def _unsupported(where: str, arch: str, model_type: str, problem: str) -> ConfigError:
    return ConfigError(
        f"{where}: {arch} ({model_type!r}) is not a model tiertrain runs ({problem}); supported: {supported_names()}"
    )


def build_model(cfg: ModelConfig, *, param_dtype: torch.dtype, seed: int) -> tuple[LayeredModel, WeightSource]:
    """The skeleton of the configured model and where its initial weights come from."""
    from accelerate import init_empty_weights

    if cfg.kind == "auto":
        raise ConfigError("model.kind = 'auto' was not resolved: the config was made without its environment checks")
    if cfg.kind == "gpt":
        if cfg.hf_dir is not None:
            raise ConfigError("model.hf_dir is set but model.kind = 'gpt' (built-in); use kind 'llama' or 'gpt2'")
        with init_empty_weights(include_buffers=False), skeleton_init():
            model = build_gpt(
                vocab_size=cfg.vocab_size,
                d_model=cfg.d_model,
                n_layers=cfg.n_layers,
                n_heads=cfg.n_heads,
                d_ff=cfg.d_ff,
                max_seq_len=cfg.max_seq_len,
                tie_embeddings=cfg.tie_embeddings,
                init_std=cfg.init_std,
                dropout=cfg.dropout,
            )
        if cfg.tie_embeddings:  # accelerate re-creates parameters assigned inside its context: tie here
            model.head.lm_head.weight = model.embed.wte.weight
    else:
        model = _build_hf(cfg)
    _cut_layers(model, cfg, param_dtype)
    _cut(model, cfg)
    materialize_placeholders(model, param_dtype)
    if cfg.init_from is not None:
        return model, safetensors_source(model, cfg.init_from, what="model.init_from")
    if cfg.hf_dir is not None and not cfg.from_scratch:
        return model, safetensors_source(model, cfg.hf_dir)
    whole = None
    if model.row_pieces or model.layer_parts > 1:  # the random values are the uncut model's, whatever the cut
        uncut = dataclasses.replace(cfg, vocab_pieces=1, layer_pieces=1)
        whole = lambda: build_model(uncut, param_dtype=param_dtype, seed=seed)[0]  # noqa: E731
    return model, random_source(model, seed, whole=whole)


def _cut(model: LayeredModel, cfg: ModelConfig) -> None:
    """Cut the vocabulary matrices into pieces as ``model.vocab_pieces`` says (unset: whole;
    the planner asks for pieces where the memory budget needs them, ``auto_pieces``)."""
    embed = getattr(model.embed, model.embed.TOKENS)
    vocab, dim = embed.weight.shape
    if cfg.vocab_pieces is None:
        return
    if cfg.vocab_pieces > vocab:
        raise ConfigError(
            f"model.vocab_pieces = {cfg.vocab_pieces} is more than the vocabulary's {vocab} rows; "
            "use at most that many (or leave it unset)"
        )
    rows = rows_per_piece(cfg.vocab_pieces, vocab, dim, _block_numel(model))
    problem = vocab_cut_problem(model) if rows < vocab else ""
    if problem:
        raise ConfigError(
            f"model.vocab_pieces = {cfg.vocab_pieces}: this model's vocabulary cannot be cut into pieces ({problem}); "
            "leave it unset"
        )
    if rows < vocab:
        cut_vocab(model, rows)


def _cut_layers(model: LayeredModel, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Cut each decoder layer into ``model.layer_pieces`` sub-layer units (unset or 1: whole;
    the planner asks for pieces where the budget cannot hold a whole block, ``cost/cuts.py``)."""
    if cfg.layer_pieces in (None, 1):
        return
    problem = cut_problem(model, cfg.layer_pieces, dtype)
    if problem:
        raise ConfigError(
            f"model.layer_pieces = {cfg.layer_pieces}: this model's layers cannot be cut exactly that way ({problem}); "
            "leave it unset for the planner to choose (whole layers where the budget holds them)"
        )
    cut_layers(model, cfg.layer_pieces)


def _block_numel(model: LayeredModel) -> int:
    return max(sum(p.numel() for p in b.parameters()) for b in model.blocks)


def vocab_cut_problem(model: LayeredModel) -> str:
    """Why ``model``'s vocabulary matrices cannot be cut into row pieces ('' where they can)."""
    emb, out = getattr(model.embed, model.embed.TOKENS), getattr(model.head, model.head.PROJ)
    if out.bias is not None:
        return "its output projection has a bias (Phi)"
    if out.weight.shape[0] != emb.weight.shape[0]:
        return f"its output vocabulary ({out.weight.shape[0]} rows) is not its input one ({emb.weight.shape[0]})"
    return ""


def auto_pieces(model: LayeredModel) -> int | None:
    """The fewest pieces of at most a block's elements that ``model``'s (uncut) vocabulary
    matrix cuts into, or None where it is no larger than a block (cutting saves nothing) or
    cannot be cut (``vocab_cut_problem``)."""
    if vocab_cut_problem(model):
        return None
    vocab, dim = getattr(model.embed, model.embed.TOKENS).weight.shape
    rows = rows_per_piece(None, vocab, dim, _block_numel(model))
    return None if rows >= vocab else -(-vocab // rows)


def model_name(model: LayeredModel, cfg: ModelConfig) -> str:
    """What the log lines call the model: its family and architecture for a Hugging Face model
    (``Qwen3-MoE (Qwen3MoeForCausalLM; 128 experts, 8 a token, ...)``: a mixture of experts says
    whether the auxiliary loss is in the loss), else ``model.kind``."""
    if model.hf_model is None:
        return cfg.kind
    family = FAMILIES.get(model.hf_config.model_type)
    name = family.name if family is not None else model.hf_config.model_type
    experts = describe_experts(model.hf_model, model.routers)
    return f"{name} ({type(model.hf_model).__name__}{'; ' + experts if experts else ''})"


def vocab_size_of(model: LayeredModel, cfg) -> int:
    """The model's vocabulary: its Hugging Face config's, else ``model.vocab_size``."""
    return model.hf_config.vocab_size if model.hf_config is not None else cfg.model.vocab_size


def random_source(model: LayeredModel, seed: int, *, whole: Callable[[], LayeredModel] | None = None) -> WeightSource:
    """Seeded initialisation of one unit at a time (generator seeded by seed and unit). A
    model whose vocabulary or layers are cut takes its values from ``whole()``, the same model
    uncut: its embedding, head and layers initialised whole (once for all their pieces) and
    cut, so that the initial weights never depend on the cut (a budget that cuts keeps the model)."""
    if not model.row_pieces and model.layer_parts == 1:
        owned = unit_param_names(model)
        return WeightSource(f"random init (seed {seed})", lambda u, names: _init_values(model, owned, u, seed, names))
    if whole is None:
        raise ValueError("random_source: a cut model needs whole= (the same model uncut)")
    canon: list = []
    last: dict = {}  # the canonical unit initialised last: {index: its values}

    def load(u: int, names: list[str]) -> dict[str, torch.Tensor]:
        if not canon:
            canon.append(whole())
            canon.append(unit_param_names(canon[0]))
        ref = model.plan[u]
        layers = len(canon[0].blocks)
        c = {"embed": 0, "embed_piece": 0, "block": 1 + (model.layer_of(ref.block) or 0)}.get(ref.role, layers + 1)
        if c not in last:
            last.clear()  # one whole unit held at a time: the pieces of a matrix come one after another
            last[c] = _init_values(canon[0], canon[1], c, seed, None)
        values, out = last[c], {}
        for name in names:
            rp = model.row_pieces.get(name)
            out[name] = values[rp.whole][rp.start : rp.stop].clone() if rp else values[name]
        return out

    return WeightSource(f"random init (seed {seed})", load)


def _init_values(model: LayeredModel, owned, u: int, seed: int, names: list[str] | None) -> dict[str, torch.Tensor]:
    """Unit ``u``'s initial values (of ``names``; None: all it owns), from the generator of
    (seed, u), in fp32 scratch tensors."""
    unit = model.units[u]
    if model.init_unit is None:
        raise ValueError(f"model {type(model).__name__} has no init_unit: it cannot be initialised at random")
    saved = {id(p): p.data for p in unit.parameters()}
    scratch = {}
    try:
        for p in unit.parameters():  # foreign (tied) ones too: init must not touch the owner's
            scratch[id(p)] = torch.empty(p.shape, dtype=torch.float32)
            p.data = scratch[id(p)]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + u)
        model.init_unit(u, unit, gen)
        return {name: scratch[id(p)] for name, p in owned[u] if names is None or name in names}
    finally:
        for p in unit.parameters():
            p.data = saved[id(p)]


def safetensors_source(model: LayeredModel, directory: str, *, what: str = "model.hf_dir") -> WeightSource:
    """Read each unit's tensors from safetensors: a file, or a directory (an HF model
    directory, or one written by ``tiertrain export``), keyed by our names or HF names.

    Checked before any work (``what`` names the setting in errors): every file the index
    names exists and has a readable safetensors header, and every weight the model needs is
    in them with the right shape."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    single = directory if os.path.isfile(directory) else os.path.join(directory, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index) as f:
                where = {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{what} = {directory!r}: {index} is not a valid safetensors index ({exc})") from None
    elif os.path.exists(single):
        where = {}
    else:
        bins = [
            n
            for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")
            if os.path.exists(os.path.join(directory, n))
        ]
        run = any(os.path.exists(os.path.join(directory, n)) for n in ("manifest.json", "checkpoints", "metrics.jsonl"))
        raise ConfigError(
            f"{what} = {directory!r}: no model.safetensors(.index.json) there"
            + (
                f" (its weights are in {bins[0]}: convert them, e.g. AutoModelForCausalLM.from_pretrained(DIR)"
                ".save_pretrained(NEW_DIR), which writes safetensors)"
                if bins
                else f"; it is a tiertrain run or checkpoint: export it first (`tiertrain export --checkpoint {directory} "
                "--out DIR`, in Python tiertrain.export(checkpoint, DIR)) and give DIR, or evaluate and generate "
                "from it with --checkpoint"
                if run
                else "; give the directory that holds the weights (model.from_scratch = true trains its config from "
                "random weights instead)"
            )
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(where.values()) or {single}):
        if not os.path.isfile(file):
            raise ConfigError(f"{what} = {directory!r}: {os.path.basename(file)}, named in its index, is missing")
        try:
            with safe_open(file, "pt") as f:
                for k in f.keys():
                    where.setdefault(k, file)
                    shapes[k] = tuple(f.get_slice(k).get_shape())
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigError(
                f"{what} = {directory!r}: {file} is not a readable safetensors file ({exc}); "
                "it is truncated or damaged: copy it again"
            ) from None
    hf_names = _hf_names(model) if model.hf_model is not None else {}
    prefix = getattr(model.hf_model, "base_model_prefix", "")
    # transformers' own key conversions (experts stacked into 3-D tensors, renamed keys)
    converted = conversion_plan(model.hf_model, list(where)) if model.hf_model is not None else {}

    def locate(name: str) -> Sources:
        if name in where:
            return Sources(None, [(name, name)])
        hf = hf_names.get(name, name)
        if hf in converted:
            return converted[hf]
        for cand in (hf, hf.removeprefix(prefix + "."), f"{prefix}.{hf}"):
            if cand in where:
                return Sources(None, [(cand, cand)])
        raise ConfigError(f"{what} = {directory!r}: weight {hf!r} is missing from the safetensors files")

    shape_of = {}
    for own in unit_param_names(model):  # every weight is there, with its shape, before any work
        for name, p in own:
            shape_of[name] = tuple(p.shape)
            rp = model.row_pieces.get(name)
            src = locate(rp.whole if rp else name)
            key, shape = src.keys[0][0], rp.whole_shape if rp else tuple(p.shape)
            if src.converter is None and shapes.get(key) is not None and tuple(shapes[key]) != shape:
                raise ConfigError(
                    f"{what} = {directory!r}: weight {key!r} has shape {shapes[key]}, the model expects "
                    f"{shape}; the weights are of another model"
                )
            if src.converter is not None:
                _check_converted(model, hf_names.get(name, name), src, shapes, shape, f"{what} = {directory!r}")

    def reader(files: contextlib.ExitStack) -> Callable[..., torch.Tensor]:
        """``read(key, rows=None)``, each file opened once within ``files`` (an expert stack is
        hundreds of keys of one file: opening it per key parsed its header each time)."""
        opened: dict[str, Any] = {}

        def read(key: str, rows: slice | None = None) -> torch.Tensor:
            try:
                if where[key] not in opened:
                    opened[where[key]] = files.enter_context(safe_open(where[key], "pt"))
                f = opened[where[key]]
                return f.get_slice(key)[rows] if rows is not None else f.get_tensor(key)
            except (SafetensorError, OSError) as exc:
                raise ConfigError(
                    f"{what} = {directory!r}: reading {key!r} from {where[key]} failed ({exc}); "
                    "the file is damaged: copy it again"
                ) from None

        return read

    if model.hf_model is not None:  # its constants (a router's correction bias) as the files hold them
        with contextlib.ExitStack() as files:
            load_buffers(model.hf_model, shapes, reader(files), prefix, f"{what} = {directory!r}")

    def load(u: int, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        with contextlib.ExitStack() as files:
            read = reader(files)
            for name in names:
                rp = model.row_pieces.get(name)
                src = locate(rp.whole if rp else name)
                if rp and src.converter is None:
                    out[name] = read(src.keys[0][0], slice(rp.start, rp.stop))
                    continue
                if rp:  # a range of experts: its experts' checkpoint tensors alone, converted
                    out[name] = _converted_rows(model, hf_names.get(rp.whole, rp.whole), src, rp, read, what, directory)
                    continue
                value = convert(model.hf_model, hf_names.get(name, name), src, read)
                expected = shape_of[name]
                if tuple(value.shape) != expected:
                    raise ConfigError(
                        f"{what} = {directory!r}: weight {hf_names.get(name, name)!r} made from "
                        f"{len(src.keys)} checkpoint tensors has shape {tuple(value.shape)}, the model expects "
                        f"{expected}; the weights are of another model"
                    )
                out[name] = value
        return out

    return WeightSource(f"safetensors from {directory}", load)


def _converted_rows(
    model: LayeredModel, target: str, src: Sources, rp, read, what: str, directory: str
) -> torch.Tensor:
    """Rows ``[rp.start, rp.stop)`` of a converted parameter (a range of stacked experts), made
    from the checkpoint tensors of those experts only (one matrix per expert on disk)."""
    part = Sources(src.converter, [(k, p) for k, p in src.keys if rp.start <= _expert_of(k) < rp.stop])
    value = convert(model.hf_model, target, part, read)
    want = (rp.stop - rp.start, *rp.whole_shape[1:])
    if tuple(value.shape) != want:
        raise ConfigError(
            f"{what} = {directory!r}: experts {rp.start}-{rp.stop - 1} of {target!r} made from their checkpoint "
            f"tensors have shape {tuple(value.shape)}, the range expects {want}: the files are of another model"
        )
    return value


def _expert_of(key: str) -> int:
    """The expert number in a checkpoint key (``...mlp.experts.12.gate_proj.weight``), or -1."""
    found = re.search(r"\.experts\.(\d+)\.", key)
    return int(found.group(1)) if found else -1


def _check_converted(
    model: LayeredModel, target: str, src: Sources, shapes: dict[str, tuple[int, ...]], want: tuple, where: str
) -> None:
    """Before any work: the shape a converted parameter would have, from its checkpoint keys'
    shapes (the conversion run on meta tensors: no data read), is the model's; else the keys
    are named (an expert's tensors missing from a partial download, say)."""
    patterns = sorted({pattern for _, pattern in src.keys})
    missing = [k for k, _ in src.keys if k not in shapes]
    try:
        if missing:
            raise KeyError(missing[0])
        got = tuple(convert(model.hf_model, target, src, lambda k: torch.empty(shapes[k], device="meta")).shape)
    except (KeyError, RuntimeError, ValueError) as exc:  # a key the index names but its file lacks; shapes
        # that do not stack or concatenate
        raise ConfigError(
            f"{where}: weight {target!r} cannot be made from its checkpoint tensors ({', '.join(patterns)}): "
            f"{type(exc).__name__}: {one_line(exc)}; the files are incomplete or of another model: copy them again"
        ) from None
    if got == want:
        return
    raise ConfigError(
        f"{where}: weight {target!r} is made from {len(src.keys)} checkpoint tensors ({', '.join(patterns)}) into "
        f"shape {got}, the model expects {want}; some of them are missing from the safetensors files (an "
        "expert's?) or the weights are of another model: copy the checkpoint again"
    )


def tensor_source(model: LayeredModel, state: dict[str, torch.Tensor], describe: str = "given tensors") -> WeightSource:
    """Weights from an in-memory state dict, keyed by our names or, for HF models, by the
    HF model's own names (``hf_model.state_dict()``)."""
    hf_names = _hf_names(model) if model.hf_model is not None else {}

    def load(u: int, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            rp = model.row_pieces.get(name)
            whole = rp.whole if rp else name
            key = whole if whole in state else hf_names.get(name)
            if key not in state:
                raise KeyError(f"no tensor for {whole} (HF name {hf_names.get(name)}) among the given weights")
            out[name] = state[key][rp.start : rp.stop] if rp else state[key]
        return out

    return WeightSource(describe, load)


def _hf_names(model: LayeredModel) -> dict[str, str]:
    """Our full parameter names -> the HF model's names, matched by parameter identity; a
    vocabulary piece's name -> its whole matrix's HF name."""
    by_id = {id(p): n for n, p in model.hf_model.named_parameters()}
    out = {name: by_id[id(p)] for own in unit_param_names(model) for name, p in own if name not in model.row_pieces}
    for name, rp in model.row_pieces.items():
        out[name] = out[rp.whole] = by_id[id(getattr(rp.module, rp.attr))]
    return out
