"""peft's adapter directories: the names peft gives our adapters, export and import.

A peft adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose
keys are ``base_model.model.<module path in the transformers model>.lora_A.weight`` (and
``lora_B``), without the adapter's name: what ``PeftModel.from_pretrained`` loads onto the
original base model. The built-in ``gpt`` model has no transformers class: its module paths are
tiertrain's own, for ``peft.inject_adapter_in_model`` on it.

An adapter on an experts' 3-D parameter (``target_parameters``) is peft's ``ParamWrapper``,
which takes the experts module's place; a second adapted parameter of the same module wraps the
first wrapper, and so on, in the module's parameter order. So the keys name the module, not the
parameter: Mixtral's ``mlp.experts.lora_A.weight`` is ``down_proj``'s (the outer wrapper) and
``mlp.experts.base_layer.lora_A.weight`` is ``gate_up_proj``'s.
"""

from __future__ import annotations

import json
import os

import torch

from ..config import AdapterConfig, ConfigError
from ..config.adapter import FUSED_KEY, PEFT_CONFIG, fused_patterns, peft_settings
from ..models.base import LayeredModel
from ..paths import mode_as_created
from .lora import LoRA

__all__ = ["module_names", "peft_state", "export_peft", "load_peft", "read_peft_config", "PEFT_WEIGHTS", "PEFT_CONFIG"]

PEFT_WEIGHTS = "adapter_model.safetensors"


def module_names(model: LayeredModel, lora: LoRA) -> dict[str, str]:
    """Our target names -> the path of peft's module holding the adapter in the transformers
    model (the built-in model: its own path), found by module identity; for an experts'
    parameter, the module's path and a ``.base_layer`` per adapted parameter after it (peft's
    nested wrappers)."""
    if model.hf_model is None:
        by_id = {id(t.module): t.name.rsplit(".", 1)[0] for t in lora.targets if t.param is not None}
    else:
        by_id = {id(m): n for n, m in model.hf_model.named_modules()}
    out = {}
    for t in lora.targets:
        if t.param is None:
            out[t.name] = by_id[id(t.module)] if model.hf_model is not None else t.name
            continue
        later = [u for u in lora.targets if u.module is t.module and u.param is not None]
        depth = len(later) - 1 - later.index(t)  # the first adapted parameter is the innermost wrapper
        out[t.name] = by_id[id(t.module)] + ".base_layer" * depth
    return out


def peft_state(model: LayeredModel, lora: LoRA) -> dict[str, torch.Tensor]:
    """The adapters under peft's saved names, fp32 on the host."""
    names = module_names(model, lora)
    out = {}
    for t, p in zip(lora.targets, lora.adapters):
        base = f"base_model.model.{names[t.name]}"
        out[f"{base}.lora_A.weight"] = p.lora_A.weight.detach().float().cpu().contiguous()
        out[f"{base}.lora_B.weight"] = p.lora_B.weight.detach().float().cpu().contiguous()
    return out


def _patterns(lora: LoRA) -> dict:
    """peft's rank and alpha patterns for parameters adapted at a multiple of the rank (a fused
    gate_up_proj: ``peft_names``), written as peft writes them, so it loads them as trained."""
    f = lora.names.factor
    if not f:
        return {}
    assert set(f) == {"gate_up_proj"}, f  # the one parameter peft fuses
    return {"rank_pattern": {FUSED_KEY: lora.cfg.rank * 2}, "alpha_pattern": {FUSED_KEY: lora.cfg.alpha * 2}}


