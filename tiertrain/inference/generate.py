"""Offloaded generation: a batch of prompts decoded layer-major, weights read once per token.

Every decoding step (the prefill of the whole prompts first, then one token per step) walks
the model's units in order, each unit over every micro-batch (``data.micro_batch_size``
prompts each) while its weights are resident: the weights are read from where they are
(``weights.forward_params``: the model directory's safetensors, or their converted copy on
the storage tier with ``io.weights = tier``) once per token
for the whole batch, one unit ahead of the compute, through the parameter store's fixed slots;
the first units, as many as the host budget leaves room for (``weights.resident_budget``),
are read once at start and kept in host memory.

Prompts of different lengths are padded on the left, as ``transformers``' ``generate`` pads
them: the attention mask is 0 there, positions count only real tokens. Keys and values are
kept per micro-batch in ``transformers``' static cache in host memory, sized at start for the
micro-batch's longest prompt plus ``max_new_tokens``, within ``memory.kv_host_mib`` in host
(CUDA: device) memory, the rest on the storage tier (``kvcache.TieredKV``). Sampling: greedy (``temperature = 0``), or temperature with top-k and top-p from a
seeded generator; a row stops at a stop token, at the model's end-of-sequence token (its
``generation_config.json``'s ``eos_token_id``, else its ``config.json``'s; ``stop_at_eos``), or
at ``max_new_tokens``.

Built for Hugging Face Llama-family and GPT-2 models (``model.hf_dir``: transformers' static
cache and masks) and the built-in GPT (``models/gpt_decode.py``: a cache of the same shape);
``_Decoding`` holds what differs. The vocabulary is not cut into pieces here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Callable

import torch

from ..config import Config, ConfigError, as_config
from ..device.host import host_rss
from ..execute.walk import UnitWalk
from ..models import WeightSource
from ..models.families import family_of
from ..models.gpt_decode import GPTCache
from ..models.gpt_decode import decode_mask as gpt_decode_mask
from ..models.hf import decode_mask, kv_bytes, kv_dims, kv_shape, new_cache
from ..paths import check_writable_dir
from ..runtime import Runtime
from .budget import heap_trim, host_budget, kv_host_budget
from .kvcache import TieredKV
from .routed import weights_read
from .weights import forward_params

__all__ = ["Sampling", "generate", "eos_ids", "model_sampling"]

log = logging.getLogger("tiertrain")


_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True, kw_only=True)
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[int, ...] = ()  # token ids that end a row (kept in its output)
    stop_at_eos: bool = True  # the model's end-of-sequence ids end a row too, as in transformers' generate
    # transformers' RepetitionPenaltyLogitsProcessor over each row's ids so far (prompt, padding
    # and generated, as transformers' generate applies it); None: the model's generation_config.json's
    # repetition_penalty, as transformers' generate takes it (1.0, none, where it has none)
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        _sampling_types(self)
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens = {self.max_new_tokens}: generate at least 1 token")
        if not 0 <= self.seed < 2**63:  # (torch's generator: larger overflowed, a traceback)
            raise ConfigError(f"seed = {self.seed}: must be between 0 and {2**63 - 1}")
        if not (math.isfinite(self.temperature) and math.isfinite(self.top_p)):
            raise ConfigError(
                f"temperature = {self.temperature}, top_p = {self.top_p}: sampling settings must be "
                "finite numbers (temperature >= 0, 0 < top_p <= 1)"
            )
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"temperature = {self.temperature}, top_k = {self.top_k}, top_p = {self.top_p}: need "
                "temperature >= 0, top_k >= 0 and 0 < top_p <= 1"
            )
        p = self.repetition_penalty
        if p is not None and not (math.isfinite(p) and p > 0):
            raise ConfigError(
                f"repetition_penalty = {p}: must be a positive finite number (1.0: none; above 1 penalises "
                "tokens already in the row, as transformers' generate does)"
            )
        if 0 < self.temperature < _TINY:  # the logits are divided by it in float32: there, it is 0 or subnormal
            raise ConfigError(
                f"temperature = {self.temperature:g} is below {_TINY:.3g}, the smallest normal float32 (the logits "
                "are divided by it in float32); use 0 for greedy decoding, or a temperature of at least that"
            )


def _is_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _sampling_types(s: Sampling) -> None:
    """Refuse a field of the wrong type by name (a float max_new_tokens failed deep in the key/value
    cache, a seed given as text at a comparison, an int as stop at iterating it)."""
    ints = [f for f in ("max_new_tokens", "top_k", "seed") if not _is_int(getattr(s, f))]
    reals = [f for f in ("temperature", "top_p") if not _is_real(getattr(s, f))]
    stops = not isinstance(s.stop, (tuple, list)) or not all(_is_int(t) for t in s.stop)
    if s.repetition_penalty is not None and not _is_real(s.repetition_penalty):
        reals.append("repetition_penalty")
    if ints or reals or stops or not isinstance(s.stop_at_eos, bool):
        f = (ints + reals + (["stop"] if stops else []) + ["stop_at_eos"])[0]
        want = {"stop": "a tuple of token ids", "stop_at_eos": "True or False"}.get(
            f, "a whole number" if f in ints else "a number"
        )
        raise ConfigError(f"Sampling.{f} = {getattr(s, f)!r}: must be {want}")


def _pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The next token of every row from its last logits (``[B, V]``, fp32, on the compute
    device) and its ids so far (``ids``, ``[B, T]``). The distribution is shaped where the
    logits are; the draw is made on the host with ``gen`` (a CPU generator: CUDA refuses one
    for CUDA probabilities), so a seed draws the same tokens from the same probabilities on
    every device (``ids`` needed only with a repetition penalty)."""
    if s.repetition_penalty is not None and s.repetition_penalty != 1.0:  # before temperature, as transformers
        assert ids is not None
        logits = _repetition(s.repetition_penalty)(ids.to(logits.device), logits)
    if s.temperature == 0:
        return logits.argmax(dim=-1)
    # shifted by the row's largest first: a tiny temperature divides the differences, <= 0, so
    # nothing overflows to inf (whose softmax is NaN); the distribution is the same
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        logits = _top_p(logits, s.top_p)
    probs = torch.softmax(logits, dim=-1).to("cpu")  # sync point: the step's draw needs them on the host
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@functools.lru_cache(maxsize=4)
def _repetition(penalty: float):
    """transformers' ``RepetitionPenaltyLogitsProcessor`` for ``penalty`` (made once, not per token)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    return RepetitionPenaltyLogitsProcessor(penalty)


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with the tokens outside the smallest set whose probability reaches ``top_p``
    at -inf, as transformers' ``TopPLogitsWarper`` cuts them: ranked from the least likely
    up, a token goes while the mass up to it is at most ``1 - top_p`` (ties: the lower index
    first), the most likely always stays. (Counted from the top down, a token after a set
    that reached top_p exactly was kept, and ties went the other way.)"""
    sorted_, idx = torch.sort(logits, descending=False, dim=-1)
    drop = torch.softmax(sorted_, dim=-1).cumsum(dim=-1) <= 1 - top_p
    drop[..., -1] = False
    return logits.masked_fill(drop.scatter(1, idx, drop), float("-inf"))


