"""Device memory and host synchronisations over the steps of a run (stage 2 of the GPU window).

A Llama with its parameters streamed from the storage tier and hidden states spilled
(``memory.host_param_mib = 0``, ``memory.stash_host_mib = 0``), ``--steps`` steps. Per step:
the peak device memory (it must be flat after the first steps: nothing grows), the host
synchronisations the device counted (``syncs``: sync points that had to wait) and, on CUDA,
the calls PyTorch reports as synchronising (``torch.cuda.set_sync_debug_mode("warn")``).
Exit 1 if memory grows by more than 5% + 8 MiB after step 2, or a step waits at more than two
sync points per unit.

    python3 bench/gpu_window/steps_check.py --scratch DIR [--steps 20] [--device cuda] [--set SECTION.FIELD=VALUE]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

from tiertrain.config import load_config
from tiertrain.training.trainer import Trainer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = ap.parse_args()
    cfg = load_config(
        None,
        [
            f"--io.paths={os.path.join(args.scratch, 'ssd')}",
            f"--train.run_dir={os.path.join(args.scratch, 'run')}",
            "--train.overwrite=true",
            f"--train.device={args.device}",
            f"--train.steps={args.steps}",
            "--train.progress=false",
            "--train.predict=false",
            "--checkpoint.at_end=false",
            "--model.kind=llama",
            "--model.n_layers=8",
            "--memory.host_param_mib=0",
            "--memory.stash_host_mib=0",
            *(f"--{s}" for s in args.set),
        ],
    )
    cuda = args.device == "cuda"
    peaks, syncs, reported = [], [], []
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        units = len(tr.layout.units)
        for _ in range(cfg.train.steps):
            before = tr.dev.syncs
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    rec = tr.train_step()
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
            peaks.append(rec.peak_device_bytes / 2**20)
            syncs.append(tr.dev.syncs - before)
            reported.append(sum("synchronizing" in str(x.message) for x in w))
    print(f"{units} units x {cfg.data.micro_batches} micro-batches, {cfg.train.steps} steps on {args.device}")
    print("peak device MiB per step:", " ".join(f"{p:.0f}" for p in peaks))
    print("waited sync points per step:", " ".join(map(str, syncs)))
    if cuda:
        print("synchronising calls reported by PyTorch per step:", " ".join(map(str, reported)))
    grew = len(peaks) > 2 and max(peaks[2:]) > peaks[1] * 1.05 + 8
    too_many = len(syncs) > 1 and max(syncs[1:]) > 2 * units
    if grew:
        print(f"device memory grows: step 2 {peaks[1]:.0f} MiB, later up to {max(peaks[2:]):.0f} MiB")
    if too_many:
        print(f"a step waited at {max(syncs[1:])} sync points, more than 2 per unit ({2 * units})")
    return 1 if grew or too_many else 0


if __name__ == "__main__":
    sys.exit(main())
