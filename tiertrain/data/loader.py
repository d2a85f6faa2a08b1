"""Tokenizers, corpora and the batch sampler.

The sampler is a pure function of (seed, step): step ``s`` draws its ``M * B`` windows of
``T + 1`` tokens from a generator seeded by ``(seed, s)``. A run that resumes at step
``s`` therefore sees exactly the batches an uninterrupted run would, with no data
position to save beyond the step number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from importlib import resources

import numpy as np
import torch

from ..config import ConfigError, DataConfig
from ..errors import UsageError, speaks_for_ranks
from .formats import ROWS
from .tokenizer import BYTES, TOKENIZER_FILES, ByteTokenizer, load_tokenizer, tokenizer_fingerprint
from .tokens import read_tokens

__all__ = [
    "ByteTokenizer",
    "load_tokenizer",
    "Corpus",
    "EvalSet",
    "bundled_corpus_path",
    "open_corpus",
    "TOKENIZER_FILES",
    "tokenizer_fingerprint",
]

log = logging.getLogger("tiertrain")


def bundled_corpus_path() -> str:
    return str(resources.files("tiertrain.data").joinpath("kjv_genesis_exodus.txt"))


ROWS_SETTINGS = ("format", "mask_prompt", "packing", "packed_attention", "long_examples")


def _rows_settings(cfg: DataConfig) -> list[str]:
    """The settings for rows (examples) that ``cfg`` sets otherwise than their defaults."""
    default = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    return [f"data.{n} = {getattr(cfg, n)!r}" for n in ROWS_SETTINGS if getattr(cfg, n) != default[n]]


class Corpus:
    """Token ids of the configured corpus and the batches of each step."""

    identity = ""  # (prepared rows' content, which a checkpoint records: random windows of a text have none)

    def __init__(self, cfg: DataConfig, what: str = "data.corpus") -> None:
        self.cfg = cfg
        path = bundled_corpus_path() if cfg.corpus == "bundled" else cfg.corpus
        if path.endswith(".txt"):
            tok = load_tokenizer(cfg.tokenizer)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{what} = {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                    "convert it to UTF-8, or give a token file from `tiertrain prepare`"
                ) from None
            ids = tok.encode(text)
            dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
            self.tokens, self.vocab_size = np.asarray(ids, dtype=dtype), tok.vocab_size
        else:
            self.tokens, self.vocab_size = read_tokens(path)
            # tokenized when it was prepared: the run's tokenizer (a model directory's by default) must be the
            # vocabulary it was made with
            theirs = self.vocab_size if cfg.tokenizer in (None, BYTES) else load_tokenizer(cfg.tokenizer).vocab_size
            if theirs != self.vocab_size:
                raise ConfigError(
                    f"{what} = {path!r} holds token ids of a vocabulary of {self.vocab_size:,} (tokenized when it was "
                    f"prepared), not this run's data.tokenizer {cfg.tokenizer!r} ({theirs:,}); prepare it again with "
                    f"--tokenizer {cfg.tokenizer}"
                )
        self.path = path
        ignored = _rows_settings(cfg)
        if (
            ignored and what == "data.corpus" and speaks_for_ranks()
        ):  # (given for rows: a text or token file gave the same loss, silently)
            log.warning(
                "%s = %s is text cut into windows, not rows: %s set for rows (examples) do(es) nothing here",
                what, path, ", ".join(ignored),
            )  # fmt: skip
        need = cfg.seq_len + 1
        if len(self.tokens) < need:
            raise ConfigError(f"{what}: {path} has {len(self.tokens)} tokens, fewer than data.seq_len + 1 = {need}")

    def epoch_of(self, step: int, world: int = 1) -> None:
        """Windows are drawn at random: no epochs (``ExampleBatches`` counts them)."""
        return None

    def rows_read(self, step: int, world: int = 1) -> int:
        """Windows are drawn by step: no position to record (``ExampleBatches`` has one)."""
        return 0

    def resume_at(self, step: int, rows: int) -> None:
        """A step's windows are its seed's whatever the steps before took: nothing to move."""

    def positions(self, step: int, *, rank: int = 0, world: int = 1) -> None:
        """Every row is one sequence: positions 0 .. T-1 (``ExampleBatches`` has packed ones)."""
        return None

    def attention(self, step: int, *, rank: int = 0, world: int = 1) -> None:
        """Every token is the text's: no pads (``ExampleBatches`` has padded rows)."""
        return None

    def refuse_unscored(self, first: int, steps: int, world: int = 1) -> None:
        """Every target counts: no step goes without a scored one (``ExampleBatches`` checks)."""

    def scored(self, step: int, world: int = 1) -> None:
        """Every target counts and every micro-batch has as many: each micro-batch's loss is
        its mean, the step's the mean of those (no divisor; ``ExampleBatches`` has one)."""
        return None

    def batches(self, step: int, *, rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``micro_batches`` (inputs, targets) pairs of step ``step`` (0-based) for rank
        ``rank`` of ``world``: the step draws ``world x micro_batches`` rows from (seed, step)
        alone and rank r keeps rows ``[r M, (r + 1) M)``, so N ranks of M micro-batches see
        exactly the sequences of one rank with N x M (the draw is in C order), and a run that
        changes its rank count, and its micro-batches to match, sees the same data."""
        c = self.cfg
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} of world {world}: need 0 <= rank < world")
        rng = np.random.default_rng([c.seed, step])
        starts = rng.integers(0, len(self.tokens) - c.seq_len, size=(world * c.micro_batches, c.micro_batch_size))
        out = []
        for row in starts[rank * c.micro_batches : (rank + 1) * c.micro_batches]:
            win = np.stack([np.asarray(self.tokens[s : s + c.seq_len + 1], dtype=np.int64) for s in row])
            t = torch.from_numpy(win)
            out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        return out


class EvalSet:
    """Held-out micro-batches for the validation loss, from ``data.eval_corpus``: a text cut
    into consecutive rows of ``seq_len + 1`` tokens (stride ``seq_len``: every token is a
    target once), or prepared examples' rows in order (packed or padded as training's);
    ``micro_batch_size`` rows a micro-batch, at most ``data.eval_micro_batches`` of them (0:
    all); rows that do not fill a micro-batch are left out. With ranks, micro-batch ``i`` is
    rank ``i % world``'s, and those past the last whole multiple of ``world`` are left out, so
    that every rank runs as many (each pass is a collective)."""

    def __init__(self, cfg: DataConfig, world: int = 1) -> None:
        """``world``: the ranks that will share it (each needs a micro-batch: refused here, at start,
        where fewer; as is a set whose every target is masked)."""
        if cfg.eval_corpus is None:
            raise ConfigError("data.eval_corpus is not set: there is no held-out text to take a validation loss on")
        self.cfg, self.scored, self.examples, self.corpus = cfg, None, None, None
        data = open_corpus(
            dataclasses.replace(cfg, corpus=cfg.eval_corpus, micro_batches=1), what="data.eval_corpus", shuffle=False
        )
        self.vocab_size, B = data.vocab_size, cfg.micro_batch_size
        if isinstance(data, Corpus):
            self.corpus, rows = data, (len(data.tokens) - 1) // cfg.seq_len
            short = (
                f"{data.path} has {len(data.tokens)} tokens, too few for one micro-batch of {B} windows of "
                f"{cfg.seq_len + 1}; give a longer text"
            )
        else:  # examples: each micro-batch's loss summed over all the scored targets (``total_scored``)
            self.examples, rows = data, data.rows_per_epoch
            short = f"{data.data.name} gives {rows} rows, fewer than one micro-batch of {B}; give more examples"
        self.count = min(rows // B, cfg.eval_micro_batches or rows // B)
        if self.count == 0:
            raise ConfigError(f"data.eval_corpus: {short} or lower data.micro_batch_size")
        if self.count < world:  # (each rank takes whole micro-batches: none would be left to any)
            more = "raise data.eval_micro_batches, " if self.count < rows // B else ""
            raise ConfigError(
                f"data.eval_corpus gives {self.count} micro-batch(es) of {B} rows, fewer than the {world} ranks (each "
                f"evaluates whole micro-batches); {more}give more held-out data, or lower data.micro_batch_size"
            )
        if self.examples is not None and self.total_scored(world) == 0:
            raise ConfigError(
                f"data.eval_corpus: every target of its {self.count} micro-batch(es) is masked (no completion within "
                f"data.seq_len = {cfg.seq_len} tokens); give held-out examples whose completions fit, or raise "
                "data.seq_len"
            )
        if self.count < rows // B:  # the same rows each time, a part of the text: said
            log.info(
                "validation: %d micro-batches of %d rows, %d of the %d rows data.eval_corpus gives "
                "(data.eval_micro_batches = 0: all of them)",
                self.count, B, self.count * B, rows,
            )  # fmt: skip
        elif rows % B and speaks_for_ranks():  # (left out without a word: 30% of a text at 23 rows of 8)
            log.warning(
                "validation: the last %d of the %d rows data.eval_corpus gives do not fill a micro-batch of %d "
                "and are left out; a data.micro_batch_size dividing %d evaluates them all",
                rows % B, rows, B, rows,
            )  # fmt: skip
        if self.count % world and speaks_for_ranks():  # each rank takes whole rounds: the rest is left out
            log.warning(
                "validation: the last %d of the %d micro-batches do not make a round of the %d ranks (each takes "
                "as many) and are left out; data.eval_micro_batches a multiple of %d evaluates all it takes",
                self.count % world, self.count, world, world,
            )  # fmt: skip

    def total_scored(self, world: int = 1) -> int | None:
        """Examples: the scored targets of every micro-batch evaluated (all ranks), each
        micro-batch's divisor; None for text (the mean of the micro-batches' means)."""
        if self.examples is None:
            return None
        if self.scored is None:
            # (a micro-batch of no scored target adds nothing: only a set of none is refused, at start)
            self.scored = sum(self.examples.scored_targets(i) for i in range(self.count - self.count % world))
        return self.scored

    def positions(self, rank: int = 0, world: int = 1) -> list[torch.Tensor] | None:
        """Examples packed with attention within documents: each of this rank's micro-batches'
        positions (as ``micro_batches``); None otherwise."""
        if self.examples is None or not self.examples.by_document:
            return None
        return [self.examples.positions(i)[0] for i in range(rank, self.count - self.count % world, world)]

    def attention(self, rank: int = 0, world: int = 1) -> list[torch.Tensor] | None:
        """Padded examples: each of this rank's micro-batches' masks of the rows' own tokens (as
        ``micro_batches``); None otherwise."""
        if self.examples is None or self.examples.packing:
            return None
        return [self.examples.attention(i)[0] for i in range(rank, self.count - self.count % world, world)]

    def micro_batches(self, rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, targets) micro-batches, in order."""
        if self.examples is not None:
            return [self.examples.batches(i)[0] for i in range(rank, self.count - self.count % world, world)]
        T, B = self.corpus.cfg.seq_len, self.corpus.cfg.micro_batch_size
        out = []
        for i in range(rank, self.count - self.count % world, world):
            win = np.stack(
                [
                    np.asarray(self.corpus.tokens[(i * B + b) * T : (i * B + b + 1) * T + 1], dtype=np.int64)
                    for b in range(B)
                ]
            )
            t = torch.from_numpy(win)
            out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        return out


