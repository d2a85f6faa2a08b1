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
mean cross-entropy (with a mixture of experts whose config asks for it, plus the routers'
auxiliary loss, as the model's forward adds it: shown apart), and the perplexity the
exponential of the cross-entropy alone. A tiertrain checkpoint is read
directly (``CheckpointWeights``: its weights file, checksummed first); ``io.weights = tier``
reads a converted copy instead (``weights.py``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from ..config import Config, ConfigError, as_config
from ..data import EvalSet
from ..device.host import host_rss
from ..execute.executor import LayerMajorExecutor
from ..models import WeightSource, model_name, vocab_size_of
from ..runtime import Runtime
from .routed import weights_read
from .validation import validation_loss

__all__ = ["EvalResult", "evaluate"]

log = logging.getLogger("tiertrain")


@dataclass
class EvalResult:
    loss: float  # the model's loss as its forward computes it: the mean cross-entropy (plus, where
    # the config asks for it, the routers' auxiliary loss), nats per token
    perplexity: float  # exp of the cross-entropy alone
    tokens: int  # targets scored
    micro_batches: int
    seconds: float
    read_bytes: int = 0  # the weights' bytes read (routed experts: those reached)
    experts: str = ""  # a mixture of experts' routed reads, in words ('' without)
    aux: float = 0.0  # the routers' auxiliary loss in ``loss`` (coefficient included; 0 without)

    @property
    def cross_entropy(self) -> float:
        return self.loss - self.aux

    def line(self) -> str:
        parts = f" (cross-entropy {self.cross_entropy:.4f} + routers' aux {self.aux:.4f})" if self.aux else ""
        return (
            f"eval: {self.tokens:,} tokens in {self.micro_batches} micro-batches | loss {self.loss:.4f}{parts} | "
            f"perplexity {self.perplexity:.2f} | {self.tokens / self.seconds:,.0f} tok/s | weights "
            f"{self.read_bytes / 1e9:.3f} GB read ({self.read_bytes / max(1, self.tokens) / 1e6:.3f} MB a token)"
            + (f" | {self.experts}" if self.experts else "")
        )


def evaluate(cfg: Config | dict | str, *, weights: WeightSource | None = None, device=None) -> EvalResult:
    """The loss of ``cfg``'s model on ``cfg.data.eval_corpus`` (see the module docstring).
    ``weights`` overrides where the weights come from (tests)."""
    cfg = as_config(cfg)  # (the Python API: a dict of sections or a TOML path too)
    if cfg.data.eval_corpus is None:
        raise ConfigError(
            "data.eval_corpus is not set: give the text to evaluate on, e.g. "
            "--data.eval_corpus=held_out.txt (a .txt file, a token file, or 'bundled')"
        )
    evalset = EvalSet(cfg.data)
    rt = Runtime(cfg, weights=weights, device=device)
    rss_at_start = host_rss()  # the budget is what the run adds to the process (interpreter, libraries, model code)
    vocab = vocab_size_of(rt.model, cfg)
    if evalset.vocab_size > vocab:
        rt.close()
        raise ConfigError(
            f"data.eval_corpus: its tokenizer has {evalset.vocab_size} tokens, the model's "
            f"vocabulary {vocab}; evaluate with the model's own tokenizer (data.tokenizer)"
        )
    from .budget import heap_trim, host_budget
    from .weights import forward_params

    host = host_budget(cfg)  # once, before any weight is read: what is available drops as they are
    try:
        source = forward_params(cfg, rt, host=host)
    except BaseException:
        rt.close()
        raise
    try:
        store = rt.bind_params(source)
        executor = LayerMajorExecutor(
            rt.model, store, None, None, rt.dev, after_unit=heap_trim(cfg, rt, rss_at_start, host[0])
        )
        log.info(
            "model: %s %s, %s; %s", model_name(rt.model, cfg.model), rt.dtype, rt.layout.describe(), rt.weights.describe
        )
        t0 = time.perf_counter()
        with torch.no_grad():
            aux: list[float] = []
            loss = validation_loss(evalset, executor, cfg.data.micro_batches, aux=aux)
        seconds = time.perf_counter() - t0
        read, experts = weights_read(store, source)
    finally:
        try:
            rt.close()
        finally:
            source.close()  # its files and threads, and the hooks routed reads put on the model
    tokens = evalset.total_scored() or evalset.count * cfg.data.micro_batch_size * cfg.data.seq_len
    ce = loss - aux[0]  # perplexity is the cross-entropy's: the auxiliary loss is not a likelihood
    if not math.isfinite(loss):  # (a perplexity of inf read as a model merely bad)
        log.warning("eval: the loss is %s: the weights hold non-finite values (a diverged run?)", loss)
    return EvalResult(
        loss, math.inf if ce >= 700 else math.exp(ce), tokens, evalset.count, seconds, read, experts, aux[0]
    )
