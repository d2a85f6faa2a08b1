"""Vocabulary pieces: pools and peak memory of a large-vocabulary model, cut and uncut.

A Llama with a 128,256-token vocabulary (Llama 3's) and a small body, states on the
storage tier: uncut, the embedding and the head (131 M elements each at width 1024) are the
largest units and size every slot and gradient buffer; cut as the planner cuts where the
budget cannot hold them (the fewest pieces no larger than a block), a block does. Each setting runs in its own process (peak RSS is the process's): the
largest unit, the fixed pools, peak RSS, seconds per step, bytes read and written per step
(against the cost model's count), and the losses of the two (the same weights: they
differ by the cut cross-entropy's rounding).

Usage: python bench/vocab_pieces.py [--steps 3] [--d-model 1024] [--layers 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys

from tiertrain.bench.children import initial_weights, run_child
from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

MIB = 1 << 20


def run_one(args) -> dict:
    """One setting, in this process: the figures as a dict."""
    import statistics

    import torch

    from tiertrain.config import load_config
    from tiertrain.cost import run_traffic
    from tiertrain.cost.budget import STATES_ON_STORAGE
    from tiertrain.training.trainer import Trainer

    flags = [
        f"--io.paths={args.scratch}",
        f"--train.run_dir={args.scratch}/run",
        "--model.kind=llama",
        f"--model.d_model={args.d_model}",
        f"--model.n_layers={args.layers}",
        f"--model.n_heads={args.d_model // 64}",
        "--model.vocab_size=128256",
        "--model.max_seq_len=256",
        "--data.seq_len=256",
        "--data.micro_batch_size=2",
        "--data.micro_batches=2",
        f"--train.steps={args.steps}",
        "--train.progress=false",
        "--train.predict=false",
        "--memory.host_mib=16384",
        *[f"--memory.{k}={v}" for k, v in STATES_ON_STORAGE.items()],
    ]
    if args.pieces == -1:  # as the planner cuts where the budget needs it
        from tiertrain.models import auto_pieces, build_model

        args.pieces = auto_pieces(build_model(load_config(None, flags).model, param_dtype=torch.float32, seed=0)[0])
    if args.pieces:
        flags.append(f"--model.vocab_pieces={args.pieces}")
    if args.init:
        flags.append(f"--model.init_from={args.init}")
    cfg = load_config(None, flags)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        recs = [tr.train_step() for _ in range(args.steps)]
        t = run_traffic(tr, kept=0)
        return dict(
            pieces=len(tr.model.head_pieces),
            largest_unit=tr.layout.max_unit_numel,
            n_params=tr.layout.n_params,
            pools=sum(tr.pool_bytes.values()),
            step_s=statistics.median(r.step_s for r in recs[1:] or recs),
            read=recs[-1].ssd_read_bytes,
            write=recs[-1].ssd_write_bytes,
            model_read=t.read,
            model_write=t.write,
            losses=[r.loss for r in recs],
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    ap.add_argument("--pieces", type=int, default=None, help=argparse.SUPPRESS)  # one setting, in a child
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args)))
        return 0
    out = checked_out(args.out) if args.out else None
    rows = {}
    with scratch_dir(args.scratch, "vocab") as top:
        init = write_init(args, top)  # both settings start from these weights
        for label, pieces in (("uncut (vocab_pieces = 1)", 1), ("cut (the planner's pieces)", -1)):
            rows[label] = _child(args, label, pieces, init, top)
    report(args, rows, out)
    return 0


def write_init(args, top: str) -> str:
    """The uncut model's seeded initial weights in one safetensors file."""
    from tiertrain.config import ModelConfig

    mc = ModelConfig(
        kind="llama",
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // 64,
        vocab_size=128256,
        max_seq_len=256,
        vocab_pieces=1,
    )
    return initial_weights(mc, os.path.join(top, "init.safetensors"))


def _child(args, label: str, pieces: int | None, init: str, top: str) -> dict:
    flags = [f"--steps={args.steps}", f"--d-model={args.d_model}", f"--layers={args.layers}", f"--init={init}"]
    return run_child(__file__, label, flags + ([f"--pieces={pieces}"] if pieces else []), top)


def report(args, rows: dict, out: str | None) -> None:
    lines = [
        f"# Vocabulary pieces: a {next(iter(rows.values()))['n_params'] / 1e6:.0f} M-parameter Llama, "
        f"vocabulary 128,256, width {args.d_model}, {args.layers} blocks",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; fp32 on CPU, every state on the storage tier; "
        f"M = 2 micro-batches of 2 x 256 tokens; {args.steps} steps, median step of the last {max(1, args.steps - 1)}.",
        "",
        "| setting | pieces | largest unit (M elements) | fixed pools (GiB) | peak RSS (GiB) | s/step | "
        "read GB/step (model) | written GB/step (model) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | {r['pieces'] or '-'} | {r['largest_unit'] / 1e6:.1f} | {r['pools'] / 2**30:.2f} | "
            f"{r['peak_rss'] / 2**30:.2f} | {r['step_s']:.1f} | {r['read'] / 1e9:.2f} ({r['model_read'] / 1e9:.2f}) | "
            f"{r['write'] / 1e9:.2f} ({r['model_write'] / 1e9:.2f}) |"
        )
    a, b = rows.values()
    rel = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"]))
    lines += [
        "",
        f"Losses uncut: {', '.join(f'{v:.6f}' for v in a['losses'])}; cut: "
        f"{', '.join(f'{v:.6f}' for v in b['losses'])} (largest relative difference {rel:.1e}).",
        "",
    ]
    publish("\n".join(lines), out)


if __name__ == "__main__":
    sys.exit(main())
