"""``tiertrain export``: a checkpoint's weights as sharded safetensors, one unit per shard.

For Hugging Face models the output is a model directory (``config.json``, shards with the
model's own names, ``model.safetensors.index.json``) that ``from_pretrained`` and
``model.hf_dir`` load; for the built-in GPT, shards with tiertrain's names that
``model.init_from`` loads. Memory: one unit at a time. fp32 master weights are exported
where the run kept them, else the parameters in their own precision.
"""

from __future__ import annotations

import json
import os

import torch

from ..config import Config
from ..io import FileHandle
from ..io.checksum import crc32c
from ..models import _hf_names, build_model
from ..state.layout import FlatLayout
from .manifest import CheckpointError, Manifest

__all__ = ["export_checkpoint"]


def export_checkpoint(path: str, out: str) -> str:
    man = Manifest.read(path)
    cfg = Config.from_dict(man.config)
    model, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    layout = FlatLayout(model)
    if [u.numel for u in layout.units] != man.units:
        raise CheckpointError(f"checkpoint {path}: its layout does not match the model its config describes")
    name = "master.bin" if man.entry("master.bin") else "params.bin"
    entry = man.entry(name)
    dtype = torch.float32 if name == "master.bin" else getattr(torch, man.param_dtype.removeprefix("torch."))
    names = _hf_names(model) if model.hf_model is not None else {}
    os.makedirs(out, exist_ok=True)
    if model.hf_config is not None:
        model.hf_config.save_pretrained(out)
    weight_map, total, crc = {}, 0, 0
    n = len(layout.units)
    buf = torch.empty(layout.max_unit_numel, dtype=dtype)
    from safetensors.torch import save_file

    with FileHandle(os.path.join(path, name), "r") as f:
        if f.size != entry.size:
            raise CheckpointError(f"checkpoint file {f.path} is truncated: {f.size} bytes, the manifest says {entry.size}")
        for unit in layout.units:
            view = buf[: unit.numel]
            f.read(view, unit.numel * dtype.itemsize, unit.offset * dtype.itemsize)
            crc = crc32c(view.view(torch.uint8).numpy(), crc)
            shard = f"model-{unit.index + 1:05d}-of-{n:05d}.safetensors"
            tensors = {names.get(r.name, r.name): view[r.offset : r.offset + r.numel].view(r.shape).clone() for r in unit.params}
            save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
            for key, t in tensors.items():
                weight_map[key] = shard
                total += t.numel() * t.element_size()
    if crc != entry.crc32c:
        raise CheckpointError(f"checkpoint file {os.path.join(path, name)} is corrupt: crc32c {crc:#010x}, "
                              f"the manifest says {entry.crc32c:#010x}")
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out, "tiertrain.json"), "w") as f:
        json.dump({"step": man.step, "config": man.config}, f, indent=1)
    return out
