"""Tokenizers: the byte-level one (no files) and a Hugging Face tokenizer from a local
directory, and the fingerprint of a tokenizer's files (prepared data is keyed on it)."""

from __future__ import annotations

import os
from typing import Any

from ..config import ConfigError, has_tokenizer
from ..errors import one_line

__all__ = ["BYTES", "TOKENIZER_FILES", "ByteTokenizer", "load_tokenizer", "tokenizer_fingerprint"]

# What a Hugging Face tokenizer directory may hold (export copies these beside the weights).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no files needed. Its EOS (ending each example of
    prepared rows) is byte 0, NUL, which text does not hold."""

    vocab_size = 256
    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_prompt = encode  # (no special tokens to add)

    def decode(self, ids: list[int]) -> str:
        """Ids past the bytes (a model with a larger vocabulary) have no text: U+FFFD each."""
        out, run = [], bytearray()
        for i in map(int, ids):
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace") + "\ufffd")
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


class _HFTokenizer:
    def __init__(self, directory: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as ``tokenizer(text)`` makes it (what ``model.generate(**tok(text))`` gets):
        with the special tokens the tokenizer adds, a BOS where it has one (Llama, Gemma)."""
        return self.tok(text)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


BYTES = "bytes"  # data.tokenizer's name for the byte-level tokenizer


def load_tokenizer(directory: str | None, what: str = "data.tokenizer") -> Any:
    """The byte-level tokenizer, or a Hugging Face tokenizer from a local directory
    (``what`` names the setting in errors)."""
    if directory is None or directory == BYTES:
        return ByteTokenizer()
    if not os.path.isdir(directory):
        raise ConfigError(f"{what} = {directory!r}: not a directory; give a local Hugging Face tokenizer dir")
    if not has_tokenizer(directory):
        raise ConfigError(
            f"{what} = {directory!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}); give "
            "the directory that holds them (a model directory usually does)"
        )
    try:
        return _HFTokenizer(directory)
    except Exception as exc:  # transformers raises several kinds for a broken directory
        raise ConfigError(
            f"{what} = {directory!r}: the tokenizer there does not load ({type(exc).__name__}: {one_line(exc)})"
        ) from None


def tokenizer_fingerprint(directory: str | None) -> str:
    """What identifies a tokenizer: a hash of its directory's files' contents ("bytes" for the
    byte-level one). A tokenizer replaced at the same path has another."""
    import hashlib

    if directory is None or directory == BYTES:
        return "bytes"
    h = hashlib.sha256()
    for name in sorted(TOKENIZER_FILES):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]
