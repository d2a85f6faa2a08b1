"""A model larger than this machine's memory: train a few steps and put the step against
its floor.

A Llama of about 2.4 B parameters (fp32 parameters, gradients and AdamW moments: 38 GB,
1.6x this machine's 24 GiB) with every state on the storage tier, within a host budget of
``--host-mib``. Measured in one run: peak RSS (the trainer's, plus the engines' peaks, which
run side by side), seconds per step and per phase, bytes read and written per step against
the cost model's count; the storage tier's bandwidth before training and, with one unit of
each kind's compute, after it (so that the probe's memory is not in the peak), for the floor
(the faster of the two disk figures):

    floor = max(compute, bytes read / read GB/s + bytes written / write GB/s)
    compute = M x (embedding + L x (block forward + block backward) + head)

(what plain PyTorch's step would take if it fit: no recompute), and the cost model's
prediction from the same rates.

Usage: python bench/big_model.py [--steps 3] [--mode engines|overlap|baseline] [--eager] [--host-mib 3300]
                                 [--slots 3] [--set SECTION.FIELD=VALUE ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
from dataclasses import replace

from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

SHAPE = dict(d_model=2560, n_layers=28, n_heads=20, vocab_size=32000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mode", default="engines", choices=["baseline", "overlap", "engines"])
    ap.add_argument(
        "--eager",
        action="store_true",
        help="update.eager (each unit as its gradient arrives; sets optim.grad_clip = 0, which it needs)",
    )
    ap.add_argument("--host-mib", type=int, default=3300)
    ap.add_argument("--layers", type=int, default=SHAPE["n_layers"])
    ap.add_argument("--d-model", type=int, default=SHAPE["d_model"])
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--probe-mib", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=3, help="memory.device_slots")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="any other config field, e.g. --set memory.act_buffers=2 (repeatable)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = checked_out(args.out) if args.out else None
    with scratch_dir(args.scratch, "big") as scratch:
        report = run(args, scratch)
    publish(report, out)
    return 0


def run(args, scratch: str) -> str:
    from tiertrain.config import load_config
    from tiertrain.cost import measure_rates, predict_with, run_traffic
    from tiertrain.training.trainer import Trainer

    s = dict(SHAPE, n_layers=args.layers, d_model=args.d_model, n_heads=args.d_model // 128)
    flags = [
        f"--io.paths={scratch}/ssd",
        f"--train.run_dir={scratch}/run",
        "--model.kind=llama",
        *[f"--model.{k}={v}" for k, v in s.items()],
        "--model.max_seq_len=512",
        "--data.seq_len=512",
        "--data.micro_batch_size=1",
        "--data.micro_batches=2",
        f"--train.steps={args.steps}",
        "--train.progress=false",
        "--train.predict=false",
        f"--memory.host_mib={args.host_mib}",
        f"--update.mode={args.mode}",
        f"--memory.device_slots={args.slots}",
        *(["--update.eager=true", "--optim.grad_clip=0"] if args.eager else []),
        *[f"--{x}" for x in args.set],
    ]
    cfg = load_config(None, flags)
    from tiertrain.cost.probe import DiskProbe

    os.makedirs(f"{scratch}/ssd", exist_ok=True)
    with DiskProbe(cfg.io, args.probe_mib) as d:  # the disk before training too: it drifts over a long run
        w0 = d.write()
        before = (d.read(), w0)
    with Trainer(cfg) as tr:
        tr.initialize(progress=True)
        recs = []
        for _ in range(args.steps):
            recs.append(tr.train_step())
            print(recs[-1].line(args.steps), flush=True)
        trainer_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        engines_peak = max(r.extra.get("engine_peak_host_bytes", 0) for r in recs)
        budget_lines = tr.budget.lines() if tr.budget else []
        t = run_traffic(tr)
        n_params, L, M = tr.layout.n_params, len(tr.model.blocks), tr.cfg.data.micro_batches
        rates = measure_rates(tr.cfg, tr.rt, probe_mib=args.probe_mib)
        pred = predict_with(tr.cfg, tr.rt, rates)
        # the disk drifts over a long run: the same prediction with the disk as probed before training
        pred_before = predict_with(tr.cfg, tr.rt, replace(rates, read_gbps=before[0], write_gbps=before[1]))
    last = recs[1:] or recs
    step = statistics.median(r.step_s for r in last)
    read = statistics.median(r.ssd_read_bytes + r.extra.get("engine_read_bytes", 0) for r in last)
    write = statistics.median(r.ssd_write_bytes + r.extra.get("engine_write_bytes", 0) for r in last)
    compute = M * (rates.embed_fwd_s + rates.embed_bwd_s + L * (rates.block_fwd_s + rates.block_bwd_s) + rates.head_s)
    io_after = t.read / (rates.read_gbps * 1e9) + t.write / (rates.write_gbps * 1e9)
    io_before = t.read / (before[0] * 1e9) + t.write / (before[1] * 1e9)
    io = min(io_before, io_after)  # the faster disk of the two probes: the floor never flatters the step
    floor = max(compute, io)
    peak = trainer_peak + engines_peak
    lines = [
        f"# A model larger than memory: {n_params / 1e9:.2f} B-parameter Llama ({s['d_model']} wide, {L} blocks, "
        f"vocabulary {s['vocab_size']}), {args.mode}{', eager (no clipping)' if args.eager else ''}",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB RAM, "
        f"one virtual disk; fp32 on CPU; M = {M} micro-batches of 1 x 512 tokens; host budget {args.host_mib} MiB; "
        f"{args.slots} parameter slots; "
        f"{'other settings: ' + ', '.join(args.set) + '; ' if args.set else ''}"
        f"fp32 parameters + gradients + AdamW moments = {16 * n_params / 1e9:.1f} GB.",
        "",
        *[f"    {x}" for x in budget_lines],
        "",
        "| step | loss | s | forward s | backward s | update s | I/O wait s | read GB | written GB |",
        "|---|---|---|---|---|---|---|---|---|",
        *[
            f"| {r.step} | {r.loss:.4f} | {r.step_s:.1f} | {r.forward_s:.1f} | {r.backward_s:.1f} | {r.update_s:.1f} | "
            f"{r.io_wait_s:.1f} | {(r.ssd_read_bytes + r.extra.get('engine_read_bytes', 0)) / 1e9:.2f} | "
            f"{(r.ssd_write_bytes + r.extra.get('engine_write_bytes', 0)) / 1e9:.2f} |"
            for r in recs
        ],
        "",
        f"- peak RSS: trainer {trainer_peak / 2**30:.2f} GiB + engines {engines_peak / 2**30:.2f} GiB = "
        f"**{peak / 2**30:.2f} GiB**",
        f"- bytes per step (median of steps 2..): read {read / 1e9:.2f} GB, written {write / 1e9:.2f} GB; the cost "
        f"model's count: {t.read / 1e9:.2f} / {t.write / 1e9:.2f} GB",
        f"- measured after training: read {rates.read_gbps:.2f} GB/s, write {rates.write_gbps:.2f} GB/s; per "
        f"micro-batch block forward {rates.block_fwd_s:.2f} s, backward {rates.block_bwd_s:.2f} s, head "
        f"{rates.head_s:.2f} s",
        f"- disk before training: read {before[0]:.2f} GB/s, write {before[1]:.2f} GB/s (I/O {io_before:.1f} s a "
        f"step); after: I/O {io_after:.1f} s; the floor takes the faster",
        f"- floor: max(compute {compute:.1f} s, I/O {io:.1f} s) = {floor:.1f} s; step (median of steps 2..) "
        f"{step:.1f} s = **{step / floor:.2f}x the floor**",
        f"- the cost model's prediction from the same rates: {pred.step_s:.1f} s ({pred.step_s / step:.2f}x measured); "
        f"with the disk as probed before training: {pred_before.step_s:.1f} s ({pred_before.step_s / step:.2f}x)",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
