"""``tiertrain prepare``: text files to a token file, streamed a few MB at a time; JSONL,
Parquet or a ``datasets`` directory to a prepared examples directory (``examples.py``), a row
at a time (``formats.py``)."""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from ..errors import UsageError
from ..paths import check_input_file, check_writable_dir, refuse_overwriting
from .tokenizer import load_tokenizer, tokenizer_fingerprint
from .tokens import is_token_file, write_tokens

__all__ = ["prepare", "prepare_examples"]

_BLOCK = 4 << 20  # characters per tokenizer call


def prepare(inputs: Sequence[str], output: str, *, tokenizer: str | None = None, progress: bool = True) -> int:
    """Tokenize ``inputs`` (UTF-8 text files, in order) into the token file ``output``
    (``progress``: a bar per file)."""
    _check(inputs, output)
    tok = load_tokenizer(tokenizer, what="prepare --tokenizer")

    def chunks() -> Iterator[np.ndarray]:
        for path in inputs:
            with (
                open(path, encoding="utf-8") as f,
                tqdm(desc=f"tokenize {path}", unit="char", unit_scale=True, disable=None if progress else True) as bar,
            ):
                carry = ""
                while True:
                    try:
                        text = f.read(_BLOCK)
                    except UnicodeDecodeError as exc:
                        raise UsageError(
                            f"prepare --input {path} is not UTF-8 text ({exc.reason} near byte "
                            f"{exc.start} of a block); convert it to UTF-8 or give a text file"
                        ) from None
                    if not text:
                        break
                    text, carry = _split_at_whitespace(carry + text)
                    yield np.asarray(tok.encode(text), dtype=np.int64)
                    bar.update(len(text))
                if carry:
                    yield np.asarray(tok.encode(carry), dtype=np.int64)

    empty = f"prepare --input {', '.join(inputs)}: no text to tokenize (0 tokens); give a text file that holds some"
    return write_tokens(output, chunks(), tok.vocab_size, empty=empty)  # (train refused the empty file, later)


def prepare_examples(
    inputs: Sequence[str],
    output: str,
    *,
    tokenizer: str | None = None,
    kind: str = "auto",
    mask_prompt: bool = True,
    progress: bool = True,
    what: str | None = None,
) -> dict:
    """Render every row of ``inputs`` (in order) into the prepared directory ``output``; its
    metadata returned (examples, tokens, scored targets). ``what``: the setting that named the
    input where a run prepares it into its cache (``data.corpus``): its errors name that and
    ``data.tokenizer``, not this command's options and the cache's directory."""
    from .examples import write_examples
    from .formats import KINDS, Renderer, read_rows

    if isinstance(inputs, (str, os.PathLike)) or not all(isinstance(p, (str, os.PathLike)) for p in inputs):
        raise TypeError(  # (a string was read as one input a character: "no such file: 'r'")
            f"prepare_examples: inputs are a list of paths, not {inputs!r}: prepare_examples([path], output)"
        )
    inputs, output = [os.fspath(p) for p in inputs], os.fspath(output)
    if kind not in ("auto", *KINDS):
        raise UsageError(f"prepare --format {kind!r}: use 'auto' or one of {', '.join(KINDS)}")
    for path in inputs:
        if not os.path.exists(path):
            raise UsageError(f"prepare --input {path}: no such file or directory")
    if os.path.isfile(output):
        raise UsageError(f"prepare --output {output} is a file; prepared examples are a directory: give a new one")
    check_writable_dir("prepare --output", output, UsageError)  # before the rows are read
    _refuse_foreign(output)
    tok = load_tokenizer(tokenizer, what="data.tokenizer" if what else "prepare --tokenizer")
    render = Renderer(tok, kind, mask_prompt=mask_prompt)

    def examples():
        with tqdm(desc="prepare", unit=" examples", disable=None if progress else True) as bar:
            for path in inputs:
                for where, row in read_rows(path):
                    yield render(where, row)
                    bar.update(1)

    eos = render.eos if render.eos is not None else -1
    return write_examples(
        output,
        examples(),
        vocab_size=tok.vocab_size,
        eos=eos,
        describe=lambda: dict(
            kind=render.kind,
            sources=[os.path.abspath(p) for p in inputs],
            tokenizer=os.path.abspath(tokenizer) if tokenizer else "bytes",
            tokenizer_sha=tokenizer_fingerprint(tokenizer),
            mask_prompt=mask_prompt,
            lead=render.lead,  # (absent: prepared before texts and prompts took the tokenizer's BOS)
        ),
        empty=f"{what} = {inputs[0]} holds no example; give rows" if what else None,
    )


def _refuse_foreign(output: str) -> None:
    """Examples go into a new or empty directory, or replace an earlier preparation: never into a
    directory of other files (a model directory, a user's meta.json), which they replaced."""
    import json

    from .examples import FORMAT, META, PREPARED_FILES

    if not os.path.isdir(output):
        return
    # (a temporary of a preparation cut short, "mask.bin.tmp1234", is ours too)
    # (hidden files a system puts there, .DS_Store or .nfs*, are no one's data)
    theirs = sorted(n for n in os.listdir(output) if n.split(".tmp")[0] not in PREPARED_FILES and n[0] != ".")
    ours = True
    if os.path.exists(os.path.join(output, META)):
        try:
            with open(os.path.join(output, META)) as f:
                ours = json.load(f).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
    if theirs or not ours:
        shown = ", ".join(theirs[:4]) + (", ..." if len(theirs) > 4 else "") if theirs else f"a {META} not tiertrain's"
        raise UsageError(
            f"prepare --output {output} holds files that are not an earlier preparation ({shown}); prepared "
            "examples go into a new or empty directory (or replace an earlier preparation): give another"
        )


def _check(inputs: Sequence[str], output: str) -> None:
    if not output:  # (a traceback from the rename of its temporary onto '')
        raise UsageError("prepare --output is empty; give the file to write, e.g. --output corpus.tokens")
    for path in inputs:
        check_input_file("prepare --input", path, UsageError)
        if os.path.exists(output) and os.path.samefile(path, output):
            raise UsageError(
                f"prepare --output {output} is also an --input; it would overwrite the text: give another output file"
            )
    out_dir = os.path.dirname(os.path.abspath(output))
    refuse_overwriting("prepare --output", os.path.abspath(output), [], UsageError)
    if os.path.isfile(output) and not is_token_file(output):  # a user's file: never replaced by tokens
        raise UsageError(
            f"prepare --output {output} exists and is not a token file tiertrain wrote; give a new file name "
            "(a token file is replaced)"
        )
    if os.path.isdir(output):
        raise UsageError(
            f"prepare --output {output} is a directory; give a file name, e.g. {os.path.join(output, 'corpus.tokens')}"
        )
    if not os.path.isdir(out_dir):
        raise UsageError(f"prepare --output {output}: directory {out_dir} does not exist; create it first")
    if not os.access(out_dir, os.W_OK):
        raise UsageError(f"prepare --output {output}: directory {out_dir} is not writable")


def _split_at_whitespace(text: str) -> tuple[str, str]:
    """Cut before the last whitespace so that no word is split between tokenizer calls."""
    cut = max(text.rfind(" "), text.rfind("\n"))
    return (text, "") if cut <= 0 else (text[:cut], text[cut:])
