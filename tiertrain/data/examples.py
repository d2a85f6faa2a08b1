"""Prepared examples: token ids, a loss mask per token and example boundaries, on disk and
memory-mapped, and the batches of every step cut from them.

A prepared directory (``tiertrain prepare --input rows.jsonl --output DIR``) holds
``ids.tokens`` (a token file, ``tokens.py``: every example's ids one after the other, each
ending with its EOS), ``mask.bin`` (one byte per token: 1 where the token is a loss target),
``offsets.bin`` (int64, examples + 1: where each example starts) and ``meta.json`` (counts,
the tokenizer, the source, the checksums of the two other files). Written streaming, one
example at a time, under temporary names; ``meta.json`` last (its presence says complete).

Batches (``ExampleBatches``): a step takes ``world x micro_batches x micro_batch_size`` rows
from a row sequence that runs over epochs; rank r keeps its share in C order (as the
random-window sampler does), so the rows of step s depend on (seed, s) alone and a resumed run
sees exactly the rows an uninterrupted one would. Epoch e visits the examples in the order of
a permutation seeded by (seed, e). Examples longer than ``seq_len + 1`` tokens are cut to it
or dropped (``data.long_examples``; counted and logged at start).

- ``data.packing = true``: the epoch's examples, in its order, are one stream of tokens (the
  EOS of each ends it before the next); row j is the stream's tokens ``[j T, j T + T + 1)``
  (inputs its first T, targets its last T). With ``data.packed_attention = 'document'`` each
  token attends only to the tokens of its own document in the row: ``positions`` gives every
  row's positions restarting at 0 where a document (or the row) starts, from which the models
  make a block-diagonal causal mask (transformers from the position ids, the built-in GPT in
  ``models.base.document_mask``); ``'row'``: attention across the row, positions 0 .. T-1.
- ``data.packing = false``: one example per row, inputs padded after its end with EOS and
  targets with the ignore index; causal attention means the padding never changes what the
  real tokens compute.

Targets that are not scored (mask 0, padding) hold ``IGNORE`` (-100, torch's and transformers'
ignore index). ``scored(step)`` is the number of scored targets in the whole step, every rank's:
each micro-batch's loss is its summed cross-entropy over that number, so the step's loss is the
mean over the step's scored tokens however the step is cut into micro-batches and ranks.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Iterable

import numpy as np
import torch

from ..errors import UsageError
from ..io.checksum import crc32c
from ..paths import missing_dirs, remove_dead_temporaries, remove_empty_dirs
from .formats import Example
from .tokens import read_tokens, tokens_checksum, write_tokens

__all__ = ["IGNORE", "PreparedExamples", "ExampleBatches", "UnscoredStep", "write_examples", "is_prepared"]

log = logging.getLogger("tiertrain")
IGNORE = -100
META = "meta.json"
# what a prepared directory holds (and a preparation may replace): the files and their temporaries
PREPARED_FILES = frozenset({"ids.tokens", "mask.bin", "offsets.bin", META, META + ".tmp"})
FORMAT = "tiertrain-examples"


# rows checked for a scored token before the first step (about 20 us a row)
CHECK_ROWS = 200_000


class UnscoredStep(UsageError):
    """A step whose rows hold no scored token: its loss has no divisor."""


def is_prepared(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META))


def write_examples(
    out_dir: str,
    examples: Iterable[Example],
    *,
    vocab_size: int,
    eos: int,
    describe: Callable[[], dict],
    empty: str | None = None,
) -> dict:
    """Write ``examples`` (streamed) as a prepared directory; its metadata returned
    (``describe()``'s fields, asked once every example is written, added). A failure (bad data,
    no example, Ctrl-C) leaves none of what it wrote, nor the directory where it made it.
    ``empty``: the error where there is no example (else the ``prepare`` command's)."""
    made = missing_dirs(out_dir)  # it and its parents that are not there yet
    os.makedirs(out_dir, exist_ok=True)
    try:
        return _write_examples(out_dir, examples, vocab_size=vocab_size, eos=eos, describe=describe, empty=empty)
    except BaseException:
        for name in ("ids.tokens", "mask.bin", "offsets.bin", META + ".tmp"):
            path = os.path.join(out_dir, name)
            if made and os.path.exists(path):  # (in a directory it did not make, the files may be an earlier run's)
                os.remove(path)
        remove_empty_dirs(made)
        raise


def _write_examples(
    out_dir: str,
    examples: Iterable[Example],
    *,
    vocab_size: int,
    eos: int,
    describe: Callable[[], dict],
    empty: str | None,
) -> dict:
    tmp = {n: os.path.join(out_dir, f"{n}.tmp{os.getpid()}") for n in ("mask.bin", "offsets.bin")}
    for name in tmp:
        remove_dead_temporaries(os.path.join(out_dir, name))  # a killed earlier preparation's
    count, crcs, longest = [0, 0], {"mask.bin": 0, "offsets.bin": 0}, 0
    scored = 0
    try:
        with open(tmp["mask.bin"], "wb") as fm, open(tmp["offsets.bin"], "wb") as fo:

            def put(name, f, arr):
                data = arr.tobytes()
                crcs[name] = crc32c(np.frombuffer(data, dtype=np.uint8), crcs[name])
                f.write(data)

            put("offsets.bin", fo, np.zeros(1, "<i8"))

            def ids():
                nonlocal longest, scored
                for ex in examples:
                    count[0] += 1
                    count[1] += len(ex.ids)
                    longest = max(longest, len(ex.ids))
                    scored += int(ex.mask[1:].sum())
                    put("mask.bin", fm, ex.mask.astype(np.uint8))
                    put("offsets.bin", fo, np.asarray([count[1]], "<i8"))
                    yield ex.ids

            if write_tokens(os.path.join(out_dir, "ids.tokens"), ids(), vocab_size) == 0:
                os.remove(os.path.join(out_dir, "ids.tokens"))
                raise UsageError(empty or f"prepare: the input holds no example; nothing written to {out_dir}")
        # every row read and written (a bad row left an earlier preparation here whole): from here
        # the directory is incomplete until its metadata is rewritten
        if os.path.exists(os.path.join(out_dir, META)):
            os.remove(os.path.join(out_dir, META))
        for name, path in tmp.items():
            os.replace(path, os.path.join(out_dir, name))
    finally:
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)
    meta = dict(
        format=FORMAT,
        version=1,
        examples=count[0],
        tokens=count[1],
        longest=longest,
        scored=scored,
        vocab_size=vocab_size,
        eos=eos,
        crc32c=crcs,
        **describe(),
    )
    with open(os.path.join(out_dir, META + ".tmp"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(os.path.join(out_dir, META + ".tmp"), os.path.join(out_dir, META))
    return meta


class PreparedExamples:
    """A prepared directory, memory-mapped; its sizes and checksums checked at open."""

    def __init__(self, path: str, what: str = "data.corpus", source: str | None = None) -> None:
        self.path = path
        # what messages name: the user's rows where this is their copy in the prepared-data cache
        self.name = f"{source} (prepared in {path})" if source else path
        try:
            with open(os.path.join(path, META)) as f:
                self.meta = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(
                f"{what} = {path}: not a prepared examples directory ({exc}); make it with `tiertrain prepare`"
            ) from None
        if self.meta.get("format") != FORMAT or self.meta.get("version") != 1:
            raise UsageError(
                f"{what} = {path}: {META} is not tiertrain's (format {self.meta.get('format')!r}); prepare it again"
            )
        self.ids, self.vocab_size = read_tokens(os.path.join(path, "ids.tokens"))
        n, t = self.meta["examples"], self.meta["tokens"]
        self.mask = self._raw("mask.bin", np.uint8, t, what)
        self.offsets = self._raw("offsets.bin", np.dtype("<i8"), n + 1, what)
        if len(self.ids) != t or self.offsets[-1] != t:
            raise UsageError(
                f"{what} = {path}: its files disagree on the token count ({len(self.ids)} ids, "
                f"{int(self.offsets[-1])} in the offsets, {t} in {META}); prepare it again"
            )
        self.eos, self.count = int(self.meta["eos"]), n
        self.lengths = np.diff(self.offsets)
        crc = self.meta["crc32c"]  # the rows' content, wherever they lie (a checkpoint records it)
        ids = tokens_checksum(os.path.join(path, "ids.tokens"))
        self.identity = f"{n} examples, {t} tokens, crc32c {ids:08x}-{crc['mask.bin']:08x}-{crc['offsets.bin']:08x}"

    def _raw(self, name: str, dtype, count: int, what: str) -> np.ndarray:
        p = os.path.join(self.path, name)
        size = os.path.getsize(p) if os.path.exists(p) else -1
        if size != count * np.dtype(dtype).itemsize:
            raise UsageError(
                f"{what} = {self.path}: {name} is {'missing' if size < 0 else f'{size} bytes'}, expected "
                f"{count * np.dtype(dtype).itemsize}; it is truncated or damaged: prepare it again"
            )
        arr = np.memmap(p, dtype=dtype, mode="r", shape=(count,))
        if crc32c(np.frombuffer(arr, dtype=np.uint8)) != self.meta["crc32c"][name]:
            raise UsageError(
                f"{what} = {self.path}: {name} does not match its checksum; the file is corrupt: prepare it again"
            )
        return arr


class ExampleBatches:
    """The rows of every step (see the module docstring): ``batches(step, rank, world)`` as
    ``Corpus.batches``, ``scored(step, world)`` the step's scored targets."""

    def __init__(
        self,
        data: PreparedExamples,
        *,
        seq_len: int,
        micro_batch_size: int,
        micro_batches: int,
        seed: int,
        packing: bool,
        long_examples: str,
        shuffle: bool = True,
        by_document: bool = True,
    ) -> None:
        self.data, self.T, self.B, self.M = data, seq_len, micro_batch_size, micro_batches
        self.seed, self.packing, self.shuffle = seed, packing, shuffle
        self.by_document = packing and by_document
        self.vocab_size = data.vocab_size
        lengths = data.lengths
        too_long = lengths > seq_len + 1
        self.keep = np.flatnonzero(~too_long) if long_examples == "drop" else np.arange(data.count)
        self.lengths = np.minimum(lengths, seq_len + 1)  # 'truncate': the first seq_len + 1 tokens
        if too_long.any():
            log.info(
                "data: %d of %d examples are longer than seq_len + 1 = %d tokens: %s (data.long_examples)",
                int(too_long.sum()),
                data.count,
                seq_len + 1,
                "dropped" if long_examples == "drop" else "cut to that length",
            )
        if len(self.keep) == 0:
            raise UsageError(
                f"data: every example of {data.name} is longer than seq_len + 1 = {seq_len + 1} tokens and "
                "data.long_examples = 'drop'; raise data.seq_len or set data.long_examples = 'truncate'"
            )
        self.epoch_tokens = int(self.lengths[self.keep].sum())
        self.rows_per_epoch = (self.epoch_tokens - 1) // seq_len if packing else len(self.keep)
        if self.rows_per_epoch < 1:
            raise UsageError(
                f"data: {data.name} has {self.epoch_tokens} tokens, fewer than one row of seq_len + 1 = "
                f"{seq_len + 1}; lower data.seq_len or turn data.packing off"
            )
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._last: tuple | None = None  # the last step's rows (``_step_rows``)
        self._origin = (0, 0)  # (step, row): step ``step`` reads from row ``row`` on (``resume_at``)

    @property
    def identity(self) -> str:
        """The rows' content (a checkpoint records it: rows changed before a resume are said)."""
        return self.data.identity

    def first_row(self, step: int, world: int = 1) -> int:
        """The first global row of step ``step`` (0-based): the rows follow on from the origin,
        ``world x M x B`` a step."""
        return self._origin[1] + (step - self._origin[0]) * world * self.M * self.B

    def rows_read(self, step: int, world: int = 1) -> int:
        """Rows read by steps before ``step`` (a checkpoint of ``step`` steps records it)."""
        return self.first_row(step, world)

    def resume_at(self, step: int, rows: int) -> None:
        """Step ``step`` on reads from row ``rows``, the rows a checkpoint had read: a run resumed
        with another global batch (other ranks, micro-batches) goes on with the next row, not
        ``step x`` its own batch (which read rows again, or skipped some)."""
        self._origin, self._last = (step, rows), None

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``e``'s example order and the stream offsets of its examples (cached: two)."""
        if e not in self._epochs:
            order = np.random.default_rng([self.seed, e]).permutation(self.keep) if self.shuffle else self.keep
            starts = np.concatenate([[0], np.cumsum(self.lengths[order])])
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[e] = (order, starts)
        return self._epochs[e]

    def epoch_of(self, step: int, world: int = 1) -> float:
        """Epochs done by the end of step ``step`` (0-based), as a fraction."""
        return self.first_row(step + 1, world) / self.rows_per_epoch

    def _row(self, g: int, with_positions: bool = False):
        """Global row ``g``: (T + 1 token ids, T + 1 mask bytes; pads: EOS and 0), and with
        ``with_positions`` the T inputs' positions, restarting at each document."""
        e, j = divmod(g, self.rows_per_epoch)
        order, starts = self._epoch(e)
        d = self.data
        if not self.packing:
            ex = order[j]
            a, n = int(d.offsets[ex]), int(self.lengths[ex])
            ids = np.full(self.T + 1, max(d.eos, 0), np.int64)  # (-1: a chat tokenizer without EOS; pads are masked)
            mask = np.zeros(self.T + 1, np.uint8)
            ids[:n], mask[:n] = d.ids[a : a + n], d.mask[a : a + n]
            return ids, mask
        lo, hi = j * self.T, j * self.T + self.T + 1
        k = int(np.searchsorted(starts, lo, side="right")) - 1
        id_parts, mask_parts, pos = [], [], []
        while lo < hi:
            ex = order[k]
            a = int(d.offsets[ex]) + lo - int(starts[k])
            n = min(hi, int(starts[k + 1])) - lo
            id_parts.append(d.ids[a : a + n])
            mask = d.mask[a : a + n]
            if self.by_document and lo == int(starts[k]) and mask[0]:
                # a document's first token is no target of the one before it, which it cannot see
                # (as in padded rows, and transformers' DataCollatorWithFlattening)
                mask = mask.copy()
                mask[0] = 0
            mask_parts.append(mask)
            pos.append(np.arange(n))
            lo, k = lo + n, k + 1
        out = np.concatenate(id_parts).astype(np.int64), np.concatenate(mask_parts)
        return (*out, np.concatenate(pos)[: self.T]) if with_positions else out

    def _step_rows(self, step: int, world: int) -> list[tuple]:
        """Every rank's rows of step ``step`` ((ids, mask[, positions]) each), kept for the
        step's ``batches``, ``scored`` and ``positions``: read once."""
        if self._last is None or self._last[0] != (step, world):
            n = world * self.M * self.B
            first = self.first_row(step, world)
            self._last = (step, world), [self._row(first + i, self.by_document) for i in range(n)]
        return self._last[1]

    def batches(self, step: int, *, rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} of world {world}: need 0 <= rank < world")
        rows = self._step_rows(step, world)[rank * self.M * self.B : (rank + 1) * self.M * self.B]
        out = []
        for m in range(self.M):
            part = rows[m * self.B : (m + 1) * self.B]
            ids = torch.from_numpy(np.stack([r[0] for r in part]))
            keep = torch.from_numpy(np.stack([r[1] for r in part]).astype(bool))
            targets = ids[:, 1:].masked_fill(~keep[:, 1:], IGNORE)
            out.append((ids[:, :-1].contiguous(), targets.contiguous()))
        return out

    def positions(self, step: int, *, rank: int = 0, world: int = 1) -> list[torch.Tensor] | None:
        """Packed rows with attention within each document: this rank's micro-batches' ``[B, T]``
        input positions (restarting at each document); None otherwise (positions 0 .. T-1)."""
        if not self.by_document:
            return None
        n = self.M * self.B
        rows = [r[2] for r in self._step_rows(step, world)[rank * n : (rank + 1) * n]]
        return [torch.from_numpy(np.stack(rows[m * self.B : (m + 1) * self.B])) for m in range(self.M)]

    def attention(self, step: int, *, rank: int = 0, world: int = 1) -> list[torch.Tensor] | None:
        """Padded rows: this rank's micro-batches' ``[B, T]`` masks of each row's own input tokens
        (True) against its pads, the attention_mask a padding collator gives transformers (a
        mixture's auxiliary loss counts no pad); None for packed rows, which have no pads."""
        if self.packing:
            return None
        n = self.M * self.B
        first = self.first_row(step, world) + rank * n  # (from a resume's origin, as ``_step_rows``)
        own = []
        for g in range(first, first + n):
            e, j = divmod(g, self.rows_per_epoch)
            own.append(min(int(self.lengths[self._epoch(e)[0][j]]), self.T))  # (as ``_row``: its example's tokens)
        mask = torch.arange(self.T)[None, :] < torch.tensor(own)[:, None]
        return [mask[m * self.B : (m + 1) * self.B] for m in range(self.M)]

    def scored(self, step: int, world: int = 1) -> int:
        """Scored targets of step ``step`` over every rank (each micro-batch's loss divisor)."""
        n = self._scored(step, world)
        if n == 0:
            raise UnscoredStep(
                f"data: step {step + 1} has no scored token (every target masked); check the data's "
                "prompt/completion split, or raise data.seq_len (the data decides a step's rows: a resume meets "
                "it again until they change)"
            )
        return n

    def refuse_unscored(self, first: int, steps: int, world: int = 1) -> None:
        """Refuse, before the first step, a run whose steps ``first`` .. ``steps`` give one no
        scored token; the steps of up to ``CHECK_ROWS`` rows are checked (beyond them, such a
        step stops the run where it falls, its work saved: ``Trainer.run``)."""
        last = min(steps, first + max(1, CHECK_ROWS // (world * self.M * self.B)))
        bad = self.unscored_steps(first, last, world)
        if bad:
            shown = ", ".join(str(s + 1) for s in bad[:5]) + (", ..." if len(bad) > 5 else "")
            raise UnscoredStep(
                f"data: {len(bad)} of steps {first + 1}-{last} have no scored token (every target masked), "
                f"first step(s) {shown}: the run would stop there; check the data's prompt/completion split "
                "(prompts longer than data.seq_len leave nothing to score), raise data.seq_len, or take more rows a "
                "step (data.micro_batch_size)"
            )

    def unscored_steps(self, first: int, last: int, world: int = 1) -> list[int]:
        """The steps in [first, last) (0-based) whose rows hold no scored token: found at start,
        not after hours of training (a step is its rows, drawn from the seed: every run and
        every resume meets the same ones)."""
        bad = [step for step in range(first, last) if self._scored(step, world) == 0]
        self._last = None  # (the rows of the last step checked: not held through the run)
        return bad

    def scored_targets(self, step: int, world: int = 1) -> int:
        """Scored targets of step ``step`` over every rank, none refused (``scored``: refused)."""
        return self._scored(step, world)

    def _scored(self, step: int, world: int) -> int:
        """Scored targets of step ``step``'s rows over every rank (a row's first token is no target)."""
        return sum(int(r[1][1:].sum()) for r in self._step_rows(step, world))
