"""peft's adapter directories: the names peft gives our adapters, export and import.

A peft adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose
keys are ``base_model.model.<module path in the transformers model>.lora_A.weight`` (and
``lora_B``), without the adapter's name: what ``PeftModel.from_pretrained`` loads onto the
original base model. The built-in ``gpt`` model has no transformers class: its module paths are
tiertrain's own, for ``peft.inject_adapter_in_model`` on it.
"""

from __future__ import annotations

import json
import os

import torch

from ..config import AdapterConfig, ConfigError
from ..models.base import LayeredModel
from ..paths import mode_as_created
from .lora import LoRA

__all__ = ["module_names", "peft_state", "export_peft", "load_peft", "read_peft_config", "PEFT_WEIGHTS", "PEFT_CONFIG"]

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def module_names(model: LayeredModel, lora: LoRA) -> dict[str, str]:
    """Our target names -> the module's path in the transformers model (the built-in model:
    its own path), found by module identity."""
    if model.hf_model is None:
        return {t.name: t.name for t in lora.targets}
    by_id = {id(m): n for n, m in model.hf_model.named_modules()}
    return {t.name: by_id[id(t.module)] for t in lora.targets}


def peft_state(model: LayeredModel, lora: LoRA) -> dict[str, torch.Tensor]:
    """The adapters under peft's saved names, fp32 on the host."""
    names = module_names(model, lora)
    out = {}
    for t, p in zip(lora.targets, lora.adapters):
        base = f"base_model.model.{names[t.name]}"
        out[f"{base}.lora_A.weight"] = p.lora_A.weight.detach().float().cpu().contiguous()
        out[f"{base}.lora_B.weight"] = p.lora_B.weight.detach().float().cpu().contiguous()
    return out


def export_peft(model: LayeredModel, lora: LoRA, out_dir: str, *, base_path: str | None = None) -> list[str]:
    """Write ``lora`` as a peft adapter directory in ``out_dir``; the files written."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    cfg = lora.cfg
    fan_in_fan_out = any(type(t.module).__name__ == "Conv1D" for t in lora.targets)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if model.hf_model is not None else None,
        "base_model_name_or_path": base_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": lora.kinds,
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


def read_peft_config(directory: str) -> AdapterConfig:
    """The ``[adapter]`` section a peft LoRA directory was made with."""
    path = os.path.join(directory, PEFT_CONFIG)
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"adapter.init_from = {directory!r}: {PEFT_CONFIG} does not load ({exc})") from None
    if c.get("peft_type") != "LORA" or c.get("use_dora") or c.get("use_rslora"):
        raise ConfigError(
            f"adapter.init_from = {directory!r}: not a plain LoRA adapter (peft_type {c.get('peft_type')!r})"
        )
    targets = c.get("target_modules") or []
    if isinstance(targets, str):
        raise ConfigError(f"adapter.init_from = {directory!r}: target_modules {targets!r} (a pattern) is not supported")
    return AdapterConfig(
        kind="lora", rank=int(c["r"]), alpha=float(c["lora_alpha"]), dropout=float(c.get("lora_dropout", 0.0)),
        target=sorted(targets), init_from=directory,
    )  # fmt: skip


def load_peft(model: LayeredModel, lora: LoRA, directory: str) -> None:
    """Set ``lora``'s adapters from a peft directory (made for this model's architecture and
    the same rank and targets: each tensor's name and shape checked)."""
    from safetensors.torch import load_file

    theirs, ours, kinds = read_peft_config(directory), lora.cfg, lora.kinds
    diff = [
        f"{k} {a!r} (here {b!r})"
        for k, a, b in (("rank", theirs.rank, ours.rank), ("alpha", theirs.alpha, ours.alpha), ("target", theirs.target, kinds))
        if a != b
    ]  # fmt: skip
    if diff:
        raise ConfigError(
            f"adapter.init_from = {directory!r} was made with {', '.join(diff)}: set adapter.rank, adapter.alpha and "
            "adapter.target as it has them"
        )
    path = os.path.join(directory, PEFT_WEIGHTS)
    if not os.path.exists(path):
        raise ConfigError(f"adapter.init_from = {directory!r}: it has no {PEFT_WEIGHTS}")
    have = load_file(path)
    have = {k.replace(".default.", "."): v for k, v in have.items()}  # saved with the adapter's name, too
    want = peft_state(model, lora)
    missing = [k for k in want if k not in have]
    if missing:
        raise ConfigError(
            f"adapter.init_from = {directory!r}: {len(missing)} adapters this model needs are not in it (first: "
            f"{missing[0]}); it was made for another model or other targets"
        )
    names = module_names(model, lora)
    with torch.no_grad():
        for t, p in zip(lora.targets, lora.adapters):
            for ab, w in (("lora_A", p.lora_A.weight), ("lora_B", p.lora_B.weight)):
                key = f"base_model.model.{names[t.name]}.{ab}.weight"
                if tuple(have[key].shape) != tuple(w.shape):
                    raise ConfigError(
                        f"adapter.init_from = {directory!r}: {key} has shape {tuple(have[key].shape)}, this run's "
                        f"adapter {tuple(w.shape)} (adapter.rank = {lora.cfg.rank})"
                    )
                w.copy_(have[key])