def by_document(cfg: DataConfig) -> bool:
    """Whether the steps of ``cfg`` pass ``[B, T]`` positions (examples, attention within each
    document): their blocks then build and save an attention mask, which the dry run that sizes
    one pair's activations must build too (without it the plan kept a pair more than the steps)."""
    from .examples import is_prepared
    from .formats import is_rows_input

    examples = cfg.corpus != "bundled" and (is_prepared(cfg.corpus) or is_rows_input(cfg.corpus))
    return examples and cfg.packed_attention == "document"


def open_corpus(cfg: DataConfig, what: str = "data.corpus", *, shuffle: bool = True):
    """The batches of ``cfg.corpus``: random windows of a text or token file (``Corpus``), or
    epochs of prepared examples (``examples.ExampleBatches``): a directory made by ``tiertrain
    prepare``, or rows (JSONL, Parquet, a datasets directory) prepared here once into the cache
    (``prepared_cache``)."""
    from .examples import ExampleBatches, PreparedExamples, is_prepared
    from .formats import is_rows_input

    path = cfg.corpus
    if path != "bundled" and not is_prepared(path) and is_rows_input(path):
        path = prepared_cache(cfg, path, what)
    if path == "bundled" or not is_prepared(path):
        return Corpus(cfg, what)
    prepared = PreparedExamples(path, what, source=None if path == cfg.corpus else cfg.corpus)
    if path == cfg.corpus:  # prepared by the user (a cache entry is keyed by these settings)
        _as_prepared(cfg, prepared.meta, path, what)
    return ExampleBatches(
        prepared,
        seq_len=cfg.seq_len,
        micro_batch_size=cfg.micro_batch_size,
        micro_batches=cfg.micro_batches,
        seed=cfg.seed,
        packing=cfg.packing,
        long_examples=cfg.long_examples,
        shuffle=shuffle,
        by_document=cfg.packed_attention == "document",
    )


