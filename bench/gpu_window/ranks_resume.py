"""Ranks stopped and resumed (stage 5 of the GPU window): ``tiertrain train --nproc N`` for 6
steps straight, and for 3 steps then ``--resume`` to 6, from the same seed: the resumed run's
losses must be the straight run's, bit for bit (each step's loss as ``metrics.jsonl`` has it).

    python3 bench/gpu_window/ranks_resume.py --scratch DIR [--nproc 2] [FLAG ...]

FLAGs are ``tiertrain train`` flags for both runs (``--train.device=cuda``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def train(scratch: str, name: str, nproc: int, steps: int, flags: list[str], resume: bool = False) -> None:
    run = os.path.join(scratch, f"{name}-run")
    cmd = [
        sys.executable,
        "-m",
        "tiertrain",
        "train",
        "--nproc",
        str(nproc),
        f"--train.steps={steps}",
        f"--io.paths={os.path.join(scratch, name)}",
        f"--train.run_dir={run}",
        *flags,
    ]
    cmd += ["--resume", run] if resume else ["--train.overwrite=true"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def losses(run: str) -> list[float]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r and "step" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--nproc", type=int, default=2)
    args, flags = ap.parse_known_args()
    train(args.scratch, "straight", args.nproc, 6, flags)
    train(args.scratch, "split", args.nproc, 3, flags)
    train(args.scratch, "split", args.nproc, 6, flags, resume=True)
    a, b = losses(os.path.join(args.scratch, "straight-run")), losses(os.path.join(args.scratch, "split-run"))
    print("straight:", a)
    print("resumed: ", b)
    same = a == b and len(a) == 6
    if same:
        print("the same losses, bit for bit")
        return 0
    first = next((i for i, (x, y) in enumerate(zip(a, b), 1) if x != y), min(len(a), len(b)) + 1)
    # before the resume both runs did the same work: a difference there is the kernels' nondeterminism
    why = "before the resume: nondeterministic kernels, not the resume" if first <= 3 else "after the resume"
    print(f"the losses differ from step {first} ({why})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
