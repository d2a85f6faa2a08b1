"""Fine-tuning data as it comes: rows of JSONL, Parquet or a ``datasets`` directory, rendered
into token ids and a loss mask per token.

Rows are read one at a time (JSONL line by line, Parquet a record batch at a time, a
``datasets.save_to_disk`` directory through its memory-mapped Arrow files): memory does not
grow with the file. Each row is one example of one kind, named by ``data.format`` or found
from the first row's fields (``auto``):

- ``text``: ``{"text": ...}``: every token scored, EOS appended.
- ``completion``: ``{"prompt": ..., "completion": ...}``: the prompt's tokens not scored, the
  completion's and the EOS after it scored. Prompt and completion are tokenized apart and
  joined (the completion's tokens are exactly those of the completion).
- a text and a prompt lead with what ``tokenizer(text)`` puts before them (a BOS: Llama,
  Gemma, Mistral; nothing for Qwen or the bytes), as transformers' and TRL's fine-tuning
  tokenize them: without it, a model that needs its BOS (Gemma) is trained on inputs it never
  sees at inference.
- ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered whole with the
  tokenizer's chat template; the tokens of each assistant reply (from the end of the template's
  rendering of the conversation before it with the generation prompt, to the end of its
  rendering with the reply: the reply and its end-of-turn marks) scored, system and user turns
  and the template's headers not. The template must render a conversation's beginning as a
  prefix of the whole (every common template does; refused otherwise). Tokens are matched to
  characters through the fast tokenizer's offsets.

Errors name the file, the line (JSONL) or row (Parquet, ``datasets``) and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from ..errors import UsageError

__all__ = ["DataError", "Example", "KINDS", "is_rows_input", "read_rows", "Renderer"]

KINDS = ("text", "completion", "chat")
ROLES = ("system", "user", "assistant", "tool")
# how rows become ids, in the cache's key: 2 = texts and prompts lead with what tokenizer(text)
# puts before them (a BOS), as transformers and TRL tokenize them for fine-tuning
ROWS = 2


class DataError(UsageError):
    """A row of the input is bad: the message names the file, line or row, and field."""


@dataclass
class Example:
    ids: np.ndarray  # int64 token ids
    mask: np.ndarray  # uint8: 1 where the token is a loss target


JSON_LINES = (".jsonl", ".json")  # (.json: JSON Lines saved under that name, as datasets' to_json writes)


def is_rows_input(path: str) -> bool:
    """Whether ``path`` is read row by row here (JSON Lines, Parquet, a ``datasets`` directory;
    the extension in any case)."""
    return path.lower().endswith((*JSON_LINES, ".parquet")) or _is_datasets_dir(path)


def _is_datasets_dir(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json", "dataset_info.json")
    )


def read_rows(path: str) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of ``path``; ``where`` names the file and line or row."""
    if path.lower().endswith(JSON_LINES):
        yield from _jsonl(path)
    elif path.lower().endswith(".parquet"):
        yield from _parquet(path)
    elif _is_datasets_dir(path):
        yield from _datasets(path)
    else:
        raise DataError(
            f"{path}: not JSON Lines (.jsonl, .json), Parquet (.parquet) or a directory saved by datasets' save_to_disk"
        )


def _jsonl(path: str) -> Iterator[tuple[str, Any]]:
    # bytes, decoded a line at a time: a text stream decodes ahead in blocks, so a bad byte
    # would be found lines before the one that holds it
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # (a BOM a Windows editor put first: not text)
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}, line {n}: not UTF-8 (byte {exc.start + 1} of the line: {exc.reason}); "
                    "convert the file to UTF-8"
                ) from None
            if not line.strip():
                continue
            if n == 1 and line.lstrip().startswith("["):
                raise DataError(
                    f"{path}: a JSON array; give JSON Lines (one object a line: in Python, "
                    "datasets.Dataset.from_list(rows).to_json(path), or json.dumps of each row)"
                )
            try:  # (without its newline: a missing '}' was "Expecting ',' delimiter" at column 1 of none)
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                why = exc.msg.removesuffix(" at")  # ("Invalid control character at" + " at column")
                raise DataError(f"{path}, line {n}: invalid JSON ({why} at column {exc.colno})") from None
            yield f"{path}, line {n}", row


