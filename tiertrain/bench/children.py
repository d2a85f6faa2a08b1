"""Benchmarks that run each setting in a process of its own (so that peak RSS is the setting's)
from the same initial weights: the weights written once, the children run and read back."""

from __future__ import annotations

import json
import subprocess
import sys

from .output import scratch_dir

__all__ = ["initial_weights", "hf_model", "run_child"]


def initial_weights(model_cfg, path: str) -> str:
    """The seeded initial weights of a model of ``model_cfg`` (a ``ModelConfig``), whole
    (unit by unit), in one safetensors file at ``path``."""
    import torch
    from safetensors.torch import save_file

    from ..models import build_model, random_source, unit_param_names

    model, _ = build_model(model_cfg, param_dtype=torch.float32, seed=0)
    src, tensors = random_source(model, 0), {}
    for u, own in enumerate(unit_param_names(model)):
        tensors.update(src.load(u, [n for n, _ in own]))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def hf_model(family: str, directory: str, **fields) -> str:
    """A transformers model of ``family`` with config ``fields``, random weights (seed 0),
    written by ``save_pretrained`` to ``directory``."""
    import torch
    import transformers as t

    torch.manual_seed(0)
    t.AutoModelForCausalLM.from_config(t.AutoConfig.for_model(family, **fields)).save_pretrained(directory)
    return directory


def run_child(script: str, label: str, flags: list[str], top: str) -> dict:
    """``python script --child <flags> --scratch=<a fresh folder in top>``; the dict its last
    stdout line holds (JSON). Exits naming ``label`` where it fails."""
    with scratch_dir(top, "child") as scratch:
        res = subprocess.run(
            [sys.executable, script, "--child", *flags, f"--scratch={scratch}"], capture_output=True, text=True
        )
    if res.returncode:
        raise SystemExit(f"{label} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])
