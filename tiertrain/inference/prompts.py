"""``tiertrain generate``: prompts in (the command line, a text file with one prompt a line,
or JSONL with a ``prompt`` field), text out (stdout, or JSONL with ``--out``), through
``generate.generate``. The tokenizer is the model directory's (else ``data.tokenizer``, else
bytes); with one prompt the tokens are printed as they come."""

from __future__ import annotations

import io
import json
import os

from ..config import Config, ConfigError
from ..data import load_tokenizer
from .generate import Sampling, generate

__all__ = ["read_prompts", "checked_out", "run_generate"]


def read_prompts(texts: list[str] | None, path: str | None) -> list[str]:
    """The prompts of ``--prompt`` (repeatable) and ``--prompts-file`` (.jsonl: a ``prompt``
    field a line; else one prompt a line), refused with the file and line when bad."""
    out = list(texts or [])
    if path is not None:
        if os.path.isdir(path) or not os.path.exists(path):  # (a pipe or a device is read as a file)
            raise ConfigError(f"--prompts-file {path}: {'is a directory' if os.path.isdir(path) else 'no such file'}")
        for n, line in enumerate(_text_lines(path), 1):
            if not line.strip():
                continue
            if path.lower().endswith((".jsonl", ".json")):  # (JSON Lines, the extension in any case)
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"--prompts-file {path}, line {n}: not JSON ({exc.msg})") from None
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise ConfigError(f'--prompts-file {path}, line {n}: no "prompt" string field')
                out.append(row["prompt"])
            else:
                out.append(line.rstrip("\n"))
        if not out:
            raise ConfigError(f"--prompts-file {path}: holds no prompt")
    if not out:
        raise ConfigError("generate: no prompt; give --prompt TEXT or --prompts-file FILE")
    return out


def _text_lines(path: str) -> list[str]:
    """The lines of text file ``path``; a file that is not text (not UTF-8, or with NUL bytes: a
    binary file) refused, naming it."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")  # (a BOM first was kept in the first prompt, and changed its completion)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--prompts-file {path} is not UTF-8 text (byte {exc.start}); give a text file, one prompt a line, or "
            'JSONL with a "prompt" field a line'
        ) from None
    if "\0" in text:
        raise ConfigError(f"--prompts-file {path} holds NUL bytes: it is a binary file, not prompts; give a text file")
    return list(io.StringIO(text, newline=None))  # lines as a text file reads them (universal newlines)


def checked_out(out: str | None, prompts_file: str | None = None) -> str | None:
    """``--out``, checked before any work (a file, in a directory that is or can be made and is
    writable; the directory made; never the prompts file nor a checkpoint's file): it was found
    only after generating, as a traceback."""
    from ..paths import prepare_output_file

    return None if out is None else prepare_output_file("generate --out", out, [prompts_file], ours=_rows_file)


def _rows_file(path: str) -> bool:
    """Whether ``path`` is an earlier ``generate --out``'s (its first line a row of it)."""
    from ..paths import first_json

    row = first_json(path)
    return isinstance(row, dict) and "completion" in row and "prompt" in row


def _tokenizer(cfg: Config):
    """``data.tokenizer``: the model directory's where it holds one (``Config`` sets it), else
    the one given, else bytes."""
    return load_tokenizer(cfg.data.tokenizer)


class StreamedText:
    """One row's completion printed as its tokens come (``generate``'s ``on_tokens``): the prompt
    with the first token (an error before it is not glued to it), then what decoding the
    completion so far adds, a character still cut between tokens (a trailing U+FFFD) held back
    until complete. Each token decoded alone printed "caf\ufffd\ufffd" for "café" from bytes, and
    ran SentencePiece's words together; the text printed is the completion decoded whole, as
    several prompts' are."""

    def __init__(self, tok, prompt: str) -> None:
        self.tok, self.prompt = tok, prompt
        self.tokens: list[int] = []
        self.printed, self.started, self.ended = 0, False, False

    def __call__(self, tokens: list) -> None:
        from ..paths import to_stdout

        said = ""
        if not self.started:
            said, self.started = self.prompt, True
        if tokens and tokens[0] is None:  # (the row has ended; others have not)
            to_stdout(said, "generate")
            return
        if tokens:
            self.tokens.append(tokens[0])
        text = self.tok.decode(self.tokens)
        upto = len(text.rstrip("\ufffd")) if tokens else len(text)  # the end: whatever is left
        if upto > self.printed:
            said += text[self.printed : upto]
            self.printed = upto
        if not tokens:  # the line ended before generate logs its summary
            said, self.ended = said + "\n", True
        to_stdout(said, "generate")

    def cut_short(self) -> None:
        """End a line cut short (Ctrl-C mid-stream: the shell's prompt was glued to it)."""
        if self.started and not self.ended:
            from ..paths import to_stdout

            self.ended = True
            to_stdout("\n", "generate")


def run_generate(
    cfg: Config, texts: list[str], sampling: Sampling, out: str | None = None, *, weights=None
) -> list[str]:
    """Generate after every prompt; print (or write) the results; return the completions.
    ``weights``: a ``WeightSource`` (a checkpoint's) instead of the model directory's."""
    from ..paths import to_stdout

    tok = _tokenizer(cfg)
    prompts = [tok.encode_prompt(t) for t in texts]  # (as tokenizer(text): its BOS where it adds one)
    for t, p in zip(texts, prompts):
        if not p:
            raise ConfigError(f"generate: the prompt {t!r} has no tokens")
    stream = len(prompts) == 1 and out is None
    show = StreamedText(tok, texts[0])
    # the built-in GPT has no model directory to name its end-of-sequence token: its tokenizer's
    eos = None if cfg.model.hf_dir else tuple(i for i in [getattr(tok, "eos_token_id", None)] if i is not None)
    try:
        rows = generate(
            cfg,
            prompts,
            sampling,
            weights=weights,
            on_tokens=show if stream else None,
            tokenizer_vocab=tok.vocab_size,
            eos=eos,
        )
    except KeyboardInterrupt:
        show.cut_short()
        raise
    texts_out = [tok.decode(r) for r in rows]
    if out is None and not stream:  # (a streamed row was printed as it came)
        for t, c in zip(texts, texts_out):
            to_stdout(f"{t}{c}\n\n", "generate")
    elif out is not None:
        _write_rows(out, texts, texts_out, rows)
    return texts_out


def _write_rows(out: str, texts: list[str], completions: list[str], rows: list[list[int]]) -> None:
    from ..paths import write_output_file

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def write(f) -> None:
        for t, c, r in zip(texts, completions, rows):
            f.write(json.dumps({"prompt": t, "completion": c, "tokens": r}) + "\n")

    write_output_file("generate --out", out, write)  # whole or not at all: a disk filled meanwhile