def _generation_config(hf_dir: str | None) -> dict:
    """A model directory's ``generation_config.json`` ({} where it has none, or for the built-in
    GPT); refused where it does not parse or is no JSON object."""
    path = os.path.join(hf_dir, "generation_config.json") if hf_dir is not None else None
    if path is None or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            conf = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); restore it from the model's source") from None
    if not isinstance(conf, dict):
        raise ConfigError(f"{path} is not a JSON object (a {type(conf).__name__}); restore it from the model's source")
    return conf


def eos_ids(hf_dir: str | None, hf_config=None) -> tuple[int, ...]:
    """The model's end-of-sequence ids: ``generation_config.json``'s ``eos_token_id`` (an id or a
    list: chat models often have several, ``<|im_end|>`` among them), else ``config.json``'s;
    none for the built-in GPT (its tokenizer's, where the caller gives it)."""
    found = _generation_config(hf_dir).get("eos_token_id")
    if found is None and hf_config is not None:
        found = getattr(hf_config, "eos_token_id", None)
    if found is None:
        return ()
    return tuple(int(i) for i in (found if isinstance(found, (list, tuple)) else [found]))


def model_sampling(hf_dir: str | None) -> dict[str, float]:
    """The sampling a model directory's ``generation_config.json`` asks for (``do_sample`` true:
    its temperature, top_k and top_p where set, transformers' defaults otherwise; empty where it
    decodes greedily or has none)."""
    conf = _generation_config(hf_dir)
    if conf.get("do_sample") is not True:
        return {}
    out = {"temperature": conf.get("temperature", 1.0), "top_k": conf.get("top_k", 50), "top_p": conf.get("top_p")}
    return {k: float(v) for k, v in out.items() if _is_real(v)}


