"""Step time of two revisions of tiertrain on the same machine, in one run: `bench/train.py`
from each revision's own checkout (a git worktree), alternating, so both see the same disk,
cache and load. Prints each revision's medians, their spread over the rounds and the ratio.

Usage: python bench/ab.py --base REV [--head REV] [--rounds 3] [--modes baseline,engines]
                          [--micro-batches 4] [--steps 4] [--model K=V,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir  # noqa: E402

LINE = re.compile(r"^(?P<label>.+) M=(?P<M>\d+): (?P<s>[\d.]+) s/step")


def worktree(rev: str, where: str) -> str:
    path = os.path.join(where, rev.replace("/", "_"))
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", "-f", path, rev], check=True, capture_output=True, text=True
    )
    return path


def run(tree: str, args) -> dict[str, float]:
    """One bench/train.py run from ``tree``: s/step by row label."""
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [
        sys.executable,
        os.path.join(tree, "bench", "train.py"),
        "--modes",
        args.modes,
        "--micro-batches",
        args.micro_batches,
        "--steps",
        str(args.steps),
        "--scratch",
        os.path.join(args.scratch, "run"),
        *(["--model", args.model] if args.model else []),
    ]
    r = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench/train.py of {tree} failed:\n{r.stderr[-3000:]}")
    out = {}
    for line in r.stdout.splitlines():
        m = LINE.match(line)
        if m:
            out[f"{m['label']}, M={m['M']}"] = float(m["s"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the revision before (a commit, tag or branch)")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="baseline,engines")
    ap.add_argument("--micro-batches", default="4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", default=None, help="bench/train.py's --model (e.g. n_layers=8,d_model=512)")
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.out:
        args.out = checked_out(args.out)
    revs = {
        name: subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", rev], check=True, capture_output=True, text=True
        ).stdout.strip()
        for name, rev in (("base", args.base), ("head", args.head))
    }
    with tempfile.TemporaryDirectory(prefix="tiertrain-ab-") as tmp, scratch_dir(args.scratch, "bench-ab") as scratch:
        args.scratch = scratch
        trees = {name: worktree(rev, tmp) for name, rev in revs.items()}
        times: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
        try:
            for r in range(args.rounds):
                for name in ("base", "head") if r % 2 == 0 else ("head", "base"):  # alternate who goes first
                    print(f"round {r + 1}/{args.rounds}: {name} ({revs[name]})", flush=True)
                    for label, s in run(trees[name], args).items():
                        times[name].setdefault(label, []).append(s)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
    lines = [
        f"# Step time before and after, {time.strftime('%Y-%m-%d')}",
        "",
        f"- base {revs['base']} vs head {revs['head']}: `bench/train.py --modes {args.modes} --micro-batches "
        f"{args.micro_batches} --steps {args.steps}{' --model ' + args.model if args.model else ''}` from each revision's checkout, {args.rounds} alternating rounds"
        " on the same machine; each run's figure is the median of its steps after the first",
        f"- machine: {os.cpu_count()} cores; same disk for both",
        "",
        "| row | base s/step (median; min..max over rounds) | head s/step (median; min..max) | head / base |",
        "|---|---|---|---|",
    ]
    for label in times["head"]:
        b, h = times["base"].get(label, []), times["head"][label]
        if not b:
            continue
        mb, mh = statistics.median(b), statistics.median(h)
        lines.append(
            f"| {label} | {mb:.2f} ({min(b):.2f}..{max(b):.2f}) | {mh:.2f} ({min(h):.2f}..{max(h):.2f}) |"
            f" {mh / mb:.2f} |"
        )
    report = "\n".join(lines) + "\n"
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
