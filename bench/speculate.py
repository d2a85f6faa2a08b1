"""The speculative update against the overlapped one and plain PyTorch, on a shape where the
update's I/O is longer than the forward's compute.

Each run is a process of its own, in this order, in one invocation (the disk's rate drifts
between minutes: the tiertrain variants alternate, ``--rounds`` times):

1. ``init``: the model (the reference's own initialisation, seed 0) saved as safetensors;
2. ``pretrain`` (the fine-tuning workload only): plain PyTorch trains it ``--pretrain-steps``
   steps (1 micro-batch, ``--pretrain-lr``, clip 1.0), so that the fine-tuning's gradients
   are those of a trained model, which the clip rarely cuts;
3. ``plain``: plain PyTorch in memory, the fine-tuning steps (AdamW, ``clip_grad_norm_``):
   the compute floor;
4. ``overlap`` and ``speculate``: tiertrain from the same weights, states on the storage tier
   (``memory.host_mib`` = ``--host-mib``), ``update.mode = overlap`` without and with
   ``update.speculate = on``; with ``--engines``, also ``engines`` and ``engines speculating``
   (``update.mode = engines``: their bytes are the engines' own, on the same disk).

Two workloads (``--workload``): ``finetune`` (the above, fine-tuning at ``--lr``) and ``clip``
(from the random initialisation at ``--lr`` with ``--clip`` small enough that it acts in
every step: what a failed speculation costs). Reports s/step, bytes, how often the clip
acted, the speculation's tally, and the floor: max(plain PyTorch's step, the bytes of the
overlapped step at the disk's rate measured in the same run).

Usage: python bench/speculate.py [--workload finetune|clip] [--model K=V,...] [--micro-batches 8]
                                 [--seq-len 16] [--steps 4] [--rounds 2] [--host-mib 1024]
                                 [--device cpu|cuda] [--dtype auto|float32|bfloat16] [--engines] [--out FILE]

On a GPU (``--device cuda``; parameters in bf16 there unless ``--dtype``) plain PyTorch runs in
device memory, in the same dtype: the compute floor is the GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import vs_plain  # noqa: E402 - the init and plain PyTorch workers, and the model's flags

VARIANTS = {
    "overlap": ["--update.mode=overlap", "--update.speculate=off"],
    "speculate": ["--update.mode=overlap", "--update.speculate=on"],
}
ENGINES = {
    "engines": ["--update.mode=engines", "--update.speculate=off"],
    "engines speculating": ["--update.mode=engines", "--update.speculate=on"],
}


def worker_pretrain(cfg, path: str, steps: int, lr: float) -> dict:
    """Plain PyTorch trains the saved model ``steps`` steps and saves it back."""
    import dataclasses

    from safetensors.torch import save_file

    pre = dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, lr=lr, grad_clip=1.0, schedule="constant"),
        data=dataclasses.replace(cfg.data, micro_batches=1),
        # in fp32 wherever the fine-tuning runs: the starting point, not a timed run
        train=dataclasses.replace(cfg.train, steps=steps, param_dtype="float32"),
    )
    res, model = vs_plain.worker_plain(pre, path, keep=True)
    inner = getattr(model, "hf", model)
    save_file(vs_plain.untied({k: v.detach().cpu() for k, v in inner.state_dict().items()}), path)
    return res


def worker_tiertrain(cfg) -> dict:
    def extra(tr, recs, pred) -> dict:
        return {
            "speculation": recs[-1].extra.get("speculation", ""),
            "space": tr.plan.describe(),
            # the planner cuts the vocabulary where the budget cannot hold it whole (rounding, stated)
            "pieces": tr.cfg.model.vocab_pieces,
        }

    return vs_plain.worker_tiertrain(cfg, extra)


def worker(argv: list[str]) -> int:
    kind, out, path, steps, lr, *cli = argv
    from tiertrain.config import load_config

    cfg = load_config(None, cli)
    res = {
        "init": lambda: vs_plain.worker_init(cfg, path),
        "pretrain": lambda: worker_pretrain(cfg, path, int(steps), float(lr)),
        "plain": lambda: vs_plain.worker_plain(cfg, path),
        "tiertrain": lambda: worker_tiertrain(cfg),
    }[kind]()
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


def spawn(kind: str, scratch: str, args, cli: list[str]) -> dict:
    return vs_plain.spawn(kind, scratch, cli, script=__file__, extra=[str(args.pretrain_steps), str(args.pretrain_lr)])


def run(args, scratch: str) -> str:
    from tiertrain.bench.io import run_io_bench

    args.set = [
        f"optim.lr={args.lr}",
        f"optim.grad_clip={args.clip}",
        "optim.schedule=constant",
        f"train.device={args.device}",
        f"train.param_dtype={args.dtype}",
        *args.set,
    ]
    cli = vs_plain.flags(args, scratch)
    os.makedirs(f"{scratch}/ssd")
    init = spawn("init", scratch, args, cli)
    pre = spawn("pretrain", scratch, args, cli) if args.workload == "finetune" else None
    plain = spawn("plain", scratch, args, cli)
    tt_cli = [
        *cli,
        f"--model.init_from={scratch}/init.safetensors",
        f"--memory.host_mib={args.host_mib}",
        "--train.predict=false",
    ]
    variants = {**VARIANTS, **(ENGINES if args.engines else {})}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, extra in variants.items():
            runs[name].append(spawn("tiertrain", scratch, args, [*tt_cli, *extra]))
    io = run_io_bench([f"{scratch}/ssd"], size_bytes=args.io_mib << 20, repeats=2, use_fio=False, progress=False)
    rbw, wbw = io.median("ours", "read"), io.median("ours", "write")
    return report(args, init, pre, plain, runs, rbw, wbw)


def report(args, init, pre, plain, runs, rbw: float, wbw: float) -> str:
    from tiertrain.bench.output import compute_line

    steady = lambda xs: xs[1:]  # noqa: E731 - the first step of each run is warm-up
    med = lambda name, key: statistics.median(x for r in runs[name] for x in steady(r[key]))  # noqa: E731
    p_step = statistics.median(steady(plain["times"]))
    io_s = med("overlap", "read") / (rbw * 1e9) + med("overlap", "write") / (wbw * 1e9)
    floor = max(p_step, io_s)
    acted = sum(n > args.clip for n in plain["norms"]) if "norms" in plain else None
    t = {k: med(k, "times") for k in runs}
    spread = {k: [round(statistics.median(steady(r["times"])), 2) for r in runs[k]] for k in runs}
    phase = lambda name, i: statistics.median(p[i] for r in runs[name] for p in steady(r["parts"]))  # noqa: E731
    ref = runs["overlap"][0]["losses"]
    rel = lambda r: max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))  # noqa: E731
    cut = lambda r: f", the vocabulary in {r['pieces']} pieces" if r.get("pieces") else ""  # noqa: E731
    differ = [
        f"{k} round {i + 1} ({rel(r):.1e}{cut(r)})" for k in runs for i, r in enumerate(runs[k]) if r["losses"] != ref
    ]
    same = not differ
    model = dict(vs_plain.MODEL, **dict(kv.split("=", 1) for kv in filter(None, args.model.split(","))))
    lines = [
        f"# The speculative update against the overlapped one and plain PyTorch ({args.workload}), "
        f"{time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, one virtual disk (read {rbw:.2f} GB/s, write "
        f"{wbw:.2f} GB/s, measured in this run after training); "
        f"{compute_line(getattr(args, 'device', 'cpu'), getattr(args, 'dtype', 'float32'))}",
        f"- model: Llama, {init['params'] / 1e6:.1f} M parameters ("
        + ", ".join(f"{k} {v}" for k, v in model.items() if k != "kind")
        + f"); M = {args.micro_batches} micro-batches of 1 x {args.seq_len} tokens; lr {args.lr:g}, clip {args.clip:g}; "
        f"{args.steps} steps per run, the first discarded; {args.rounds} rounds alternating the variants; medians",
        (
            f"- workload: fine-tuning, after {args.pretrain_steps} steps of plain PyTorch pretraining at lr "
            f"{args.pretrain_lr:g} (loss {pre['losses'][0]:.3f} -> {pre['losses'][-1]:.3f})"
            if pre
            else "- workload: from the random initialisation, the clip acting in every step"
        ),
        f"- tiertrain: memory.host_mib = {args.host_mib}, update.mode = overlap"
        + (" and engines" if "engines" in runs else "")
        + "; speculating, the states take "
        f"{runs['speculate'][0]['space']}",
        "",
        "| system | s/step (per round) | vs floor | forward / backward / update s | read / written GB per step "
        "| predicted s/step (measured / predicted) | losses |",
        "|---|---|---|---|---|---|---|",
        f"| plain PyTorch, in memory | {p_step:.2f} | {p_step / floor:.2f}x | | 0 / 0 | | "
        + " ".join(f"{x:.4f}" for x in plain["losses"])
        + " |",
    ]
    for k in runs:
        r0 = runs[k][0]
        lines.append(
            f"| tiertrain {k} | {t[k]:.2f} ({', '.join(map(str, spread[k]))}) | **{t[k] / floor:.2f}x** | "
            + " / ".join(f"{phase(k, i):.2f}" for i in range(3))
            + f" | {med(k, 'read') / 1e9:.2f} / {med(k, 'write') / 1e9:.2f} | "
            + ", ".join(
                f"{r['predicted']:.2f} ({statistics.median(steady(r['times'])) / r['predicted']:.2f}x)" for r in runs[k]
            )
            + " | "
            + " ".join(f"{x:.4f}" for x in r0["losses"])
            + " |"
        )
    lines += [
        "",
        f"- floor: max(plain's step {p_step:.2f} s, the overlapped step's bytes at the disk's rate {io_s:.2f} s) = "
        f"{floor:.2f} s",
        "- the cost model's disk rates, probed at each run's start (read / write GB/s): "
        + "; ".join(
            f"{k} " + ", ".join(f"{r['probed'][0]:.2f} / {r['probed'][1]:.2f}" for r in runs[k] if r.get("probed"))
            for k in runs
        ),
        f"- the clip acted in {acted} of {len(plain['norms'])} plain PyTorch steps; tiertrain: "
        + "; ".join(f"round {i + 1}: {r['speculation']}" for i, r in enumerate(runs["speculate"])),
        f"- speculative / overlapped: {t['speculate'] / t['overlap']:.2f}x ({t['overlap'] - t['speculate']:+.2f} s a "
        "step; the overlapped path's update runs under the next forward, which waits for each unit's: its forward "
        f"{phase('overlap', 0):.2f} s against {phase('speculate', 0):.2f} s speculating)",
        *(
            [
                f"- engines speculating / engines: {t['engines speculating'] / t['engines']:.2f}x "
                f"({t['engines'] - t['engines speculating']:+.2f} s a step); speculating / overlapped speculating: "
                f"{t['engines speculating'] / t['speculate']:.2f}x; "
                + "; ".join(f"round {i + 1}: {r['speculation']}" for i, r in enumerate(runs["engines speculating"]))
            ]
            if "engines" in runs
            else []
        ),
        f"- losses: tiertrain's variants {'identical' if same else 'DIFFER'} across runs"
        + ("" if same else f" (from the overlapped round 1, largest relative difference: {', '.join(differ)})")
        + (
            "; a budget too short for whole vocabulary units has the planner cut them in pieces, whose "
            "cross-entropy differs by rounding (stated at start: losses within 1e-5 relative)"
            if any(r.get("pieces") for k in runs for r in runs[k])
            else ""
        )
        + "; against plain PyTorch: "
        + "largest relative difference "
        + f"{max(abs(a - b) / abs(a) for a, b in zip(plain['losses'], runs['overlap'][0]['losses'])):.1e}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("finetune", "clip"), default="finetune")
    ap.add_argument("--model", default="", help="model fields to change (default: the 134 M Llama of vs_plain.py)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--engines", action="store_true", help="also the update engines, without and with speculation")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--host-mib", type=int, default=1024, help="tiertrain's memory.host_mib (states beyond it on disk)")
    ap.add_argument("--lr", type=float, default=None, help="default: 1e-5 fine-tuning, 1e-3 clipping")
    ap.add_argument(
        "--clip",
        type=float,
        default=None,
        help="default: 8 fine-tuning (the clip rarely acts), 1e-3 clipping (it always does)",
    )
    ap.add_argument("--pretrain-steps", type=int, default=200)
    ap.add_argument("--pretrain-lr", type=float, default=1e-3)
    ap.add_argument("--io-mib", type=int, default=1024, help="size of the disk measurement for the floor")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="train.device of every run")
    ap.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="train.param_dtype of every run"
    )
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    fine = args.workload == "finetune"
    args.lr = args.lr if args.lr is not None else (1e-5 if fine else 1e-3)
    # 8 for fine-tuning: the 134 M model's gradient norm after pretraining is 1-5 (a clip of 1
    # acted in every step, on CPU in fp32 and on the H200 in bf16), under 8 in every step seen
    args.clip = args.clip if args.clip is not None else (8.0 if fine else 1e-3)
    out = checked_out(args.out) if args.out else None
    with scratch_dir(args.scratch, "speculate") as scratch:
        publish(run(args, scratch), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
