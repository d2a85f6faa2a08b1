"""The adapters' update and checkpointed state: torch's own optimizer over the resident adapters.

The adapters are the only trained parameters of a LoRA run (the base is frozen): their norm is
the step's global norm and clipping is ``clip_grad_norm_``'s (``get_total_norm`` then
``clip_grads_with_norm_``, the two halves it is made of), and the step is torch's fused AdamW
(or SGD) over them, the kernels plain PyTorch runs: the same math by construction.

Checkpointed as ``adapter.safetensors`` (weights, the optimizer's per-parameter state, the
adapter config it was made with); a resumed run must have the same adapter config.
"""

from __future__ import annotations

import json

import torch

from ..config import Config, ConfigError, OptimConfig
from ..update.adamw8bit import plain_optimizer
from .lora import LoRA

__all__ = ["AdapterUpdate", "ADAPTER_FILE", "same_adapter_config"]

ADAPTER_FILE = "adapter.safetensors"
_KEYS = ("kind", "rank", "alpha", "dropout", "target", "target_parameters")  # what must match on resume
_SINCE = {"target_parameters": []}  # keys checkpoints written before them lack: their value then


def same_adapter_config(ours: dict, theirs: dict | None, where: str) -> None:
    """Refuse to continue a run whose adapters were configured otherwise (``theirs``: the
    ``[adapter]`` section stored with the checkpoint, None where it has none)."""

    def norm(d: dict | None) -> dict:
        d = d or {}
        return {k: d.get(k, _SINCE.get(k)) for k in _KEYS} if d.get("kind", "none") != "none" else {"kind": "none"}

    a, b = norm(theirs), norm(ours)
    diff = [k for k in _KEYS if a.get(k) != b.get(k)]
    if diff:
        got = ", ".join(f"{k} {a.get(k)!r}" for k in diff if k in a)
        want = ", ".join(f"{k} {b.get(k)!r}" for k in diff if k in b)
        raise ConfigError(
            f"{where} was made with adapter {got}; this run has {want}: resume with the [adapter] config it was "
            "made with (or start a new run from its weights)"
        )


class AdapterUpdate:
    """The optimizer of ``lora``'s parameters, as ``optim`` configures it."""

    def __init__(self, lora: LoRA, optim: OptimConfig) -> None:
        self.lora, self.o = lora, optim
        ps = lora.params()
        self.opt: torch.optim.Optimizer = plain_optimizer(optim, ps)

    def reduce(self, group) -> None:
        """With ranks: every adapter's gradient summed over the ranks, in rank order (as the
        model's gradients are), the same bits on every rank. Sync point."""
        if group.world == 1:
            return
        ps = self.lora.params()
        flat = torch.cat([p.grad.reshape(-1) for p in ps]).cpu()  # collectives on host memory (Gloo)
        total = group.sum_in_rank_order(flat)
        a = 0
        for p in ps:
            p.grad.copy_(total[a : a + p.numel()].view_as(p.grad))
            a += p.numel()

    def total_norm(self) -> torch.Tensor:
        """The global gradient norm (the adapters are every trained parameter), as
        ``clip_grad_norm_`` computes it."""
        grads = [p.grad for p in self.lora.params() if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return torch.nn.utils.get_total_norm(grads, 2.0)

    def step(self, lr: float, norm: torch.Tensor) -> None:
        """Clip with ``norm`` (``optim.grad_clip``, if on), step, drop the gradients."""
        ps = [p for p in self.lora.params() if p.grad is not None]
        if self.o.grad_clip > 0 and ps:
            torch.nn.utils.clip_grads_with_norm_(ps, self.o.grad_clip, norm)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state(self, cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Tensors and metadata of ``adapter.safetensors``."""
        out = {name: p.detach().cpu().contiguous() for name, p in self.lora.named()}
        for i, p in enumerate(self.lora.params()):
            for k, v in self.opt.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"optimizer.{i}.{k}"] = v.detach().cpu().clone()  # bitsandbytes shares its maps
                elif isinstance(v, int):  # bitsandbytes' step count (torch's is a float32 tensor)
                    out[f"optimizer.{i}.{k}"] = torch.tensor(v, dtype=torch.int64)
        return out, {"adapter": json.dumps(_section(cfg))}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict[str, str], cfg: Config, where: str) -> None:
        """Restore ``state``'s output (``where``: the checkpoint, for errors)."""
        same_adapter_config(_section(cfg), json.loads(meta.get("adapter", "null")), where)
        self.lora.load_named(tensors)
        self.opt.state.clear()
        for i, p in enumerate(self.lora.params()):
            state = {
                k.split(".", 2)[2]: int(v) if v.dtype == torch.int64 and v.dim() == 0 else v.to(p.device)
                for k, v in tensors.items()
                if k.startswith(f"optimizer.{i}.")
            }
            if state:
                self.opt.state[p] = state


def _section(cfg: Config) -> dict:
    a = cfg.adapter
    return {
        "kind": a.kind, "rank": a.rank, "alpha": a.alpha, "dropout": a.dropout, "target": list(a.target),
        "target_parameters": list(a.target_parameters),
    }  # fmt: skip
