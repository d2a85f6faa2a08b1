"""The cost model against measured steps: for each configuration, the prediction made before
the first step (probes of this machine, in the same process) next to the median of the
measured steps after warm-up, per phase, with the bytes per step both ways.

Usage: python bench/cost_model.py [--steps 5] [--rounds 2] [--out FILE] [--only NAME,...]

Rounds run every configuration once each, in turn (this machine's speed drifts within the
hour); the table has one row per run, and the verdict counts configurations whose median ratio
over the rounds is within 15%.

The configurations are Llama- and GPT-shaped models that the other benchmarks do not use,
with different micro-batches, activation policies, placements and update paths.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir  # noqa: E402

CONFIGS = {
    "llama-d640-L8-M4": [
        "--model.kind=llama",
        "--model.n_layers=8",
        "--model.d_model=640",
        "--model.n_heads=10",
        "--model.vocab_size=6000",
        "--data.micro_batches=4",
        "--update.mode=baseline",
    ],
    "llama-d768-L6-M1": [
        "--model.kind=llama",
        "--model.n_layers=6",
        "--model.d_model=768",
        "--model.n_heads=12",
        "--model.vocab_size=8192",
        "--data.micro_batches=1",
        "--update.mode=baseline",
    ],
    "gpt-d512-L6-M2-recompute-spill": [
        "--model.kind=gpt",
        "--model.n_layers=6",
        "--model.d_model=512",
        "--model.n_heads=8",
        "--data.micro_batches=2",
        "--memory.activations=recompute",
        "--memory.stash_host_mib=0",
        "--update.mode=baseline",
    ],
    "llama-d512-L10-M2-engines": [
        "--model.kind=llama",
        "--model.n_layers=10",
        "--model.d_model=512",
        "--model.n_heads=8",
        "--model.vocab_size=4096",
        "--data.micro_batches=2",
        "--update.mode=engines",
    ],
    "llama-d768-L6-M2-host-params-no-crc": [
        "--model.kind=llama",
        "--model.n_layers=6",
        "--model.d_model=768",
        "--model.n_heads=12",
        "--model.vocab_size=8192",
        "--data.micro_batches=2",
        "--memory.host_param_mib=512",
        "--io.checksum=false",
        "--update.mode=baseline",
    ],
    "llama-d896-L6-M2-overlap": [
        "--model.kind=llama",
        "--model.n_layers=6",
        "--model.d_model=896",
        "--model.n_heads=14",
        "--model.vocab_size=8192",
        "--data.micro_batches=2",
        "--update.mode=overlap",
    ],
    "gpt-d576-L8-M4-overlap-eager": [
        "--model.kind=gpt",
        "--model.n_layers=8",
        "--model.d_model=576",
        "--model.n_heads=9",
        "--data.micro_batches=4",
        "--update.mode=overlap",
        "--update.eager=true",
        "--optim.grad_clip=0",
    ],
}


def worker(name: str, flags: list[str], scratch: str, steps: int) -> dict:
    from tiertrain.config import load_config
    from tiertrain.cost import estimate
    from tiertrain.cost.budget import STATES_ON_STORAGE
    from tiertrain.training.trainer import Trainer

    on_ssd = [f"--memory.{k}={v}" for k, v in STATES_ON_STORAGE.items()]  # states on the storage tier
    cfg = load_config(
        None,
        [
            f"--io.paths={scratch}/ssd",
            f"--train.run_dir={scratch}/run",
            "--train.progress=false",
            f"--train.steps={steps}",
            "--train.predict=false",
            *on_ssd,
            *flags,
        ],
    )
    with Trainer(cfg) as tr:
        t0 = time.perf_counter()
        pred = estimate(tr.cfg, tr.rt)
        probe_s = time.perf_counter() - t0
        tr.initialize(progress=False)
        recs = [tr.train_step() for _ in range(steps)][1:]
    med = lambda f: statistics.median(f(r) for r in recs)  # noqa: E731
    return dict(
        name=name,
        flags=flags,
        probe_s=probe_s,
        rates=pred.rates.to_dict(),
        bound=pred.bound,
        predicted=dict(step=pred.step_s, **{p.name.split()[0]: p.time_s for p in pred.phases}),
        phase_bounds={p.name.split()[0]: p.bound for p in pred.phases},
        measured=dict(
            step=med(lambda r: r.step_s),
            forward=med(lambda r: r.forward_s),
            backward=med(lambda r: r.backward_s),
            update=med(lambda r: r.update_s),
        ),
        bytes=dict(
            pred_read=pred.traffic.read,
            pred_write=pred.traffic.write,
            read=med(lambda r: r.ssd_read_bytes + r.extra.get("engine_read_bytes", 0)),
            write=med(lambda r: r.ssd_write_bytes + r.extra.get("engine_write_bytes", 0)),
        ),
        steps=[r.step_s for r in recs],
    )


def render(results: list[dict], machine: str) -> str:
    lines = [
        f"# Cost model: predicted vs measured step, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"- machine: {machine}",
        "- predicted before the first step from probes in the same process (storage bandwidth on 256 MiB,"
        " CRC32C, the units' compute); measured: median of the steps after the first",
        "",
        "| configuration | predicted s | measured s | measured / predicted | fwd p/m | bwd p/m | upd p/m |"
        " bound | GB read p/m | GB written p/m |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, m, b = r["predicted"], r["measured"], r["bytes"]
        lines.append(
            f"| {r['name']} | {p['step']:.2f} | {m['step']:.2f} | {m['step'] / p['step']:.2f}x |"
            f" {p['forward']:.2f}/{m['forward']:.2f} | {p['backward']:.2f}/{m['backward']:.2f} |"
            f" {p['update']:.2f}/{m['update']:.2f} | {r['bound']} | {b['pred_read'] / 1e9:.3f}/{b['read'] / 1e9:.3f} |"
            f" {b['pred_write'] / 1e9:.3f}/{b['write'] / 1e9:.3f} |"
        )
    by: dict[str, list[float]] = {}
    for r in results:
        by.setdefault(r["name"], []).append(r["measured"]["step"] / r["predicted"]["step"])
    med = {k: statistics.median(v) for k, v in by.items()}
    within = sum(abs(v - 1) <= 0.15 for v in med.values())
    lines += [
        "",
        "Median of measured / predicted over the rounds: " + ", ".join(f"{k} {v:.2f}x" for k, v in med.items()) + ".",
        "",
        f"{within} of {len(med)} configurations within 15% of the prediction (median over the rounds).",
        "",
        "Rates probed per configuration (GB/s; seconds per micro-batch):",
        "",
    ]
    for r in results:
        q = r["rates"]
        lines.append(
            f"- {r['name']}: read {q['read_gbps']:.2f}, write {q['write_gbps']:.2f}, I/O CPU"
            f" {q['io_cpu_s_per_gb']:.3f} s/GB, CRC {q['crc_gbps']:.1f}; block fwd {q['block_fwd_s'] * 1e3:.1f} ms,"
            f" bwd {q['block_bwd_s'] * 1e3:.1f} ms, head {q['head_s'] * 1e3:.1f} ms; probes took"
            f" {r['probe_s']:.1f} s; steps {', '.join(f'{s:.2f}' for s in r['steps'])}; flags `{' '.join(r['flags'])}`"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        name, scratch = args.worker
        print("RESULT " + json.dumps(worker(name, CONFIGS[name], scratch, args.steps)), flush=True)
        return 0
    if args.out:
        args.out = checked_out(args.out)
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    results = []
    for name in [n for _ in range(args.rounds) for n in names]:  # each in its own process
        print(f"{name} ...", flush=True)
        with scratch_dir(args.scratch, f"cost-model-{name}") as scratch:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", name, scratch, "--steps", str(args.steps)],
                capture_output=True,
                text=True,
            )
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
        r = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        print(f"  predicted {r['predicted']['step']:.2f} s, measured {r['measured']['step']:.2f} s", flush=True)
        results.append(r)
    machine = f"{os.cpu_count()} cores, {platform.system()} {platform.release()}, one virtual disk, no GPU"
    report = render(results, machine)
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