def _as_prepared(cfg: DataConfig, meta: dict, path: str, what: str) -> None:
    """A directory ``tiertrain prepare`` made is read as it was made: with another tokenizer
    than this run's its ids are another vocabulary's (refused); its format and loss mask are
    its own (said where this run's settings ask otherwise: they are not applied)."""
    if cfg.tokenizer not in (None, BYTES) and meta.get("tokenizer_sha") not in (
        None,
        tokenizer_fingerprint(cfg.tokenizer),
    ):
        raise ConfigError(
            f"{what} = {path} was prepared with tokenizer {meta.get('tokenizer')!r}, not this run's data.tokenizer "
            f"{cfg.tokenizer!r}: its token ids are another vocabulary's; prepare it again with --tokenizer "
            f"{cfg.tokenizer}"
        )
    said = []
    if "lead" not in meta and meta.get("kind") in ("text", "completion") and cfg.tokenizer not in (None, BYTES):
        from .formats import Renderer  # (the row renderer only for a preparation this old)

        lead = Renderer(load_tokenizer(cfg.tokenizer)).lead
        if lead and speaks_for_ranks():  # an earlier tiertrain's preparation: its texts and prompts lack the BOS
            log.warning(
                "%s = %s was prepared by an earlier tiertrain without the tokenizer's BOS (id %s) before each %s, "
                "which transformers' tokenizer(text) puts there; prepare it again to train on what it adds",
                what, path, ", ".join(map(str, lead)), "text" if meta["kind"] == "text" else "prompt",
            )  # fmt: skip
    if cfg.mask_prompt != meta.get("mask_prompt", cfg.mask_prompt):
        said.append(f"data.mask_prompt = {cfg.mask_prompt} (prepared with {meta.get('mask_prompt')})")
    if cfg.format not in ("auto", meta.get("kind", cfg.format)):
        said.append(f"data.format = {cfg.format!r} (prepared as {meta.get('kind')!r})")
    if said:
        log.warning(
            "%s = %s is used as it was prepared: %s not applied; prepare it again to change them",
            what, path, " and ".join(said),
        )  # fmt: skip