# transformers' generate applies these of a generation_config.json (their values that change
# nothing) where tiertrain does not: a model that sets one is said to decode otherwise here
_NOT_APPLIED = {
    "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None, []), "min_length": (None, 0),
    "min_new_tokens": (None, 0), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,), "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []), "sequence_bias": (None, {}), "renormalize_logits": (None, False),
    "typical_p": (None, 1, 1.0), "epsilon_cutoff": (None, 0, 0.0), "eta_cutoff": (None, 0, 0.0),
    "min_p": (None, 0, 0.0), "num_beams": (None, 1), "guidance_scale": (None, 1, 1.0),
}  # fmt: skip


def _model_penalty(s: Sampling, hf_dir: str | None) -> Sampling:
    """``s`` with its repetition penalty resolved (None: the model's generation_config.json's, as
    transformers' generate takes it, said); settings of that file that transformers' generate
    applies and this one does not, said by name."""
    conf = _generation_config(hf_dir)
    unapplied = {k: v for k, v in conf.items() if k in _NOT_APPLIED and v not in _NOT_APPLIED[k]}
    if unapplied:
        log.warning(
            "the model's generation_config.json sets %s, which transformers' generate applies and tiertrain's "
            "does not: its tokens may differ from transformers' there",
            ", ".join(f"{k} = {v!r}" for k, v in unapplied.items()),
        )
    if s.repetition_penalty is not None:
        return s
    own = conf.get("repetition_penalty")
    if _is_real(own) and math.isfinite(own) and own > 0 and own != 1.0:
        log.info(
            "repetition_penalty %g, the model's generation_config.json's (as transformers' generate applies it; "
            "give 1 to decode without)",
            own,
        )
        return dataclasses.replace(s, repetition_penalty=float(own))
    return dataclasses.replace(s, repetition_penalty=1.0)


class _Decoding:
    """What generation needs of a model kind: its context limit, vocabulary, padding id, cache
    shape and bytes, a new cache and a step's attention mask."""

    def __init__(self, rt, cfg: Config) -> None:
        self.hf = rt.model.hf_config
        m = cfg.model
        if self.hf is not None:
            self.limit = getattr(self.hf, "max_position_embeddings", None) or getattr(self.hf, "n_positions", None)
            self.vocab = self.hf.vocab_size
            pad = getattr(self.hf, "pad_token_id", None)  # (-1 in some converted configs: any id does, masked)
            self.pad = pad if isinstance(pad, int) and 0 <= pad < self.vocab else 0
            self.layers, self.kv_heads, self.head_dim = kv_shape(self.hf)
            self.dims = kv_dims(self.hf)
            field = getattr(family_of(self.hf), "recompute_past", None)
            self.again_at: int | None = getattr(self.hf, field, None) if field else None
        else:  # the built-in GPT
            self.limit, self.vocab, self.pad, self.again_at = m.max_seq_len, m.vocab_size, 0, None
            self.layers, self.kv_heads, self.head_dim = m.n_layers, m.n_heads, m.d_model // m.n_heads
            self.dims = (self.head_dim, self.head_dim)
        self.eos = eos_ids(m.hf_dir, self.hf)
        self.layer_of = rt.model.layer_of  # a block unit's layer (its key/value cache's): layers may be cut

    def again(self, length: int) -> bool:
        """Whether a decoding step whose sequences (padding included) are ``length`` long drops
        the cache and computes every position again: where they first pass the family's
        ``recompute_past`` (``families.py``; Phi-3's longrope switches tables there), as its
        ``prepare_inputs_for_generation`` does (a cache of ``length - 1`` positions, at most the
        field's value, with ``length`` past it)."""
        return self.again_at is not None and length == self.again_at + 1

    def kv_bytes(self, rows: int, max_len: int, dtype: torch.dtype) -> int:
        return kv_bytes(
            self.hf if self.hf is not None else (self.layers, self.kv_heads, self.head_dim), rows, max_len, dtype
        )

    def cache(self, max_len: int):
        return new_cache(self.hf, max_len) if self.hf is not None else GPTCache(self.layers)

    def mask(self, h: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, cache):
        if self.hf is not None:
            return decode_mask(self.hf, h, attention_mask, positions, cache)
        return gpt_decode_mask(attention_mask, h.shape[1])


