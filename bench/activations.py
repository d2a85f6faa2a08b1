"""Activation tiers benchmark: keep-all, recompute-all and auto (keep / offload / recompute by
the cost model) on long sequences, in one run.

A Llama-shaped model (default ~134M parameters, 1024 tokens per sequence) whose step's
activations are several times the budget given to auto. Other states stay in memory (the
default budget), so the differences are the activations' alone. Each configuration runs in
its own process (peak RSS is per process), configurations alternate over ``--rounds``:

- keep-all: ``memory.activations = keep`` with every pair's graph in memory;
- recompute-all: ``memory.activations = recompute`` (the stash keeps the block inputs);
- auto: ``memory.activations = auto`` with ``memory.keep_act_mib`` = a quarter of keep-all's
  activations: the pairs the backward needs first are kept, the cost model (rates probed at
  start) sends as many of the rest as pay off to the storage tier, the earliest recompute;
- offload (``--with-offload``): the same budget, every pair not kept offloaded.

It prints per configuration: median step time (steps 2..N), peak RSS growth, storage bytes
per step, I/O wait, where the pairs went; the disk's measured bandwidth and the record bytes'
serial I/O time (the floor the offload must hide under compute); and the goal: auto within
1.1x of keep-all, saving at least 80% of what recompute-all adds over keep-all.

Usage: python bench/activations.py [--model n_layers=12,d_model=768,...] [--seq 1024]
                                   [--micro-batches 2] [--steps 4] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

# a small vocabulary: the head's compute (in the forward as timed) would only add noise here
MODEL = dict(kind="llama", n_layers=12, d_model=768, n_heads=12, d_ff=2048, vocab_size=8192)
GIB, MIB = 1 << 30, 1 << 20

_CHILD = r"""
import json, sys
from tiertrain.config import Config
from tiertrain.device import host_rss, host_peak_rss, reset_peak_rss
from tiertrain.training.trainer import Trainer
cfg = Config.from_dict(json.loads(sys.argv[1]))
base = host_rss()  # after the imports: what the run adds
reset_peak_rss()
with Trainer(cfg) as tr:
    tr.initialize(progress=False)
    pred = tr.predict() if cfg.train.predict else None
    recs = []
    for _ in range(cfg.train.steps):
        recs.append(tr.train_step())
        print(recs[-1].line(cfg.train.steps), file=sys.stderr, flush=True)
    r = tr._rates
    out = dict(steps=[x.step_s for x in recs], read=[x.ssd_read_bytes for x in recs],
               write=[x.ssd_write_bytes for x in recs], wait=[x.io_wait_s for x in recs],
               extra=[{k: v for k, v in x.extra.items() if k.startswith("act_")} for x in recs],
               peak=host_peak_rss() - base, act=tr.acts.act_bytes, kept_peak=tr.executor.kept.peak_bytes, record=tr.acts.record_bytes,
               keep_mib=tr.cfg.memory.keep_act_mib, pools=sum(tr.pool_bytes.values()),
               read_gbps=r.read_gbps if r else None, write_gbps=r.write_gbps if r else None,
               io_cpu=r.io_cpu_s_per_gb if r else None, crc_gbps=r.crc_gbps if r else None,
               io_slowdown=r.io_slowdown if r else None, cores=r.cores if r else None,
               predicted=pred.step_s if pred else None)
