"""``tiertrain prepare``: text files to a token file, streamed a few MB at a time."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from .loader import load_tokenizer
from .tokens import write_tokens

__all__ = ["prepare"]

_BLOCK = 4 << 20  # characters per tokenizer call


def prepare(inputs: Sequence[str], output: str, *, tokenizer: str | None = None) -> int:
    """Tokenize ``inputs`` (text files, in order) into the token file ``output``."""
    tok = load_tokenizer(tokenizer)

    def chunks() -> Iterator[np.ndarray]:
        for path in inputs:
            with open(path, encoding="utf-8") as f, tqdm(desc=f"tokenize {path}", unit="char", unit_scale=True) as bar:
                carry = ""
                while True:
                    text = f.read(_BLOCK)
                    if not text:
                        break
                    text, carry = _split_at_whitespace(carry + text)
                    yield np.asarray(tok.encode(text), dtype=np.int64)
                    bar.update(len(text))
                if carry:
                    yield np.asarray(tok.encode(carry), dtype=np.int64)

    return write_tokens(output, chunks(), tok.vocab_size)


def _split_at_whitespace(text: str) -> tuple[str, str]:
    """Cut before the last whitespace so that no word is split between tokenizer calls."""
    cut = max(text.rfind(" "), text.rfind("\n"))
    return (text, "") if cut <= 0 else (text[:cut], text[cut:])
