"""The names of ``adapter.target`` as peft reads them on a mixture of experts of transformers 5.

transformers 5 fused the experts' linear layers of many MoE families into 3-D parameters
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). peft (0.18 on, with transformers 5)
keeps adapters made for the old layout loading: on those families it takes the old experts'
names in ``target_modules`` (Qwen-style: ``gate_proj``, ``up_proj``, ``down_proj``; Mixtral-style:
``w1``, ``w3``, ``w2``) for the fused parameters (``target_parameters``), ``gate_up_proj`` at twice
the rank and twice the alpha (the same scaling), and removes them from ``target_modules``: the
dense layers and shared experts of those names get no adapter in peft. A router named
``gate`` becomes its ``gate.weight``.

tiertrain reads the names the same way (``resolve``), so that a run is peft's on the same
config and its export loads in peft as trained: the export writes what peft would have made
of the names (``target_parameters``, and ``rank_pattern``/``alpha_pattern`` for the fused
parameter), which peft then takes as they are. Which families: transformers' own table of
checkpoint conversions (``conversion_mapping``), the two patterns peft maps."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from .adapter import AdapterConfig

__all__ = ["PeftNames", "resolve"]

# peft's table (``utils/transformers_weight_conversion.py``): the old name -> the fused parameter
_MAPPED = {
    "qwen2_moe": {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"},
    "mixtral": {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
}  # fmt: skip
_FUSED = {"qwen2_moe": ("gate_proj", "up_proj"), "mixtral": ("w1", "w3")}  # -> gate_up_proj


@dataclass(frozen=True)
class PeftNames:
    """``adapter.target`` and ``adapter.target_parameters`` as peft takes them on this model:
    ``target`` the linear layers' names left (empty with ``every``: every linear layer but those
    ``dropped`` names), ``parameters`` the 3-D parameters, ``factor`` a parameter's rank (and
    alpha) multiplier (``gate_up_proj``: 2 where both fused names were given)."""

    target: list[str]
    parameters: list[str]
    every: bool
    factor: dict[str, int] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()  # the old experts' names taken off the linear layers (said)

    def rank(self, param: str | None, rank: int) -> int:
        return rank * self.factor.get(param or "", 1)


def _pattern(hf_config) -> str | None:
    """peft's conversion pattern of this model's family ('qwen2_moe', 'mixtral'), None where
    peft takes the names as they are (transformers 4, dense families, gpt-oss, Qwen2-MoE)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type is None:
        return None
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN, get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4: the experts are linear layers by those names
        return None
    pattern = {**_MODEL_TO_CONVERSION_PATTERN, "mixtral": "mixtral"}.get(model_type)  # (peft adds mixtral)
    if pattern not in _MAPPED or get_checkpoint_conversion_mapping(model_type) is None:
        return None
    return pattern


def resolve(cfg: AdapterConfig, hf_config) -> PeftNames:
    """What peft makes of ``cfg``'s names on the model of ``hf_config`` (see the module
    docstring); refused where peft refuses (one of two fused names) or where it would adapt
    what tiertrain does not (a router's weight)."""
    names, params = list(cfg.target), list(cfg.target_parameters)
    pattern = _pattern(hf_config)
    if pattern is None:
        return PeftNames(names, params, every=not names and not params)
    mapped = _MAPPED[pattern]
    if not names and not params:  # every linear layer: not the old experts' names (see the module docstring)
        return PeftNames([], [], every=True, dropped=tuple(n for n in mapped if n != "gate"))
    if "gate" in names:
        raise ConfigError(
            f"adapter.target = {names!r}: on a {hf_config.model_type} model peft takes 'gate' for the router's "
            "weight (target_parameters 'gate.weight'), which tiertrain does not adapt; leave 'gate' out"
        )
    fused = [n for n in _FUSED[pattern] if n in names]
    if len(fused) == 1:
        other = next(n for n in _FUSED[pattern] if n not in names)
        raise ConfigError(
            f"adapter.target = {names!r}: on a {hf_config.model_type} model peft takes {fused[0]!r} for the experts' "
            f"fused gate_up_proj, and refuses it without {other!r} (they are one parameter): name both, or neither"
        )
    left = [n for n in names if n not in mapped]
    new = [mapped[n] for n in names if n in mapped]
    params = list(dict.fromkeys([*params, *new]))
    factor = {"gate_up_proj": 2} if fused else {}
    dropped = tuple(n for n in names if n in mapped)
    return PeftNames(left, params, every=False, factor=factor, dropped=dropped)