def _damaged(prepared: str) -> str:
    """Why a prepared directory does not read whole ('' where it does: its token files' headers,
    sizes and checksums, then the rest's)."""
    from .examples import PreparedExamples
    from .tokens import TokenFileError, read_tokens

    for name in sorted(os.listdir(prepared)):
        if name.endswith(".tokens"):
            try:
                read_tokens(os.path.join(prepared, name), verify=True)
            except TokenFileError as exc:
                return str(exc).split(";")[0]
    try:  # the masks, offsets and metadata: their sizes and checksums (a damaged one failed every run)
        PreparedExamples(prepared)
    except (UsageError, OSError, ValueError) as exc:
        return str(exc).split(";")[0]
    return ""


def prepared_cache(cfg: DataConfig, path: str, what: str) -> str:
    """Rows prepared once into ``$XDG_CACHE_HOME/tiertrain/prepared/<key>`` (default
    ``~/.cache``), the key hashing the input's path, size, modification and change times (rows
    edited in place with their old time put back, ``cp -p``, ``rsync -t``, ``touch -r``, have a new
    change time: no user sets it; found from outside, the old rows were trained on), the tokenizer's
    files' contents (a tokenizer replaced at the same path is another), ``data.format`` and
    ``data.mask_prompt``; reused while they are unchanged."""
    import hashlib
    import json

    from .prepare import prepare_examples

    st = [
        (os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns, os.stat(p).st_ctime_ns)
        for p in ([path] if os.path.isfile(path) else sorted(os.path.join(path, f) for f in os.listdir(path)))
    ]
    key = hashlib.sha256(
        # ROWS: how rows become ids (a change makes earlier copies another key's)
        json.dumps([st, tokenizer_fingerprint(cfg.tokenizer), cfg.format, cfg.mask_prompt, ROWS]).encode()
    ).hexdigest()[:16]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = os.path.join(root, "tiertrain", "prepared", key)
    from ..paths import check_writable_dir

    check_writable_dir(  # (a read-only home on a cluster: an OSError from deep inside, once)
        f"the prepared-data cache for {what} ($XDG_CACHE_HOME, else ~/.cache: set XDG_CACHE_HOME to a writable "
        f"directory, or `tiertrain prepare --input {path} --output DIR` and give DIR)",
        os.path.dirname(out),
        ConfigError,
    )
    from .examples import is_prepared

    if is_prepared(out):
        with contextlib.suppress(OSError):  # its last use, what pruning goes by: before the long check (another
            os.utime(out)  # process pruning meanwhile would remove it under the check)
        damage = _damaged(out)
        if not damage:
            log.info("%s: %s prepared before, in %s", what, path, out)
            return out
        # a cache entry is ours to make again: the user never prepared it by hand
        log.warning("%s: the prepared copy in %s is damaged (%s): prepared again", what, out, damage)
        import shutil

        shutil.rmtree(out)
    prune_cache(os.path.dirname(out))
    log.info("%s: preparing %s into %s (once)", what, path, out)
    prepare_examples([path], out, tokenizer=cfg.tokenizer, kind=cfg.format, mask_prompt=cfg.mask_prompt, what=what)
    return out