class _Rows:
    """One micro-batch of prompts: left-padded ids, attention mask, cache, what it generated."""

    def __init__(self, prompts: list[list[int]], dec: _Decoding, new_tokens: int) -> None:
        width, pad = max(len(p) for p in prompts), dec.pad
        self.ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        self.mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        self.cache = dec.cache(width + new_tokens)  # its layers' memory: TieredKV's
        self.out: list[list[int]] = [[] for _ in prompts]
        self.done = torch.zeros(len(prompts), dtype=torch.bool)

    def positions(self, new: int) -> torch.Tensor:
        """Positions of the last ``new`` columns: real tokens counted from 0, padding at 1 (as
        transformers' ``generate`` sets them)."""
        pos = self.mask.cumsum(-1) - 1
        return pos.masked_fill(self.mask == 0, 1)[:, -new:]


def _check_prompts(prompts) -> None:
    """``prompts``: a list of token-id lists (a string, or one list of ids, is refused by name)."""
    ok = lambda p: isinstance(p, (list, tuple)) and all(isinstance(t, Integral) for t in p)  # noqa: E731
    listed = isinstance(prompts, (list, tuple))
    bad = next((p for p in prompts if not ok(p)), None) if listed else prompts
    if not listed or bad is not None:
        got = (
            f"a {type(prompts).__name__} holding {type(bad).__name__} {bad!r:.40}" if listed else type(prompts).__name__
        )
        raise TypeError(
            f"generate: prompts are a list of token-id lists, one a prompt, not {got}; tokenize text first (the "
            "model's tokenizer: tiertrain.data.tokenizer.load_tokenizer), or use `tiertrain generate --prompt TEXT`"
        )
    if not prompts:
        raise ConfigError("generate: no prompt given (an empty list)")
    if any(len(p) == 0 for p in prompts):
        raise ConfigError("generate: every prompt needs at least one token (an empty prompt was given)")