def export_peft(model: LayeredModel, lora: LoRA, out_dir: str, *, base_path: str | None = None) -> list[str]:
    """Write ``lora`` as a peft adapter directory in ``out_dir``; the files written."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    cfg = lora.cfg
    fan_in_fan_out = any(type(t.module).__name__ == "Conv1D" for t in lora.targets if t.param is None)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if model.hf_model is not None else None,
        "base_model_name_or_path": base_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": lora.kinds,  # (never a name peft would take for the experts: peft_names)
        "target_parameters": sorted(lora.names.parameters) or None,
        **_patterns(lora),
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    weights = os.path.join(out_dir, PEFT_WEIGHTS)
    save_file(peft_state(model, lora), weights, metadata={"format": "pt"})
    mode_as_created(weights)
    conf = os.path.join(out_dir, PEFT_CONFIG)
    with open(conf, "w") as f:
        json.dump(config, f, indent=2)
    return [weights, conf]


def _check_paths(directory: str, paths: list[str]) -> None:
    """Refuse an adapter whose ``target_modules`` hold module paths (peft's 'all-linear' written
    out, or some layers' alone) that leave out one of the modules adapted here (``paths``: those
    modules' paths in the transformers model): peft adapts a module whose path is a target or
    ends in '.' and one."""
    with open(os.path.join(directory, PEFT_CONFIG)) as f:
        targets = [str(t) for t in (json.load(f).get("target_modules") or [])]
    if not any("." in t for t in targets):
        return
    left = [p for p in paths if not any(p == t or p.endswith(f".{t}") for t in targets)]
    if left:
        raise ConfigError(
            f"adapter.init_from = {directory!r}: its target_modules name module paths that leave out {len(left)} "
            f"of the modules of those names (first: {left[0]}); tiertrain adapts a name's modules in every layer: "
            "give an adapter made for all of them"
        )


def read_peft_config(directory: str) -> AdapterConfig:
    """The ``[adapter]`` section a peft LoRA directory was made with."""
    return AdapterConfig(kind="lora", init_from=directory, **peft_settings(directory))


def load_peft(model: LayeredModel, lora: LoRA, directory: str) -> None:
    """Set ``lora``'s adapters from a peft directory (made for this model's architecture and
    the same rank and targets: each tensor's name and shape checked)."""
    from safetensors.torch import load_file

    theirs, ours, kinds = read_peft_config(directory), lora.cfg, lora.kinds
    diff = [
        f"{k} {a!r} (here {b!r})"
        for k, a, b in (
            ("rank", theirs.rank, ours.rank), ("alpha", theirs.alpha, ours.alpha), ("target", theirs.target, kinds),
            ("target_parameters", theirs.target_parameters, sorted(lora.names.parameters)),
        )
        if a != b
    ]  # fmt: skip
    if diff:
        raise ConfigError(
            f"adapter.init_from = {directory!r} was made with {', '.join(diff)}: set adapter.rank, adapter.alpha, "
            "adapter.target and adapter.target_parameters as it has them"
        )
    with open(os.path.join(directory, PEFT_CONFIG)) as f:
        fused = fused_patterns(json.load(f))
    if fused != bool(lora.names.factor):
        raise ConfigError(
            f"adapter.init_from = {directory!r} {'has' if fused else 'has no'} gate_up_proj adapters at twice the "
            f"rank (peft's reading of gate_proj and up_proj, or w1 and w3, on a mixture of experts), this run "
            f"{'has not' if fused else 'has'}: "
            + (
                "give adapter.target the names it was made from (with gate_proj and up_proj, or w1 and w3)"
                if fused
                else "leave gate_proj and up_proj (w1 and w3) out of adapter.target, as it was made"
            )
        )
    path = os.path.join(directory, PEFT_WEIGHTS)
    if not os.path.exists(path):
        raise ConfigError(f"adapter.init_from = {directory!r}: it has no {PEFT_WEIGHTS}")
    have = load_file(path)
    have = {k.replace(".default.", "."): v for k, v in have.items()}  # saved with the adapter's name, too
    want = peft_state(model, lora)
    names = module_names(model, lora)  # (paths leaving some layers out: said as such, before what is missing)
    _check_paths(directory, [names[t.name] for t in lora.targets if t.param is None])
    missing = [k for k in want if k not in have]
    if missing:
        raise ConfigError(
            f"adapter.init_from = {directory!r}: {len(missing)} adapters this model needs are not in it (first: "
            f"{missing[0]}); it was made for another model or other targets"
        )
    extra = sorted(set(have) - set(want))
    if extra:  # (a trained head of modules_to_save, biases, another adapter's tensors: never silently left out)
        raise ConfigError(
            f"adapter.init_from = {directory!r}: {PEFT_WEIGHTS} holds {len(extra)} tensor(s) this run's LoRA does "
            f"not take (first: {extra[0]}); it was made for other targets or with settings tiertrain does not "
            "compute"
        )
    with torch.no_grad():
        for t, p in zip(lora.targets, lora.adapters):
            for ab, w in (("lora_A", p.lora_A.weight), ("lora_B", p.lora_B.weight)):
                key = f"base_model.model.{names[t.name]}.{ab}.weight"  # peft_state's names
                if tuple(have[key].shape) != tuple(w.shape):
                    raise ConfigError(
                        f"adapter.init_from = {directory!r}: {key} has shape {tuple(have[key].shape)}, this run's "
                        f"adapter {tuple(w.shape)} (adapter.rank = {lora.cfg.rank})"
                    )
                w.copy_(have[key])