CACHE_KEEP_DAYS = 30  # a prepared copy unused this long is removed when another is made
INCOMPLETE_KEEP_DAYS = 1  # an entry whose preparation was killed, this long after its last write


def prune_cache(root: str, keep_days: float = CACHE_KEEP_DAYS) -> list[str]:
    """Remove the prepared-data cache's entries (directories of ``root``) not used for
    ``keep_days`` (each use touches its entry), and those whose preparation was killed
    (no metadata) a day after; the removed returned. A copy is made again from its rows when
    they are given again. A run reading an entry keeps its open files (POSIX)."""
    import shutil
    import time

    from .examples import is_prepared

    # an entry without its metadata is one whose preparation was killed (none takes a day): only
    # a later run given the same rows would have made it again
    cutoff, gone = time.time() - keep_days * 86400, []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            entry = os.path.join(root, name)
            if len(name) != 16 or not all(c in "0123456789abcdef" for c in name):  # not a key: not ours
                continue
            with contextlib.suppress(OSError):
                done = is_prepared(entry)
                if os.stat(entry).st_mtime < (cutoff if done else time.time() - INCOMPLETE_KEEP_DAYS * 86400):
                    shutil.rmtree(entry)
                    gone.append(entry)
    if gone:
        log.info("the prepared-data cache %s: %d cop%s unused for %g days removed", root, len(gone),
                 "y" if len(gone) == 1 else "ies", keep_days)  # fmt: skip
    return gone
