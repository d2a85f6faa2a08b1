"""Peak RSS of a training run against its memory budget (memory.host_mib).

Runs tiertrain (a Llama of the given shape, random weights) for a few steps at a host budget,
in a process of its own, sampling its RSS every 0.2 s, and prints the peak against the budget
plus what the process holds before tiertrain takes anything (the interpreter, torch and their
libraries: not in the budget). Step times are printed for the record; this benchmark is about
memory, use bench/vs_plain.py for speed.

    python bench/peak_rss.py --model n_layers=16,d_model=2048,n_heads=16,d_ff=5632 \\
        --micro-batches 32 --host-mib 3143 --out bench/results/peak-rss-1b-m32-cpu-vm.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

MODEL = dict(kind="llama", n_layers=12, d_model=768, n_heads=12, d_ff=2048, vocab_size=32000)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(cli: list[str]) -> dict:
    import torch  # noqa: F401 - part of the baseline, as in any run

    from tiertrain.config import load_config
    from tiertrain.training.trainer import Trainer

    base = rss_mib()
    cfg = load_config(None, cli)
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(rss_mib())
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    steps = []
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        budget = tr.budget.lines() if tr.budget else []
        pools = sum(tr.pool_bytes.values())
        for _ in range(cfg.train.steps):
            n = len(samples)
            r = tr.train_step()
            steps.append(
                dict(
                    s=r.step_s,
                    peak=max(samples[n:], default=rss_mib()),
                    acts={k: r.extra.get(k, 0) for k in ("act_kept", "act_offloaded", "act_recomputed")},
                )
            )
            print(f"step {r.step}: {r.step_s:.1f} s, RSS peak {steps[-1]['peak']:.0f} MiB", file=sys.stderr, flush=True)
    stop.set()
    th.join()
    return dict(base=base, peak=max(samples), steps=steps, budget=budget, pools=pools)


def main(argv: list[str] | None = None) -> int:
    from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(argv[1:])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="model fields to change, e.g. n_layers=16,d_model=2048")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-mib", type=int, required=True, help="memory.host_mib")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = checked_out(args.out) if args.out else None
    model = dict(MODEL, **dict(kv.split("=", 1) for kv in filter(None, args.model.split(","))))
    with scratch_dir(args.scratch, "peak-rss") as scratch:
        cli = [f"--model.{k}={v}" for k, v in model.items()] + [
            f"--model.max_seq_len={args.seq_len}",
            f"--data.seq_len={args.seq_len}",
            "--data.micro_batch_size=1",
            f"--data.micro_batches={args.micro_batches}",
            f"--train.steps={args.steps}",
            "--train.progress=false",
            f"--io.paths={scratch}/ssd",
            f"--train.run_dir={scratch}/run",
            "--checkpoint.at_end=false",
            f"--memory.host_mib={args.host_mib}",
            *[f"--{x}" for x in args.set],
        ]
        p = subprocess.run([sys.executable, __file__, "--worker", *cli], check=True, capture_output=True, text=True)
        res = json.loads(p.stdout.strip().splitlines()[-1])
    allowed = args.host_mib + res["base"]
    lines = [
        f"# Peak RSS against the memory budget, {time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB RAM; fp32 on CPU",
        "- model: Llama ("
        + ", ".join(f"{k} {v}" for k, v in model.items() if k != "kind")
        + f"), random weights; M = {args.micro_batches} micro-batches of 1 x {args.seq_len} tokens; {args.steps} steps"
        + (f"; other settings: {', '.join(args.set)}" if args.set else ""),
        f"- budget memory.host_mib = {args.host_mib} MiB; before tiertrain takes anything the process holds "
        f"{res['base']:.0f} MiB (interpreter, torch: not in the budget); fixed pools {res['pools'] / 2**20:.0f} MiB",
        "",
        *[f"    {x}" for x in res["budget"]],
        "",
        "| step | s | peak RSS MiB | activations kept / offloaded / recomputed |",
        "|---|---|---|---|",
        *[
            f"| {i + 1} | {s['s']:.1f} | {s['peak']:.0f} | {s['acts']['act_kept']} / {s['acts']['act_offloaded']} / "
            f"{s['acts']['act_recomputed']} |"
            for i, s in enumerate(res["steps"])
        ],
        "",
        f"- peak RSS {res['peak']:.0f} MiB against budget + baseline {allowed:.0f} MiB: "
        f"**{'within' if res['peak'] <= allowed else 'OVER'}** ({res['peak'] - allowed:+.0f} MiB)",
        "",
    ]
    publish("\n".join(lines), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
