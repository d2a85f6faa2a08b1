"""Checkpoint save and restore speed: the training benchmark's 134M-parameter model (fp32),
states on the local disk, checkpoints on the same disk. Reports GB/s and seconds per GB.

Usage: python bench/checkpoint.py [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from train import config  # noqa: E402

from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir  # noqa: E402
from tiertrain.training.trainer import Trainer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.out:  # before the work, not after
        args.out = checked_out(args.out)
    saves, loads = [], []
    with scratch_dir(args.scratch, "bench-ckpt") as scratch, Trainer(config(scratch, 4, 1)) as tr:
        tr.initialize(progress=False)
        for _ in range(args.repeats):
            res = tr.save_checkpoint()
            saves.append((res.nbytes, res.seconds))
            t0 = time.perf_counter()
            tr.restore(res.path)
            loads.append((res.nbytes, time.perf_counter() - t0))
        n = tr.layout.n_params
    nbytes = saves[0][0]
    s = statistics.median(t for _, t in saves)
    r = statistics.median(t for _, t in loads)
    report = (
        f"# Checkpoint speed, {time.strftime('%Y-%m-%d')}\n\n"
        f"- machine: {os.cpu_count()} cores, one virtual disk (states and checkpoints on it)\n"
        f"- model: {n / 1e6:.1f} M parameters, fp32; a checkpoint holds params + both moments: {nbytes / 1e9:.2f} GB\n"
        f"- {args.repeats} repeats, medians (each save fsyncs every file and renames the directory)\n\n"
        f"| | seconds | GB/s | seconds per GB |\n|---|---|---|---|\n"
        f"| save | {s:.2f} | {nbytes / s / 1e9:.2f} | {s / (nbytes / 1e9):.2f} |\n"
        f"| restore (with CRC32C check) | {r:.2f} | {nbytes / r / 1e9:.2f} | {r / (nbytes / 1e9):.2f} |\n"
    )
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