def _parquet(path: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'tiertrain[data]'") from None
    try:
        f = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several kinds for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    n = 0
    for batch in f.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield f"{path}, row {n}", row


def _datasets(path: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a datasets directory needs datasets: pip install 'tiertrain[data]'") from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(
            f"{path} holds several splits ({', '.join(ds)}); give one of them, e.g. "
            f"{os.path.join(path, next(iter(ds)))}"
        )
    for n, row in enumerate(ds, 1):  # memory-mapped Arrow: rows are read as they are asked for
        yield f"{path}, row {n}", row


def _field(where: str, row: Any, name: str, kind: str) -> Any:
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: a row must be an object with a {name!r} field ({kind} data), got {type(row).__name__}"
        )
    if name not in row:
        raise DataError(f"{where}: no {name!r} field ({kind} data; the row has {', '.join(map(repr, row)) or 'none'})")
    return row[name]


def _text(where: str, row: Any, name: str, kind: str) -> str:
    v = _field(where, row, name, kind)
    if not isinstance(v, str):
        raise DataError(f"{where}: field {name!r} must be a string, got {type(v).__name__}")
    if not v:
        raise DataError(f"{where}: field {name!r} is empty")
    _encodable(where, name, v)
    return v


def _encodable(where: str, name: str, v: str) -> None:
    """``v`` is text (JSON's "\\ud83d" alone, half of a character's surrogate pair, is valid JSON
    but no text: the tokenizers failed with a traceback that named no row)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where}: field {name!r} holds a lone surrogate (U+{ord(v[exc.start]):04X} at character {exc.start + 1}), "
            "half of a character cut in two; fix the row"
        ) from None


def detect_kind(where: str, row: Any) -> str:
    """The kind of data a row is (``auto``), from its fields."""
    if isinstance(row, dict):
        if "messages" in row:
            return "chat"
        if "prompt" in row and "completion" in row:
            return "completion"
        if "text" in row:
            return "text"
    fields = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
    raise DataError(
        f"{where}: cannot tell the data's format from its fields ({fields}): need 'text', 'prompt' and "
        "'completion', or 'messages' (or set data.format)"
    )


class Renderer:
    """Rows to ``Example``s with one tokenizer (``load_tokenizer``'s); ``kind`` one of KINDS or
    ``auto`` (found from the first row, then held)."""

    def __init__(self, tokenizer: Any, kind: str = "auto", *, mask_prompt: bool = True) -> None:
        self.tok, self.kind, self.mask_prompt = tokenizer, kind, mask_prompt
        self.eos = getattr(tokenizer, "eos_token_id", None)
        self.lead = self._lead()

    def _lead(self) -> list[int]:
        """The ids ``tokenizer(text)`` puts before a text: a BOS where the tokenizer adds one
        (Llama, Gemma; none for Qwen or the bytes), as transformers' and TRL's fine-tuning
        give a text or a prompt; an EOS it would add after is left out (ours ends the row)."""
        lead = list(self.tok.encode_prompt(""))
        if self.eos is not None and lead and lead[-1] == self.eos:
            lead = lead[:-1]
        return lead

    def __call__(self, where: str, row: Any) -> Example:
        if self.kind == "auto":
            self.kind = detect_kind(where, row)
        if self.kind != "chat" and self.eos is None:
            raise DataError("the tokenizer has no EOS token to end each example with; give a tokenizer that has one")
        return getattr(self, f"_{self.kind}")(where, row)

    def _text(self, where: str, row: Any) -> Example:
        ids = self.lead + self.tok.encode(_text(where, row, "text", "text")) + [self.eos]
        return Example(np.asarray(ids, dtype=np.int64), np.ones(len(ids), dtype=np.uint8))

    def _completion(self, where: str, row: Any) -> Example:
        p = self.lead + self.tok.encode(_text(where, row, "prompt", "completion"))
        c = self.tok.encode(_text(where, row, "completion", "completion")) + [self.eos]
        mask = np.concatenate([np.full(len(p), 0 if self.mask_prompt else 1, np.uint8), np.ones(len(c), np.uint8)])
        return Example(np.asarray(p + c, dtype=np.int64), mask)

    def _chat(self, where: str, row: Any) -> Example:
        msgs = _field(where, row, "messages", "chat")
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise DataError(
                    f"{where}: messages[{i}] must be an object with 'role' (one of {', '.join(ROLES)}) "
                    "and 'content' (a string)"
                )
        for i, m in enumerate(msgs):
            _encodable(where, f"messages[{i}].content", m["content"])
        if not any(m["role"] == "assistant" and m["content"] for m in msgs):
            raise DataError(f"{where}: no assistant message with content: nothing to learn from")
        tok = getattr(self.tok, "tok", None)
        if tok is None or not getattr(tok, "chat_template", None):
            raise DataError(
                f"{where}: chat data needs a tokenizer with a chat template (data.tokenizer / --tokenizer: a "
                "directory whose tokenizer_config.json has 'chat_template', or a chat_template.jinja)"
            )

        def render(ms: list, gen: bool = False) -> str:
            from jinja2 import TemplateError, TemplateSyntaxError

            try:
                return tok.apply_chat_template(ms, tokenize=False, add_generation_prompt=gen)
            except TemplateSyntaxError as exc:  # the template itself, whatever the conversation
                raise DataError(
                    f"the tokenizer's chat template does not parse ({exc.message}, line {exc.lineno} of the template); "
                    "fix chat_template in its tokenizer_config.json or chat_template.jinja"
                ) from None
            except TemplateError as exc:  # its raise_exception(): "System role not supported", roles' order
                raise DataError(f"{where}: the tokenizer's chat template refuses this conversation: {exc}") from None

        full = render(msgs)
        spans = []
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before, upto = render(msgs[:k], True) if k else "", render(msgs[: k + 1])
            if not (full.startswith(upto) and upto.startswith(before)):
                raise DataError(
                    f"{where}: the tokenizer's chat template does not render a conversation's beginning as "
                    "a prefix of the whole; its assistant replies cannot be told apart"
                )
            if self.mask_prompt:  # an opening reply: after the template's header, not from 0
                spans.append((len(before) if k else _opening_reply(render, upto), len(upto)))
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        starts, ends = (np.asarray(c, dtype=np.int64).reshape(-1) for c in zip(*enc["offset_mapping"]))
        mask = np.zeros(len(ids), np.uint8) if self.mask_prompt else np.ones(len(ids), np.uint8)
        for a, b in spans:  # every token with a character of the reply, as transformers' assistant mask
            mask[(ends > a) & (starts < b)] = 1  # (one across the reply's start, '\n\n' of '\n' + '\n...', too)
        return Example(ids, mask)


_MARK = "tiertrainreplymark"  # a reply's stand-in: no template adds or changes such a word


def _opening_reply(render: Any, upto: str) -> int:
    """Where the reply of a conversation that opens with the assistant begins in ``upto`` (its
    rendering): after what the template puts before it (a default system prompt, the role's
    header), which is not scored: the same conversation rendered with a stand-in reply shows
    it (transformers renders no conversation without messages). 0 where it does not."""
    probe = render([{"role": "assistant", "content": _MARK}])
    head = probe[: probe.find(_MARK)] if _MARK in probe else ""
    return len(head) if upto.startswith(head) else 0
