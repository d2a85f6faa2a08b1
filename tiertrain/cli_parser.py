"""The ``tiertrain`` command line's options (``cli.py`` runs the commands)."""

from __future__ import annotations

import argparse

__all__ = ["build_parser"]

_OVERRIDES = """\
Every config field can be set as --section.field=value (or --section.field value), on top of
--config FILE; `tiertrain config --reference` lists them all. Examples:
  --train.steps=200 --optim.lr=1e-3 --io.paths=/nvme0/tt,/nvme1/tt --update.mode=engines"""


def _with_overrides(sub, name: str, help: str, config: str = "") -> argparse.ArgumentParser:
    """A command whose config fields are flags (``--section.field=value``), said in its help,
    on top of ``--config FILE`` (``config``: what its help adds)."""
    p = sub.add_parser(name, help=help, epilog=_OVERRIDES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help=f"TOML file; flags --section.field=value override it{config}")
    return p


def build_parser(description: str) -> argparse.ArgumentParser:
    """The command line's parser: a subcommand each, and its options (config fields are
    ``--section.field=value`` flags, left to ``load_config``)."""
    p = argparse.ArgumentParser(prog="tiertrain", description=description)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd")

    t = _with_overrides(sub, "train", "train (no arguments: the default main job)")
    t.add_argument("--resume", help="a checkpoint directory, a run directory (its latest checkpoint), or 'latest'")
    t.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="train as N data-parallel ranks on this machine (started under torchrun; see [ranks])",
    )

    pl = _with_overrides(sub, "plan", "placement, bytes per step and the predicted step time, without training")
    pl.add_argument("--probe-mib", type=int, default=256, help="bytes written and read to measure the storage tier")

    ev = _with_overrides(
        sub,
        "eval",
        "loss and perplexity of a model on data.eval_corpus, forward only",
        " (the model: --model.hf_dir, --model.init_from; the text: --data.eval_corpus)",
    )
    ev.add_argument(
        "--checkpoint", help="a tiertrain checkpoint, or a run directory (its latest): its model, weights and tokenizer"
    )
    ev.add_argument("--out", help="also write the result (JSON) here")

    g = _with_overrides(
        sub,
        "generate",
        "generate text after prompts, layer-major over the batch",
        " (the model: --model.hf_dir; prompts per micro-batch: --data.micro_batch_size)",
    )
    g.add_argument(
        "--checkpoint",
        help="a tiertrain checkpoint, or a run directory (its latest): its model and "
        "weights (read directly, CRC32C checked first) and its model directory's tokenizer",
    )
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help='a text file (one prompt a line) or JSONL (a "prompt" field a line)')
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate after each prompt (default 32)")
    g.add_argument("--temperature", type=float, default=None, help="0 (the default): greedy")
    g.add_argument("--top-k", type=int, default=0, help="sampling: the k likeliest tokens only (0, the default: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sampling: the likeliest tokens up to this mass (1: all)")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="above 1: tokens already in the row made less likely, as transformers' generate does "
        "(default: the model's generation_config.json's, else 1: none)",
    )
    g.add_argument("--seed", type=int, default=0, help="the sampling's random seed (default 0)")
    g.add_argument("--stop", type=int, action="append", help="a token id that ends a row (repeatable)")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="go on past the model's end-of-sequence token (by default a row ends there, as in transformers' generate)",
    )
    g.add_argument("--out", help="write JSONL (prompt, completion, tokens) here instead of printing")

    ex = sub.add_parser("export", help="write a checkpoint's weights as safetensors (an HF directory for HF models)")
    ex.add_argument(
        "--checkpoint", required=True, help="a checkpoint directory, or a run directory (its latest checkpoint)"
    )
    ex.add_argument("--out", required=True, help="output directory (new or empty)")
    ex.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    ex.add_argument(
        "--merge",
        action="store_true",
        help="a run with adapters: the base's weights with the adapters merged in (default: a peft adapter directory)",
    )
    ex.add_argument(
        "--model.hf_dir", dest="hf_dir", help="where the model directory the checkpoint's run read has moved"
    )

    pr = sub.add_parser(
        "prepare",
        help="tokenize text files into a token file, or JSONL/Parquet/datasets rows into "
        "prepared examples, for data.corpus",
    )
    pr.add_argument(
        "--input",
        required=True,
        action="append",
        help="a .txt file, or .jsonl / .parquet / a datasets save_to_disk directory (repeat for several)",
    )
    pr.add_argument("--output", required=True, help="the token file (text) or directory (rows) to write")
    pr.add_argument("--tokenizer", help="local Hugging Face tokenizer directory (default: byte-level)")
    pr.add_argument(
        "--format",
        default="auto",
        help="rows: 'text', 'completion' (prompt/completion), 'chat' "
        "(messages) or 'auto' (from the first row's fields)",
    )
    pr.add_argument("--no-mask-prompt", action="store_true", help="rows: score prompt, system and user tokens too")
    pr.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none either where stderr is no terminal)"
    )

    pl = sub.add_parser("plot", help="draw loss (train, validation), tokens/s and peak memory of runs into a PNG")
    pl.add_argument("run_dir", nargs="+", help="run directories (train.run_dir), several on one plot")
    pl.add_argument("--out", help="the PNG to write (default: RUN_DIR/curves.png of the first)")

    c = _with_overrides(sub, "config", "print the resolved config (or --reference: every field)")
    c.add_argument("--reference", action="store_true", help="print the documentation of every field")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bio = bsub.add_parser("io", help="sequential write/read GB/s of the storage tier vs fio")
    bio.add_argument("--path", action="append", required=True, help="a scratch directory (repeat for several SSDs)")
    bio.add_argument("--size-gib", type=float, default=2.0, help="bytes moved per pass (default 2 GiB)")
    bio.add_argument("--threads", type=int, default=8)
    bio.add_argument("--chunk-mib", type=int, default=16)
    bio.add_argument("--repeats", type=int, default=3)
    bio.add_argument("--no-fio", action="store_true", help="skip the fio comparison")
    bio.add_argument("--sweep", action="store_true", help="also sweep threads x chunk size")
    bio.add_argument("--out", help="also write the report (markdown) here")
    return p
