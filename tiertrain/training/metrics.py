"""Per-step metrics: one fixed line for people, the same record as JSON lines for tools."""

from __future__ import annotations

import json
import logging
import os
import statistics
from dataclasses import asdict, dataclass, field

from ..io.errors import StorageError, run_dir_write_failed

__all__ = ["StepRecord", "MetricsLog", "peak_flops", "flops_per_token", "AdapterFlops", "log"]

log = logging.getLogger("tiertrain")

# Dense bf16 peak FLOP/s of devices whose MFU we can state (per device), most specific
# name first: an H100 PCIe is not an H100 SXM.
_PEAKS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("4090", 165e12),
)


def peak_flops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, value in _PEAKS:
        if key in device_name:
            return value
    return None


@dataclass(frozen=True)
class AdapterFlops:
    """What a model's adapters add to ``flops_per_token`` (``LoRA.flops``): ``trained``, adapter
    weights a token multiplies through (a linear layer's A and B: 6 FLOPs each); ``weighted``,
    the ids of frozen parameters adapted through the weight itself (a mixture's 3-D experts:
    each forward forms ``W + B A``, so the backward forms that weight's gradient: 6 a weight
    at the experts' share, not 4); ``per_micro_batch``, the FLOPs of forming those sums and
    their backward into A and B (6 x experts x in x out x rank), once a micro-batch."""

    trained: int = 0
    weighted: frozenset[int] = frozenset()
    per_micro_batch: float = 0.0


def flops_per_token(
    model, seq_len: int, hidden: int, *, adapters: AdapterFlops | None = None, micro_batch_tokens: int | None = None
) -> float:
    """Training FLOPs per token (forward and backward) as the step computes them: per weight a
    token multiplies through, 2 forward, and backward 4 where the weight trains (the input's
    and the weight's gradients), 2 where it is frozen (the input's alone: a frozen base under
    adapters, ``train.freeze``), none before the first unit that trains where the embedding is
    frozen too (nothing asks their input's gradient). A mixture of experts' expert weights (3-D, ``[experts, ...]``) count at
    the share a token reaches (top-k of E). Blocks and head; a tied embedding counted once, with
    the head; the input embedding lookup is no product. ``adapters``: what adapters add
    (``AdapterFlops``; their per-micro-batch part spread over ``micro_batch_tokens``, the
    sequence where not given). Attention: per layer forward 2 x context x
    (heads x (query/key head dim + value head dim)), three times in all (its backward forms the
    queries', keys' and values' gradients whatever trains), the context the sequence (PaLM's
    accounting, without halving for the causal mask) or a sliding or chunked layer's window;
    the leading layers without a backward, their forward alone."""
    share = _expert_share(getattr(model, "hf_config", None))
    a = adapters or AdapterFlops()
    # the embedding is no product, but where it trains every unit's input gradient is asked
    trains = any(p.requires_grad for u in [*model.embed_pieces, model.embed] for p in u.parameters())
    trains, seen = trains or a.trained > 0 or bool(a.weighted), set()
    total = 6.0 * a.trained + a.per_micro_batch / (micro_batch_tokens or seq_len)
    forward_only = 0  # leading layers nothing asks a backward of (their attention: forward only)
    for k, unit in enumerate([*model.blocks, model.head, *model.head_pieces]):
        params = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        trains = trains or any(p.requires_grad for p in params)
        if not trains and k < len(model.blocks):
            forward_only = (model.block_layers[k] if model.block_layers is not None else k) + 1
        for p in params:
            per = 6 if p.requires_grad or id(p) in a.weighted else (4 if trains else 2)
            total += per * p.numel() * (share if p.dim() == 3 else 1.0)
    return total + _attention_flops(model, seq_len, hidden, forward_only)


_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _expert_share(config) -> float:
    """The share of a mixture of experts' expert weights a token multiplies through (1: dense)."""
    experts = next((getattr(config, k) for k in _EXPERTS if getattr(config, k, None)), 0) if config else 0
    top_k = getattr(config, "num_experts_per_tok", None) if config else None
    return top_k / experts if experts and top_k else 1.0


