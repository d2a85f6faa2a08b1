"""``tiertrain eval``: the loss and perplexity of a model on a held-out text, without training.

The model runs forward only, layer-major, through the same runtime as training: its units'
weights are read from where they are (a Hugging Face directory's safetensors, a directory
written by ``tiertrain export`` or a safetensors file given as ``model.init_from``, or the
seeded random init), one unit at a time into the parameter store's fixed slots, converted
to the compute dtype on a reader thread (``WeightParams``). No state file is made, nothing is
written; memory is the slots (``memory.device_slots`` x the largest unit) plus one unit's
activations per micro-batch, whatever the model's size.

The text is ``data.eval_corpus`` cut into windows as the validation loss cuts it
(``data.EvalSet``), all of them by default; the loss is the mean over its micro-batches of the
mean cross-entropy, and the perplexity its exponential. A tiertrain checkpoint is read
directly (``CheckpointWeights``: its weights file, checksummed first); ``io.weights = tier``
reads a converted copy instead (``weights.py``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import time
from dataclasses import dataclass

import torch

from ..config import Config, ConfigError
from ..data import EvalSet
from ..io import IOFuture
from ..models import WeightSource, vocab_size_of
from ..runtime import Runtime
from ..execute.executor import LayerMajorExecutor
from ..state.layout import FlatLayout
from ..state.sources import ParamSource
from .validation import validation_loss

__all__ = ["EvalResult", "WeightParams", "CheckpointWeights", "evaluate"]

log = logging.getLogger("tiertrain")


class WeightParams(ParamSource):
    """A forward-only model's parameters, read unit by unit from its ``WeightSource`` on one
    reader thread (loads overlap the compute of the unit before), converted to ``dtype``."""

    file_backed = True  # never host-resident: every unit is loaded into a slot

    def __init__(self, layout: FlatLayout, source: WeightSource, dtype: torch.dtype) -> None:
        self.layout, self.source, self.dtype = layout, source, dtype
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="tiertrain-weights")

    def on_host(self, u: int) -> bool:
        return False

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("forward-only weights are never used in place")

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        return IOFuture([self._pool.submit(self._fill, u, out)])

    def _fill(self, u: int, out: torch.Tensor) -> int:
        unit = self.layout.units[u]
        values = self.source.load(u, [r.name for r in unit.params])
        out[: unit.numel].zero_()  # alignment padding
        for rec in unit.params:
            t = values[rec.name]
            if tuple(t.shape) != tuple(rec.shape):
                raise ConfigError(f"weights for {rec.name} have shape {tuple(t.shape)}, the model expects "
                                  f"{tuple(rec.shape)}")
            out[rec.offset : rec.offset + rec.numel].copy_(t.reshape(-1))
        return unit.numel * out.element_size()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CheckpointWeights:
    """A tiertrain checkpoint's weights (the weights state its run declared: fp32 master
    weights where kept), read unit by unit from its file. The whole file's CRC32C is checked
    against the manifest first, in one streaming pass of one unit's memory. ``config``: the
    checkpoint's config (a dict: the model to build, flags go on top); ``source``: the
    ``WeightSource`` to evaluate with. A context manager."""

    def __init__(self, path: str) -> None:
        from ..checkpoint import Manifest, find_checkpoint
        from ..checkpoint.export import weights_file
        from ..io import FileHandle

        self.path = find_checkpoint(path, "eval --checkpoint")
        man = Manifest.read(self.path)
        w = weights_file(self.path, man)
        file, self.dtype, entry = w.path, w.dtype, w.entry
        self.config, self.layout = man.config, w.layout
        self.source = WeightSource(describe=f"checkpoint {self.path} (step {man.step})", load=self.load)
        self._buf = torch.empty(self.layout.max_unit_numel, dtype=self.dtype)
        self._file = FileHandle(file, "r")
        try:
            self._verify(entry)
        except BaseException:
            self.close()
            raise

    def _read(self, u: int) -> torch.Tensor:
        unit, e = self.layout.units[u], self.dtype.itemsize
        view = self._buf[: unit.numel]
        self._file.read(view, unit.numel * e, unit.offset * e)
        return view

    def _verify(self, entry) -> None:
        from ..checkpoint import CheckpointError
        from ..io.checksum import crc32c

        crc = 0
        for u in range(len(self.layout.units)):  # as export chains it: unit by unit, in order
            crc = crc32c(self._read(u).view(torch.uint8).numpy(), crc)
        if crc != entry.crc32c:
            raise CheckpointError(f"checkpoint {self.path}: its weights are corrupt (crc32c {crc:#010x}, the manifest "
                                  f"says {entry.crc32c:#010x}); use an earlier checkpoint")

    def load(self, u: int, names: list[str]) -> dict[str, torch.Tensor]:
        view = self._read(u)  # one reader thread (WeightParams): the buffer is reused unit after unit
        return {r.name: view[r.offset : r.offset + r.numel].view(r.shape) for r in self.layout.units[u].params}

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "CheckpointWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy, nats per token
    perplexity: float
    tokens: int  # targets scored
    micro_batches: int
    seconds: float

    def line(self) -> str:
        return (f"eval: {self.tokens:,} tokens in {self.micro_batches} micro-batches | loss {self.loss:.4f} | "
                f"perplexity {self.perplexity:.2f} | {self.tokens / self.seconds:,.0f} tok/s")


def evaluate(cfg: Config, *, weights: WeightSource | None = None, device=None) -> EvalResult:
    """The loss of ``cfg``'s model on ``cfg.data.eval_corpus`` (see the module docstring).
    ``weights`` overrides where the weights come from (tests)."""
    if cfg.data.eval_corpus is None:
        raise ConfigError("data.eval_corpus is not set: give the text to evaluate on, e.g. "
                          "--data.eval_corpus=held_out.txt (a .txt file, a token file, or 'bundled')")
    evalset = EvalSet(cfg.data)
    rt = Runtime(cfg, weights=weights, device=device)
    vocab = vocab_size_of(rt.model, cfg)
    if evalset.vocab_size > vocab:
        rt.close()
        raise ConfigError(f"data.eval_corpus: its tokenizer has {evalset.vocab_size} tokens, the model's "
                          f"vocabulary {vocab}; evaluate with the model's own tokenizer (data.tokenizer)")
    from .weights import forward_params

    try:
        source = forward_params(cfg, rt)
    except BaseException:
        rt.close()
        raise
    try:
        store = rt.bind_params(source)
        executor = LayerMajorExecutor(rt.model, store, None, None, rt.dev)
        log.info("model: %s %s, %s; %s", cfg.model.kind, rt.dtype, rt.layout.describe(), rt.weights.describe)
        t0 = time.perf_counter()
        with torch.no_grad():
            loss = validation_loss(evalset, executor, cfg.data.micro_batches)
        seconds = time.perf_counter() - t0
    finally:
        rt.close()
        source.close()
    tokens = evalset.total_scored() or evalset.count * cfg.data.micro_batch_size * cfg.data.seq_len
    return EvalResult(loss, math.exp(loss) if loss < 700 else math.inf, tokens, evalset.count, seconds)