def generate(
    cfg: Config | dict | str,
    prompts: list[list[int]],
    sampling: Sampling = Sampling(),
    *,
    weights: WeightSource | None = None,
    device=None,
    on_tokens: Callable[[list[int | None]], None] | None = None,
    tokenizer_vocab: int | None = None,
    eos: tuple[int, ...] | None = None,
) -> list[list[int]]:
    """The tokens generated after each prompt (token ids; see the module docstring).
    ``on_tokens``: called after every step with each row's new token (None once it stopped),
    and once at the end with no tokens;
    ``tokenizer_vocab``: the tokenizer's size, refused when larger than the model's vocabulary;
    ``eos``: the end-of-sequence ids (default: the model directory's, see ``eos_ids``)."""
    cfg = as_config(cfg)  # (the Python API: a dict of sections or a TOML path too)
    _check_prompts(prompts)
    if not isinstance(sampling, Sampling):
        raise TypeError(f"generate: sampling is a Sampling(...), not a {type(sampling).__name__}: Sampling(**it)")
    if eos is not None and not (isinstance(eos, (tuple, list)) and all(_is_int(t) for t in eos)):
        raise ConfigError(f"generate: eos = {eos!r}: a tuple of token ids (() for none)")
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"generate: on_tokens is a function of each row's new token, not {on_tokens!r:.40}")
    if tokenizer_vocab is not None and not (_is_int(tokenizer_vocab) and tokenizer_vocab > 0):
        raise ConfigError(f"generate: tokenizer_vocab = {tokenizer_vocab!r}: the tokenizer's size, a positive integer")
    if sampling.temperature == 0 and (sampling.top_k or sampling.top_p < 1):  # greedy: nothing to cut
        log.warning(
            "top_k = %d, top_p = %g have no effect at temperature 0 (greedy: the likeliest token); give a "
            "temperature to sample",
            sampling.top_k,
            sampling.top_p,
        )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_pieces=1))
    rt = Runtime(cfg, weights=weights, device=device)
    rss_at_start = host_rss()  # the budget is what the run adds to the process (interpreter, libraries, model code)
    host = host_budget(cfg)  # once, before any weight is read: what is available drops as they are
    b = cfg.data.micro_batch_size
    try:  # what is refused is refused before any weight is read
        model, dec = rt.model, _Decoding(rt, cfg)
        _check(prompts, sampling, dec, tokenizer_vocab)
        if eos is not None and any(not 0 <= t < dec.vocab for t in eos):  # never produced: rows ran on
            raise ConfigError(f"generate: eos = {eos!r}: outside the model's vocabulary (0 to {dec.vocab - 1})")
        eos = tuple(eos) if eos is not None else dec.eos
        sampling = _model_penalty(sampling, cfg.model.hf_dir)
        if sampling.stop_at_eos and eos:
            sampling = dataclasses.replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *eos))))
            log.info(
                "a row ends at the model's end-of-sequence token%s %s (--ignore-eos to go on to max_new_tokens)",
                "s" if len(eos) > 1 else "",
                ", ".join(map(str, eos)),
            )
        groups = [_Rows(prompts[i : i + b], dec, sampling.max_new_tokens) for i in range(0, len(prompts), b)]
        kv_total = sum(dec.kv_bytes(len(g.out), g.ids.shape[1] + sampling.max_new_tokens, rt.dtype) for g in groups)
        budget = kv_host_budget(cfg, rt, kv_total, host)  # (None: all of it in memory)
        source = forward_params(cfg, rt, other_bytes=kv_total if budget is None else min(budget, kv_total), host=host)
    except BaseException:
        rt.close()
        raise
    kv, made, done = None, False, False
    try:
        store = rt.bind_params(source)
        made = False
        if budget is not None:  # the cache may spill: its directory (all in memory: none made, nothing written)
            check_writable_dir("io.paths", cfg.io.paths[0])  # (a file, a read-only one: a traceback)
            made = not os.path.exists(cfg.io.paths[0])  # removed again at the end if nothing is left in it
            os.makedirs(cfg.io.paths[0], exist_ok=True)
        kv = TieredKV(
            [g.cache for g in groups],
            [len(g.out) for g in groups],
            [g.ids.shape[1] + sampling.max_new_tokens for g in groups],
            kv_heads=dec.kv_heads,
            head_dim=dec.head_dim,
            dims=dec.dims,
            dtype=rt.dtype,
            dev=rt.dev,
            budget=budget,
            path=cfg.io.paths[0],
            checksum=cfg.io.checksum,
        )
        log.info(
            "key/value cache: %.3f MiB in host memory, %.3f MiB on the storage tier (%s), claimed at start",
            kv.host_bytes / 2**20,
            kv.spilled_bytes / 2**20,
            cfg.io.paths[0],
        )
        gen = torch.Generator().manual_seed(sampling.seed)
        walk = UnitWalk(store, model.plan, repeat=True)  # a pass over the model's units per token
        trim = heap_trim(cfg, rt, rss_at_start, host[0])
        t0, steps = time.perf_counter(), 0
        with torch.no_grad():
            model.eval()
            for step in range(sampling.max_new_tokens):
                more = step + 1 < sampling.max_new_tokens  # the last step prefetches nothing past itself
                last = _step(walk, groups, dec, step, rt.dev.device, more, kv, trim)
                picked = [_pick(logits.float(), sampling, gen, g.ids) for logits, g in zip(last, groups)]
                steps += 1
                if not _record(groups, picked, sampling, on_tokens):
                    break
        out = [row for g in groups for row in g.out]
        if on_tokens is not None:
            on_tokens([])  # the end: a streamed line is ended before the summary below is logged
        s = time.perf_counter() - t0
        read, experts = weights_read(store, source)
        made_tokens = sum(map(len, out))
        log.info(
            "generated %d tokens for %d prompts in %d steps, %.2f s (%.1f tok/s); weights: %d unit loads, "
            "%.3f GB read (%.2f MB a token), %.2f s waited; key/value cache on the storage tier: %.3f MiB read, "
            "%.3f MiB written%s",
            made_tokens,
            len(out),
            steps,
            s,
            made_tokens / s,
            store.stats.fetches,
            read / 1e9,
            read / max(1, made_tokens) / 1e6,
            store.stats.wait_s,
            kv.read_bytes / 2**20,
            kv.written_bytes / 2**20,
            f"; {experts}" if experts else "",
        )
        done = True
        return out
    finally:
        try:
            if kv is not None:
                try:
                    kv.close()  # its file removed, even when it raises
                except Exception:  # noqa: BLE001 - after another error, that one is the one to report
                    if done:
                        raise
        finally:
            if made and os.path.isdir(cfg.io.paths[0]) and not os.listdir(cfg.io.paths[0]):
                os.rmdir(cfg.io.paths[0])
            try:
                rt.close()
            finally:
                source.close()  # its files and threads, and the hooks routed reads put on the model