def _attention_flops(model, seq_len: int, hidden: int, forward_only: int = 0) -> float:
    """Attention's training FLOPs a token over the layers (``flops_per_token``); the first
    ``forward_only`` layers' forward alone."""
    from ..models.decoder import layer_types
    from ..models.masks import CHUNKED, SLIDING

    layers = len(set(model.block_layers)) if model.block_layers is not None else len(model.blocks)  # cut: layers
    c = getattr(model, "hf_config", None)
    if c is None:  # tiertrain's own GPT: heads x head dim is the width
        return (12.0 * layers - 8.0 * forward_only) * hidden * seq_len
    heads = getattr(c, "num_attention_heads", None) or 1
    head = getattr(c, "head_dim", None) or (getattr(c, "hidden_size", None) or hidden) // heads
    qk = getattr(c, "qk_head_dim", None) or head  # multi-head latent attention: its own dims
    v = getattr(c, "v_head_dim", None) or head
    window = {SLIDING: getattr(c, "sliding_window", None), CHUNKED: getattr(c, "attention_chunk_size", None)}
    types = layer_types(c) if getattr(c, "num_hidden_layers", None) else []
    total = 0.0
    for k in range(layers):
        ctx = min(seq_len, window.get(types[k] if k < len(types) else "", None) or seq_len)
        total += (2.0 if k < forward_only else 6.0) * ctx * heads * (qk + v)
    return total


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    step_s: float
    forward_s: float
    backward_s: float
    update_s: float
    io_wait_s: float
    ssd_read_bytes: int
    ssd_write_bytes: int
    ssd_read_gbps: float
    ssd_write_gbps: float
    peak_host_bytes: int
    peak_device_bytes: int
    mfu: float | None = None
    extra: dict = field(default_factory=dict)
    ssd_busy_s: float = 0.0  # wall time with any request on the storage tier in flight (the busiest path)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    def _judgement(self) -> str:
        """The speculative update's judgement of this step, as the step line says it."""
        return {True: ", speculation kept", False: ", speculation redone", None: ""}[self.extra.get("speculation_kept")]

    def line(self, steps: int) -> str:
        mfu = f"{100 * self.mfu:.1f}%" if self.mfu is not None else "-"
        return (
            f"step {self.step:>{len(str(steps))}}/{steps} | loss {self.loss:.4f}"
            + (f" val {self.extra['eval_loss']:.4f}" if "eval_loss" in self.extra else "")
            + (f" | epoch {self.extra['epoch']:.2f}" if "epoch" in self.extra else "")
            + " | "
            f"{self.tokens_per_s:,.0f} tok/s | mfu {mfu} | "
            f"ssd r {self.ssd_read_bytes / 1e9:.2f} GB {self.ssd_read_gbps:.2f} GB/s "
            f"w {self.ssd_write_bytes / 1e9:.2f} GB {self.ssd_write_gbps:.2f} GB/s | "
            f"peak host {self.peak_host_bytes / 2**20:,.0f} MiB dev {self.peak_device_bytes / 2**20:,.0f} MiB | "
            f"io wait {self.io_wait_s:.2f} s | {self.step_s:.2f} s"
            + (
                f" | engines: sent {self.extra['engine_sent_bytes'] / 1e9:.2f} GB, "
                f"r {self.extra['engine_read_bytes'] / 1e9:.2f} GB w {self.extra['engine_write_bytes'] / 1e9:.2f} GB, "
                f"params handed over {self.extra.get('engine_handoff_bytes', 0) / 1e9:.2f} GB, "
                f"peak host {self.extra.get('engine_peak_host_bytes', 0) / 2**20:,.0f} MiB"
                if "engine_sent_bytes" in self.extra
                else ""
            )
            + (
                f" | acts kept {self.extra['act_kept']}, ssd {self.extra['act_offloaded']} "
                f"({self.extra['act_offload_bytes'] / 1e9:.2f} GB), recomputed {self.extra['act_recomputed']}"
                if "act_kept" in self.extra
                else ""
            )
            + (
                f" | ranks {self.extra['ranks']}: net sent {self.extra['net_sent_bytes'] / 1e9:.3f} GB "
                f"received {self.extra['net_received_bytes'] / 1e9:.3f} GB per rank"
                + "".join(
                    f"; rank {i}: ssd r {x['ssd_read_bytes'] / 1e9:.2f} w {x['ssd_write_bytes'] / 1e9:.2f} GB, "
                    f"io wait {x['io_wait_s']:.2f} s, peak host {x['peak_host_bytes'] / 2**20:,.0f} MiB"
                    for i, x in enumerate(self.extra.get("per_rank", ()))
                )
                if "ranks" in self.extra
                else ""
            )
            + (
                f" | update thread {self.extra['update_thread_s']:.2f} s, "
                f"params handed over {self.extra.get('handoff_bytes', 0) / 1e9:.2f} GB{self._judgement()}"
                if "update_thread_s" in self.extra
                else ""
            )
            + (  # the baseline path speculating: its updates in the trainer's thread, during the backward
                f" | update in the backward {self.extra['update_spec_s']:.2f} s{self._judgement()}"
                if "update_spec_s" in self.extra
                else ""
            )
        )


