"""1 rank against N ranks on the same global batch: step time, bytes per rank (disk and
network), peak RSS per rank, losses.

Each run is `tiertrain train --nproc N` (torchrun underneath) with the states on the storage
tier (a small memory.host_mib per rank); N ranks get data.micro_batches = M / N each, so every
run sees the same sequences. On one machine the ranks share its cores and its disk, so N
ranks are not faster here: what this shows is what each rank moves and holds (1/N of the
states, of the disk traffic, and the network bytes of the formula), from which a machine with
a GPU and an SSD per rank is predicted in docs/guide/ranks.md.

    python bench/ranks.py --ranks 2 --out bench/results/ranks-cpu-vm.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MODEL = dict(kind="llama", n_layers=8, d_model=512, n_heads=8, d_ff=1408, vocab_size=32000)


def run(n: int, args, scratch: str) -> list[list[dict]]:
    """Per rank, its metrics records."""
    model = dict(MODEL, **dict(kv.split("=", 1) for kv in filter(None, args.model.split(","))))
    d = os.path.join(scratch, f"n{n}")
    flags = [f"--model.{k}={v}" for k, v in model.items()] + [
        f"--model.max_seq_len={args.seq_len}",
        f"--data.seq_len={args.seq_len}",
        "--data.micro_batch_size=1",
        f"--data.micro_batches={args.micro_batches // n}",
        f"--train.steps={args.steps}",
        "--train.progress=false",
        f"--io.paths={d}/ssd",
        f"--train.run_dir={d}/run",
        "--checkpoint.at_end=false",
        "--train.predict=false",
        f"--memory.host_mib={args.host_mib}",
        *[f"--{x}" for x in args.set],
    ]
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "tiertrain", "train", "--nproc", str(n), *flags],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    print(f"{n} rank(s): {time.perf_counter() - t0:.0f} s", flush=True)
    out = []
    for r in range(n):
        path = os.path.join(d, "run", *([] if r == 0 else ["ranks", str(r)]), "metrics.jsonl")
        with open(path) as f:
            out.append([json.loads(line) for line in f if line.strip()])
    return out


def main(argv: list[str] | None = None) -> int:
    from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model", default="")
    ap.add_argument("--micro-batches", type=int, default=8, help="global micro-batches per step (split over the ranks)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="steps (the first is warm-up)")
    ap.add_argument("--host-mib", type=int, default=400, help="memory.host_mib of every rank")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.micro_batches % args.ranks:
        ap.error(f"--micro-batches {args.micro_batches} does not split over {args.ranks} ranks")
    out = checked_out(args.out) if args.out else None
    with scratch_dir(args.scratch, "ranks") as scratch:
        runs = {n: run(n, args, scratch) for n in (1, args.ranks)}
    med = lambda recs, k: statistics.median(r[k] for r in recs[1:])  # noqa: E731
    net = lambda recs, k: statistics.median(r["extra"].get(k, 0) for r in recs[1:])  # noqa: E731
    rows = []
    for n, ranks in runs.items():
        for r, recs in enumerate(ranks):
            rows.append(
                f"| {n} | {r} | {med(recs, 'step_s'):.2f} | {med(recs, 'ssd_read_bytes') / 1e9:.3f} / "
                f"{med(recs, 'ssd_write_bytes') / 1e9:.3f} | {net(recs, 'net_sent_bytes') / 1e9:.3f} / "
                f"{net(recs, 'net_received_bytes') / 1e9:.3f} | {max(x['peak_host_bytes'] for x in recs) / 2**30:.2f} | "
                + " ".join(f"{x['loss']:.4f}" for x in recs)
                + " |"
            )
    one, many = runs[1][0], runs[args.ranks]
    disk1 = med(one, "ssd_read_bytes") + med(one, "ssd_write_bytes")
    diskn = statistics.mean(med(x, "ssd_read_bytes") + med(x, "ssd_write_bytes") for x in many)
    dl = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one, many[0]))
    model = dict(MODEL, **dict(kv.split("=", 1) for kv in filter(None, args.model.split(","))))
    lines = [
        f"# 1 rank against {args.ranks} ranks on the same global batch, {time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, one virtual disk shared by the ranks; Gloo on "
        "loopback; fp32 on CPU",
        "- model: Llama ("
        + ", ".join(f"{k} {v}" for k, v in model.items() if k != "kind")
        + f"), random weights; global batch {args.micro_batches} micro-batches of 1 x {args.seq_len} tokens "
        f"({args.micro_batches // args.ranks} per rank with {args.ranks}); memory.host_mib = {args.host_mib} per rank; "
        f"{args.steps} steps, the first discarded; medians"
        + (f"; other settings: {', '.join(args.set)}" if args.set else ""),
        "",
        "| ranks | rank | s/step | disk read / written GB per step | network sent / received GB per step | peak RSS GiB | losses |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- disk bytes per rank per step: {diskn / 1e9:.3f} GB with {args.ranks} ranks against {disk1 / 1e9:.3f} GB with "
        f"one ({diskn / disk1:.2f}x)",
        f"- losses: largest relative difference between 1 and {args.ranks} ranks {dl:.1e} (sums grouped per rank)",
        "",
    ]
    publish("\n".join(lines), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