print(json.dumps(out))
"""


def config(args, scratch: str, activations: str, keep_mib: int | None) -> dict:
    model = {**MODEL, **args.model, "max_seq_len": args.seq}
    memory = {"activations": activations, "host_mib": args.host_mib}
    if keep_mib is not None:
        memory["keep_act_mib"] = keep_mib
    return {
        "io": {"paths": [scratch]},
        "model": model,
        "data": {"seq_len": args.seq, "micro_batch_size": 1, "micro_batches": args.micro_batches},
        "memory": memory,
        "update": {"mode": "baseline"},
        "checkpoint": {"at_end": False},
        "train": {
            "steps": args.steps,
            "progress": False,
            "run_dir": os.path.join(scratch, "run"),
            "predict": True,
            "overwrite": True,
        },
    }


def run_child(cfg: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"child failed:\n{r.stderr[-4000:]}")
    for line in r.stderr.splitlines():
        if "activations (memory.activations" in line or "| acts" in line:
            print("   ", line.split("tiertrain: ")[-1][:240], flush=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _model_arg(s: str) -> dict:
    out = {}
    for kv in filter(None, s.split(",")):
        k, v = kv.split("=")
        out[k] = int(v) if v.isdigit() else v
    return out


def summarize(runs: list[dict]) -> dict:
    steady = [s for r in runs for s in r["steps"][1:]]
    last = runs[-1]
    return dict(
        step=statistics.median(steady),
        steps=steady,
        peak=max(r["peak"] for r in runs),
        read=statistics.median(x for r in runs for x in r["read"][1:]),
        write=statistics.median(x for r in runs for x in r["write"][1:]),
        wait=statistics.median(x for r in runs for x in r["wait"][1:]),
        acts=last["extra"][-1],
        act=last["act"],
        record=last["record"],
        kept_peak=last["kept_peak"],
        keep_mib=last["keep_mib"],
        pools=last["pools"],
        read_gbps=statistics.median(r["read_gbps"] for r in runs if r["read_gbps"])
        if any(r["read_gbps"] for r in runs)
        else None,
        write_gbps=statistics.median(r["write_gbps"] for r in runs if r["write_gbps"])
        if any(r["write_gbps"] for r in runs)
        else None,
        predicted=[r["predicted"] for r in runs],
        **{
            k: statistics.median(r[k] for r in runs) if all(r.get(k) for r in runs) else None
            for k in ("io_cpu", "crc_gbps", "io_slowdown", "cores")
        },
    )


def main() -> int:
    from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=_model_arg, default={}, help="overrides of the model, e.g. n_layers=8,d_model=1024")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--host-mib", type=int, default=16384, help="memory.host_mib of every configuration")
    ap.add_argument(
        "--keep-all-mib", type=int, default=4096, help="keep-all's memory.keep_act_mib (must hold them all)"
    )
    ap.add_argument("--with-offload", action="store_true", help="also every pair not kept offloaded")
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = checked_out(args.out) if args.out else None
    if args.steps < 2 or args.rounds < 1:
        raise SystemExit("--steps must be >= 2 (the first is warm-up) and --rounds >= 1")
    with scratch_dir(args.scratch, "bench-activations") as scratch:
        runs, quarter = compare(args, scratch)
    report = render(args, {n: summarize(rs) for n, rs in runs.items()}, quarter)
    publish(report, out)
    return 0


def compare(args, scratch: str) -> tuple[dict[str, list[dict]], int | None]:
    """Every configuration ``args.rounds`` times; the runs and auto's keep budget (MiB)."""
    # keep-all first, alone: it measures one pair's activations, which sets auto's budget
    names = ["keep-all", "recompute-all", "auto"] + (["offload"] if args.with_offload else [])
    runs: dict[str, list[dict]] = {n: [] for n in names}
    quarter = None
    for rnd in range(args.rounds):
        for name in names:
            if name == "keep-all":
                cfg = config(args, scratch, "keep", args.keep_all_mib)  # every graph fits
            elif name == "recompute-all":
                cfg = config(args, scratch, "recompute", 0)
            else:
                cfg = config(args, scratch, "auto" if name == "auto" else "offload", quarter)
            print(f"round {rnd + 1}, {name} ...", flush=True)
            r = run_child(cfg)
            runs[name].append(r)
            if name == "keep-all" and quarter is None:  # what every graph of a step held, as kept
                quarter = max(1, r["kept_peak"] // 4 // MIB)
            print(f"    steps {[round(s, 2) for s in r['steps']]} s, peak RSS +{r['peak'] / MIB:,.0f} MiB", flush=True)
    return runs, quarter


def render(args, s: dict, quarter: int) -> str:
    import torch

    keep, rec, auto = s["keep-all"], s["recompute-all"], s["auto"]
    m = {**MODEL, **args.model}
    pairs = m["n_layers"] * args.micro_batches
    total_act = keep["kept_peak"]
    rows = [
        "| configuration | step s (median) | vs keep-all | peak RSS growth | SSD read / written per step | "
        "I/O wait s | pairs kept / offloaded / recomputed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in s.items():
        a = r["acts"]
        rows.append(
            f"| {name} | {r['step']:.2f} | {r['step'] / keep['step']:.2f}x | {r['peak'] / MIB:,.0f} MiB | "
            f"{r['read'] / 1e9:.2f} / {r['write'] / 1e9:.2f} GB | {r['wait']:.2f} | "
            f"{a.get('act_kept', 0)} / {a.get('act_offloaded', 0)} / {a.get('act_recomputed', 0)} |"
        )
    added = rec["step"] - keep["step"]
    saved = (rec["step"] - auto["step"]) / added if added > 0 else float("nan")
    off_bytes = auto["acts"].get("act_offload_bytes", 0)
    rb, wb = auto["read_gbps"], auto["write_gbps"]
    serial = (off_bytes / (wb * 1e9) + off_bytes / (rb * 1e9)) if rb and wb else None
    goal1 = auto["step"] <= 1.1 * keep["step"]
    goal2 = saved >= 0.8
    lines = [
        "# Activation tiers: keep-all, recompute-all, auto (keep / offload / recompute)",
        "",
        f"Machine: {platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}, CPU device, fp32.",
        f"Model: Llama-shaped {m['n_layers']} layers, d_model {m['d_model']}, d_ff {m['d_ff']}, vocab {m['vocab_size']}; "
        f"sequence {args.seq} tokens, {args.micro_batches} micro-batches of 1: {pairs} (block, micro-batch) pairs. "
        f"Other states in memory (default budget); update path baseline; checksums on.",
        f"Activations: {total_act / pairs / MIB:.1f} MiB per pair kept ({total_act / GIB:.2f} GiB a step), an offloaded "
        f"record {auto['record'] / MIB:.1f} MiB (parameters and the block "
        f"input, in the stash, not stored). auto's keep budget: memory.keep_act_mib = {quarter} MiB, a quarter of "
        f"keep-all's activations.",
        f"Steps per run {args.steps} (the first is warm-up), {args.rounds} round(s), configurations alternating, "
        "each in its own process.",
        "",
        *rows,
        "",
        f"- Recompute-all adds {added:.2f} s a step over keep-all; auto saves {saved:.0%} of it "
        f"(goal >= 80%: {'met' if goal2 else 'NOT met'}); auto is {auto['step'] / keep['step']:.2f}x keep-all's step "
        f"(goal <= 1.1x: {'met' if goal1 else 'NOT met'}), at {auto['peak'] / keep['peak']:.2f}x its peak RSS growth.",
    ]
    if serial is not None:
        lines.append(
            f"- Floor of auto's offload: {off_bytes / 1e9:.2f} GB written and read back per step at the disk's "
            f"measured {wb:.2f} GB/s write, {rb:.2f} GB/s read (probed at start) = {serial:.2f} s of I/O if "
            f"nothing overlapped, against a keep-all step of {keep['step']:.2f} s: the I/O must hide under "
            "compute, and the CPU it takes (copies, checksums, system calls) comes off the 2 cores."
        )
    if serial is not None and auto["io_cpu"]:
        gb = 2 * off_bytes / 1e9
        crc = gb / auto["crc_gbps"]
        io_cpu = gb * auto["io_cpu"]
        copy = off_bytes / 1e9 / 8.0  # the pack's copy into the record, at ~8 GB/s (measured 1-23 GB/s here)
        per_rec = added / pairs if added > 0 else 0.0
        over = auto["step"] - keep["step"]
        recs = auto["acts"].get("act_recomputed", 0)
        lines.append(
            f"- Where auto's {over:.2f} s over keep-all goes (which term is in the way): I/O waits {auto['wait']:.2f} s "
            f"(the reads were ahead); bandwidth {serial:.2f} s of disk time in a {auto['step']:.2f} s step (hidden); "
            f"CPU taken by the I/O on {auto['cores']} cores: checksums {crc:.2f} s, the storage threads' system calls "
            f"and copies {io_cpu:.2f} s (probed {auto['io_cpu']:.2f} s/GB), the records' fill {copy:.2f} s, in all "
            f"{(crc + io_cpu + copy) / auto['cores']:.2f} s of the step if spread over the cores; compute slowed by the "
            f"disk working beside it: x{auto['io_slowdown']:.2f} (probed); {recs} recompute(s) at ~{per_rec:.2f} s each."
        )
    lines.append(
        f"- Predicted step at start (cost model), auto: {', '.join(f'{p:.2f} s' for p in auto['predicted'] if p)}."
    )
    lines.append("- Steps (s): " + "; ".join(f"{n}: {', '.join(f'{x:.2f}' for x in r['steps'])}" for n, r in s.items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