# what TensorBoard gets of each step: tag -> the record's value (None: not in this record)
TB_SCALARS = {
    "loss/train": lambda r: r.loss,
    "loss/validation": lambda r: r.extra.get("eval_loss"),
    "optim/lr": lambda r: r.lr,
    "optim/grad_norm": lambda r: r.grad_norm,
    "speed/tokens_per_s": lambda r: r.tokens_per_s,
    "speed/step_s": lambda r: r.step_s,
    "memory/peak_host_mib": lambda r: r.peak_host_bytes / 2**20,
    "memory/peak_device_mib": lambda r: r.peak_device_bytes / 2**20,
    "io/ssd_read_gbps": lambda r: r.ssd_read_gbps,
    "io/ssd_write_gbps": lambda r: r.ssd_write_gbps,
}


class MetricsLog:
    """Writes ``metrics.jsonl`` in the run directory (and, with ``tensorboard``, event files in
    ``run_dir/tensorboard``: ``TB_SCALARS``) and keeps the records for the summary."""

    def __init__(self, run_dir: str, *, resume: bool = False, tensorboard: bool = False) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        try:
            self._f = open(self.path, "a" if resume else "w")
        except OSError as exc:
            raise self._error(exc) from None
        self.records: list[StepRecord] = []
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def add(self, rec: StepRecord) -> None:
        self.records.append(rec)
        d = asdict(rec)
        d["tokens_per_s"] = rec.tokens_per_s
        try:
            self._f.write(json.dumps(d) + "\n")
            self._f.flush()
        except OSError as exc:
            self._abandon()
            raise self._error(exc) from None
        if self._tb is not None:
            for tag, value in TB_SCALARS.items():
                v = value(rec)
                if v is not None:
                    self._tb.add_scalar(tag, v, rec.step)
            self._tb.flush()

    def summary(self) -> str:
        if not self.records:
            return "no steps run"
        recs = self.records
        steady = recs[1:] if len(recs) > 2 else recs  # the first step pays for warm-up
        med = statistics.median(r.step_s for r in steady)
        tok = statistics.median(r.tokens_per_s for r in steady)
        rd = statistics.median(r.ssd_read_bytes for r in steady)
        wr = statistics.median(r.ssd_write_bytes for r in steady)
        return (
            f"{len(recs)} step{'s' if len(recs) != 1 else ''}: loss {recs[0].loss:.4f} -> {recs[-1].loss:.4f}"
            + (
                f", validation loss {vals[0]:.4f} -> {vals[-1]:.4f}"
                if (vals := [r.extra["eval_loss"] for r in recs if "eval_loss" in r.extra])
                else ""
            )
            + f"; median step {med:.2f} s, "
            f"{tok:,.0f} tok/s; per step ssd read {rd / 1e9:.2f} GB, written {wr / 1e9:.2f} GB; "
            f"peak host {max(r.peak_host_bytes for r in recs) / 2**20:,.0f} MiB"
            + (
                f" (+ engines {eng / 2**20:,.0f} MiB)"
                if (eng := max(r.extra.get("engine_peak_host_bytes", 0) for r in recs))
                else ""
            )
            + (
                f"; activations per step: {last['act_kept']} pairs kept, {last['act_offloaded']} on the storage tier "
                f"({last['act_offload_bytes'] / 1e9:.2f} GB), {last['act_recomputed']} recomputed"
                if "act_kept" in (last := recs[-1].extra)
                else ""
            )
            + (f"; {last['speculation']}" if "speculation" in last else "")
        )

    def _error(self, exc: OSError) -> StorageError:
        return run_dir_write_failed(self.path, "the step records", exc)

    def _abandon(self) -> None:
        """Close the file after a failed write, dropping what it could not write: closing it
        normally would try that write again, and fail again (a second error for one cause)."""
        try:
            self._f.close()
        except OSError:
            pass  # the buffer is dropped; the file is closed all the same

    def close(self) -> None:
        if not self._f.closed:
            try:
                self._f.close()
            except OSError as exc:
                raise self._error(exc) from None
        if self._tb is not None:
            self._tb.close()
