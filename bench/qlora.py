"""LoRA on a frozen base kept in bf16, in int8 and in 4 bits (QLoRA): the bytes each reads a step and its
step against its own floors, the settings alternated in the same run.

A random Llama (or ``--family qwen2``) of ``--shape`` (LAYERSxWIDTH; default 33 x 2560: 2.46 B parameters) saved with
``save_pretrained`` in bf16; tiertrain trains LoRA (rank 16 on every projection) on it within a
host budget of ``--host-mib``, the base on the storage tier in each of ``--base-dtypes``
(``bfloat16``, ``int8``: LLM.int8()'s weights, ``nf4``, ``nf4-dq``: nf4 with its scales quantized too, ``fp4``), fp32 compute on
CPU (bf16 on CUDA). Each run in its own process (``bench/lora.py``'s worker), the settings
alternated ``--rounds`` times (the disk drifts between minutes). Per setting: bytes read a step,
s/step (median after the first), and the floors measured in the same process: I/O = two reads
of the base's stored bytes at the rate probed before training; the data path = one step's unit
visits with no compute (reads, checksums, the widening or dequantization; ``io_walk``); compute
= a forward and backward of every unit in memory at this batch (the cost model's unit timings).
Goal (issue 51): every setting within 1.15x of max(its own I/O floor, compute).

Usage: python bench/qlora.py [--shape 33x2560] [--family llama|qwen2] [--base-dtypes bfloat16,nf4] [--rounds 2]
                             [--steps 3] [--host-mib 2048] [--seq 64] [--micro-batches 2]
                             [--device cpu|cuda] [--scratch DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lora  # noqa: E402  (the LoRA benchmark's workers: base, tiertrain)

from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir  # noqa: E402

SETTINGS = {
    "bfloat16": ("bfloat16", False),
    "int8": ("int8", False),
    "nf4": ("nf4", False),
    "nf4-dq": ("nf4", True),
    "fp4": ("fp4", False),
}


def run(args, scratch: str, setting: str) -> dict:
    dtype, double = SETTINGS[setting]
    return lora.spawn(
        "tiertrain",
        dict(base=f"{scratch}/base", scratch=f"{scratch}/{setting}", steps=args.steps, host_mib=args.host_mib,
             base_dtype=dtype, double_quant=double, seq=args.seq, micro_batches=args.micro_batches,
             device=args.device, probe_mib=args.probe_mib),
    )  # fmt: skip


def report(args, base: dict, runs: dict[str, list[dict]]) -> str:
    first = next(iter(runs.values()))[0]
    lines = [
        f"# LoRA on a {first['params'] / 1e9:.2f} B {args.family} model with its frozen base in bf16 and quantized",
        "",
        f"Machine: {lora.machine()}. Model {args.family} {args.shape} (layers x width), vocabulary 32000, saved in bf16 "
        f"({base['bytes_bf16'] / 1e9:.2f} GB). LoRA rank 16 on {', '.join(lora.TARGETS)}. {lora.where(args)[0]}; "
        f"{args.micro_batches} micro-batches of 1 x {args.seq} tokens; host budget {args.host_mib} MiB; {args.steps} "
        f"steps a run, the first not counted; the settings alternated, {args.rounds} round(s).",
        "",
        "| setting | round | stored GB | read GB/step | s/step | I/O floor s | data path s | compute s | step / max(I/O, compute) | peak RSS GiB | last loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for setting, rs in runs.items():
        ratios = []
        for i, r in enumerate(rs):
            step = lora.med(r["steps"])
            io = 2 * r["base_bytes"] / (r["read_gbps"] * 1e9)
            ratio = step / max(io, r["compute_s"])
            ratios.append(ratio)
            lines.append(
                f"| {setting} | {i + 1} | {r['base_bytes'] / 1e9:.2f} | {lora.med(r['read']) / 1e9:.2f} | {step:.2f} | "
                f"{io:.2f} | {min(r['walk_s']):.2f} | {r['compute_s']:.2f} | {ratio:.2f}x | {r['peak'] / 2**30:.2f} | "
                f"{r['losses'][-1]:.4f} |"
            )
        summary.append((setting, statistics.median(ratios), statistics.median(lora.med(r["read"]) for r in rs),
                        statistics.median(lora.med(r["steps"]) for r in rs)))  # fmt: skip
    ref = summary[0]
    lines += ["", "Per setting (medians of the rounds):", ""]
    for setting, ratio, read, step in summary:
        lines.append(
            f"- `{setting}`: {read / 1e9:.2f} GB read a step ({read / max(ref[2], 1):.2f}x {ref[0]}'s), {step:.2f} s/step "
            f"({step / ref[3]:.2f}x), **{ratio:.2f}x max(its I/O floor, compute)** (goal: within 1.15x)"
        )
    lines += ["", "Losses differ between settings (another base); within a setting they are the same in every round."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="33x2560", help="LAYERSxWIDTH (default: 2.46 B parameters)")
    ap.add_argument("--family", default="llama", choices=("llama", "qwen2"), help="the transformers family")
    ap.add_argument("--base-dtypes", default="bfloat16,nf4", help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-mib", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=lora.SEQ)
    ap.add_argument("--micro-batches", type=int, default=lora.M)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--probe-mib", type=int, default=1024, help="MiB the disk probe writes and reads (floors)")
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    settings = args.base_dtypes.split(",")
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        ap.error(f"--base-dtypes: {', '.join(bad)} unknown; choose from {', '.join(SETTINGS)}")
    out = checked_out(args.out) if args.out else None
    with scratch_dir(args.scratch, "qlora") as scratch:
        base = lora.spawn("base", {"path": f"{scratch}/base", "shape": args.shape, "family": args.family})
        runs: dict[str, list[dict]] = {s: [] for s in settings}
        for _ in range(args.rounds):
            for s in settings:
                runs[s].append(run(args, scratch, s))
    publish(report(args, base, runs), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
