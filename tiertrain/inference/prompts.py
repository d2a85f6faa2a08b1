"""``tiertrain generate``: prompts in (the command line, a text file with one prompt a line,
or JSONL with a ``prompt`` field), text out (stdout, or JSONL with ``--out``), through
``generate.generate``. The tokenizer is the model directory's (else ``data.tokenizer``, else
bytes); with one prompt the tokens are printed as they come."""

from __future__ import annotations

import json
import os
import sys

from ..config import Config, ConfigError
from ..data import load_tokenizer
from .generate import Sampling, generate

__all__ = ["read_prompts", "run_generate"]


def read_prompts(texts: list[str] | None, path: str | None) -> list[str]:
    """The prompts of ``--prompt`` (repeatable) and ``--prompts-file`` (.jsonl: a ``prompt``
    field a line; else one prompt a line), refused with the file and line when bad."""
    out = list(texts or [])
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"--prompts-file {path}: no such file")
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if path.endswith(".jsonl"):
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


def _tokenizer(cfg: Config):
    """``data.tokenizer``: the model directory's where it holds one (``Config`` sets it), else
    the one given, else bytes."""
    return load_tokenizer(cfg.data.tokenizer)


def run_generate(
    cfg: Config, texts: list[str], sampling: Sampling, out: str | None = None, *, weights=None
) -> list[str]:
    """Generate after every prompt; print (or write) the results; return the completions.
    ``weights``: a ``WeightSource`` (a checkpoint's) instead of the model directory's."""
    tok = _tokenizer(cfg)
    prompts = [tok.encode(t) for t in texts]
    for t, p in zip(texts, prompts):
        if not p:
            raise ConfigError(f"generate: the prompt {t!r} has no tokens")
    stream = len(prompts) == 1 and out is None

    def show(tokens):
        if not tokens:  # the end: the line ended before generate logs its summary
            sys.stdout.write("\n")
            sys.stdout.flush()
        elif tokens[0] is not None:
            sys.stdout.write(tok.decode([tokens[0]]))
            sys.stdout.flush()

    # the built-in GPT has no model directory to name its end-of-sequence token: its tokenizer's
    eos = None if cfg.model.hf_dir else tuple(i for i in [getattr(tok, "eos_token_id", None)] if i is not None)
    rows = generate(
        cfg,
        prompts,
        sampling,
        weights=weights,
        on_tokens=show if stream else None,
        tokenizer_vocab=tok.vocab_size,
        eos=eos,
    )
    texts_out = [tok.decode(r) for r in rows]
    if out is None and not stream:  # (a streamed row was printed as it came)
        for t, c in zip(texts, texts_out):
            print(f"{t}{c}\n")
    elif out is not None:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            for t, c, r in zip(texts, texts_out, rows):
                f.write(json.dumps({"prompt": t, "completion": c, "tokens": r}) + "\n")
    return texts_out
