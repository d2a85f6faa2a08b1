"""The ``[adapter]`` section: low-rank adapters (LoRA) trained on a frozen base (``adapters/``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError
from .sections import Section, opt

__all__ = ["AdapterConfig", "PEFT_CONFIG", "peft_settings", "with_peft_settings"]

PEFT_CONFIG = "adapter_config.json"

_SCALARS = ("rank", "alpha", "dropout")  # the adapters' settings with a plain default


@dataclass(kw_only=True)
class AdapterConfig(Section):
    """Low-rank adapters on a frozen base: the base is streamed from its tier read-only (no
    gradient, no optimizer state, never written); the adapters and their AdamW state stay in
    the compute device's memory."""

    SECTION: ClassVar[str] = "adapter"
    kind: str = opt("none", "'none' (train the model itself) or 'lora' (adapters on the frozen model).")
    rank: int = opt(16, "LoRA rank r: A is r x in, B is out x r.")
    alpha: float = opt(32.0, "LoRA alpha: the adapters' output is scaled by alpha / rank (as peft).")
    dropout: float = opt(
        0.0,
        "Dropout on the adapters' input (as peft's lora_dropout). Above 0 the draws come in the "
        "layer-major order, not plain PyTorch's: runs stay reproducible but not bit-equal to peft's.",
    )
    target: list[str] = opt(
        None,
        "Modules that get adapters, by their last name as peft spells them (Llama: q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj; GPT-2: c_attn, c_proj, c_fc; the built-in gpt: qkv, proj, fc, "
        "out). Empty (or peft's 'all-linear'): every linear layer of the blocks (none where "
        "adapter.target_parameters is set, as in peft).",
        factory=list,
    )
    target_parameters: list[str] = opt(
        None,
        "The experts' 3-D parameters that get adapters, as peft's target_parameters names them: a parameter's "
        "name or a dotted tail of its path (Mixtral, Qwen-MoE, OLMoE, gpt-oss, DeepSeek-V3: gate_up_proj, "
        "down_proj; or mlp.experts.down_proj). One adapter per parameter, rank r per expert; no dropout (peft "
        "refuses it there).",
        factory=list,
    )
    init_from: str | None = opt(
        None,
        "A peft adapter directory (adapter_model.safetensors, adapter_config.json) to start from instead of "
        "the seeded initialisation (or, in eval and generate, to apply); adapter.rank, alpha, dropout, target and "
        "target_parameters left unset are its own, and set must be its own (a difference is named).",
    )

    def __post_init__(self) -> None:
        self._one_of("kind", ("none", "lora"))
        self._at_least("rank", 1)
        if not self.alpha > 0:
            self._fail("alpha", "must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            self._fail("dropout", "must be >= 0 and < 1")
        if self.init_from is not None and not self.on:  # it was ignored: the model alone trained
            self._fail("init_from", "is a peft adapter to start from: set adapter.kind = 'lora' too, or unset it")
        if isinstance(self.target, str):
            self.target = [self.target]
        if isinstance(self.target_parameters, str):
            self.target_parameters = [self.target_parameters]
        if not self.on:  # an adapter's setting without adapters would be ignored: the model itself trained
            unset = {"target": [], "target_parameters": [], **{f: getattr(AdapterConfig, f) for f in _SCALARS}}
            for name, default in unset.items():
                if getattr(self, name) != default:
                    self._fail(
                        name,
                        "sets up adapters, but adapter.kind = 'none' trains the model itself: set "
                        "adapter.kind = 'lora' too, or unset it",
                    )
        if "all-linear" in self.target:  # peft's name for every linear layer of the blocks: this one's empty target
            if len(self.target) > 1 or self.target_parameters:
                self._fail("target", "'all-linear' stands alone (and without adapter.target_parameters)")
            self.target = []
        bad = [t for t in self.target if not isinstance(t, str) or not t or not t.replace("_", "").isalnum()]
        if bad:
            self._fail("target", f"{bad!r} are not module names (letters, digits and '_', such as 'q_proj')")
        bad = [t for t in self.target_parameters if not isinstance(t, str) or not _dotted(t)]
        if bad:
            self._fail(
                "target_parameters",
                f"{bad!r} are not parameter names (letters, digits and '_', dotted, such as 'mlp.experts.down_proj')",
            )
        if self.target_parameters and self.dropout > 0:  # peft's ParamWrapper refuses it as well
            self._fail(
                "dropout",
                "must be 0 with adapter.target_parameters: an expert's input cannot be dropped out apart from its "
                "weight's delta (peft refuses lora_dropout there too)",
            )

    @property
    def on(self) -> bool:
        return self.kind != "none"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _dotted(name: str) -> bool:
    return all(part and part.replace("_", "").isalnum() for part in name.split("."))


# peft LoRA settings that change what an adapter computes, beyond rank, alpha and targets
UNSUPPORTED = (
    "use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "modules_to_save", "bias", "lora_bias",
    "layers_to_transform", "layers_pattern", "layer_replication", "trainable_token_indices", "use_qalora",
    "alora_invocation_tokens", "exclude_modules",
)  # fmt: skip


FUSED_KEY = r".*\.gate_up_proj"  # peft's pattern for the experts' fused gate and up projections


def fused_patterns(c: dict) -> bool:
    """Whether a peft config's rank and alpha patterns are exactly what peft writes when it takes
    gate_proj and up_proj (w1 and w3) for a mixture of experts' fused ``gate_up_proj``: twice the
    rank and alpha there, nothing else (``adapters/peft_names.py``)."""
    try:
        r, alpha = int(c["r"]), float(c["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        return False
    return (
        c.get("rank_pattern") == {FUSED_KEY: 2 * r}
        and c.get("alpha_pattern") == {FUSED_KEY: 2 * alpha}
        and "gate_up_proj" in (c.get("target_parameters") or [])
    )


def peft_settings(directory: str) -> dict[str, Any]:
    """The ``[adapter]`` fields a peft LoRA directory (its ``adapter_config.json``) was made
    with: rank, alpha, dropout, target and target_parameters."""
    path = os.path.join(directory, PEFT_CONFIG)
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"adapter.init_from = {directory!r}: {PEFT_CONFIG} does not load ({exc})") from None
    if not isinstance(c, dict):
        raise ConfigError(f"adapter.init_from = {directory!r}: {PEFT_CONFIG} is not an object (a {type(c).__name__})")
    if c.get("peft_type") != "LORA":
        raise ConfigError(
            f"adapter.init_from = {directory!r}: not a LoRA adapter (peft_type {c.get('peft_type')!r}); "
            "tiertrain's adapters are peft's plain LoRA"
        )
    fused = fused_patterns(c)  # peft's own reading of gate_proj and up_proj on a MoE: computed (peft_names)
    used = [
        f"{k} = {c[k]!r}"
        for k in UNSUPPORTED
        if c.get(k) not in (None, False, "none", [], {}) and not (fused and k in ("rank_pattern", "alpha_pattern"))
    ]
    if used:  # each changes what the adapter computes: taken as plain LoRA, its loss was another model's
        raise ConfigError(
            f"adapter.init_from = {directory!r}: {PEFT_CONFIG} sets {', '.join(used)}, which tiertrain's LoRA "
            "does not compute (it would be read as plain LoRA, silently another model); give an adapter made "
            "without them"
        )
    targets = c.get("target_modules") or []
    if isinstance(targets, str):
        raise ConfigError(f"adapter.init_from = {directory!r}: target_modules {targets!r} (a pattern) is not supported")
    try:
        # module paths (peft writes 'all-linear' out as every adapted module's path): their last
        # names, the modules of those names in every block (checked against the paths: load_peft)
        names = sorted({str(t).rsplit(".", 1)[-1] for t in targets})
        return dict(
            rank=int(c["r"]), alpha=float(c["lora_alpha"]), dropout=float(c.get("lora_dropout", 0.0)),
            target=names, target_parameters=sorted(c.get("target_parameters") or []),
        )  # fmt: skip
    except KeyError as exc:  # (a traceback: KeyError 'r')
        raise ConfigError(f"adapter.init_from = {directory!r}: {PEFT_CONFIG} has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"adapter.init_from = {directory!r}: {PEFT_CONFIG} holds a bad value ({exc})") from None


def with_peft_settings(values: dict[str, Any]) -> dict[str, Any]:
    """An ``[adapter]`` table (the fields a config file and flags set) with those it leaves
    unset taken from its ``init_from``'s peft config, where adapters are on: an adapter applied
    or continued is described by its own directory (those set must agree: ``load_peft``)."""
    unset = [f for f in ("rank", "alpha", "dropout", "target", "target_parameters") if f not in values]
    if values.get("kind") != "lora" or values.get("init_from") in (None, "", "none", "null") or not unset:
        return values
    return {**peft_settings(str(values["init_from"])), **values}