def _check(prompts: list[list[int]], sampling: Sampling, dec: _Decoding, tokenizer_vocab: int | None) -> None:
    """Refuse prompts the model cannot take, naming why."""
    longest = max(len(p) for p in prompts) + sampling.max_new_tokens
    if dec.limit is not None and longest > dec.limit:
        raise ConfigError(
            f"generate: the longest prompt plus max_new_tokens is {longest} tokens, more than the "
            f"model's context ({dec.limit}); shorten the prompt or lower max_new_tokens"
        )
    if tokenizer_vocab is not None and tokenizer_vocab > dec.vocab:
        raise ConfigError(
            f"generate: the tokenizer has {tokenizer_vocab} tokens, more than the model's vocabulary "
            f"({dec.vocab}); use the model's own tokenizer (data.tokenizer, or the one in model.hf_dir)"
        )
    if tokenizer_vocab is not None and tokenizer_vocab < dec.vocab:  # (a built-in model made larger than bytes)
        log.warning(
            "generate: the model's vocabulary (%d) is larger than the tokenizer's (%d): a token above it has no "
            "text and is shown as U+FFFD",
            dec.vocab,
            tokenizer_vocab,
        )
    bad = [t for t in sampling.stop if not 0 <= t < dec.vocab]
    if bad:
        raise ConfigError(f"generate: stop token id {bad[0]} is outside the model's vocabulary (0 to {dec.vocab - 1})")
    top, low = max(max(p) for p in prompts), min(min(p) for p in prompts)
    if top >= dec.vocab or low < 0:
        raise ConfigError(
            f"generate: a prompt holds token id {top if top >= dec.vocab else low}, outside the model's vocabulary "
            f"(0 to {dec.vocab - 1}); tokenize with the model's own tokenizer"
        )


def _step(
    walk: UnitWalk, groups: list[_Rows], dec: _Decoding, step: int, device, more: bool, kv, trim=None
) -> list[torch.Tensor]:
    """One decoding step over every micro-batch, unit by unit along the model's plan: the last
    logits of each. The units ahead are prefetched, round into the next step's where there is
    one (``more``); ``trim``: called after each unit (``weights.heap_trim``)."""
    ins, masks, poss = [], [], []
    for i, g in enumerate(groups):
        again = step > 0 and dec.again(g.ids.shape[1])
        if again:  # the cache dropped: the whole sequences again, as the prefill (new keys for every position)
            log.info("micro-batch %d: the key/value cache computed again at %d tokens, as the model's generate "
                     "does where its rotary tables switch", i, g.ids.shape[1])  # fmt: skip
            kv.restart(i)
        new = g.ids.shape[1] if step == 0 or again else 1
        ins.append(g.ids[:, -new:].to(device))
        poss.append(g.positions(new).to(device))
    h: list[torch.Tensor] = []
    for ref in walk.order:
        walk.enter(ref, more=more)  # a tied head binds the embedding's weights too
        unit = ref.module
        if ref.role == "embed":
            h = [unit.decode(x, p) for x, p in zip(ins, poss)]
            masks = [dec.mask(x, g.mask.to(device), p, g.cache) for x, g, p in zip(h, groups, poss)]
        elif ref.role == "block":
            out = []
            layer = dec.layer_of(ref.block)
            attends = getattr(unit, "attends", True)  # a sub-layer unit of the MLP has no keys or values
            for i, (x, m, p, g) in enumerate(zip(h, masks, poss, groups)):
                if attends:
                    kv.bring(layer, i)  # the layer's keys and values of micro-batch i in memory
                out.append(unit.decode(x, m, p, g.cache))
                if attends:
                    kv.send(layer, i, x.shape[1])  # the positions this step added, written alone (a window: whole)
            h = out
        else:
            h = [unit.logits(x[:, -1:])[:, -1] for x in h]
        walk.leave(ref, more=more)
        if trim is not None:
            trim()
    return h


def _record(groups: list[_Rows], picked: list[torch.Tensor], s: Sampling, on_tokens) -> bool:
    """Append each row's new token (rows that stopped take the pad and output nothing); False
    once every row has stopped."""
    shown: list[int | None] = []
    for g, tok in zip(groups, picked):
        tok = tok.cpu()
        for r, t in enumerate(tok.tolist()):
            if g.done[r]:
                shown.append(None)
                continue
            g.out[r].append(t)
            shown.append(t)
            if t in s.stop:
                g.done[r] = True
        g.ids = torch.cat([g.ids, tok.view(-1, 1)], dim=1)  # a stopped row's go on unseen (rows never meet)
        g.mask = torch.cat([g.mask, torch.ones(len(tok), 1, dtype=torch.long)], dim=1)
    if on_tokens is not None:
        on_tokens(shown)
    return not all(bool(g.done.all()) for g in groups)
