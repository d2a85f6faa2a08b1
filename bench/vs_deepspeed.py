"""tiertrain vs DeepSpeed ZeRO-Infinity (ZeRO-3, parameters and optimizer on NVMe), same run.

Both systems train the same Llama-shaped model (~134 M parameters, fp32 on CPU) from the same
initial weights on the same batches (seq 64, micro-batch 1, M micro-batches per step), with
the same AdamW hyperparameters, constant learning rate and clipping at 1.0, with every state
in the same scratch folder. Each run is its own process; runs alternate (A B C D A B C D ...).
Per system: median step time and spread, tokens/s, peak RSS during training, disk bytes read
and written per step (both from /proc/<pid>/io, engines included), and the loss per step.

DeepSpeed is an optional benchmark dependency (``pip install -e .[bench]`` and
``apt-get install libaio-dev``); ``--ds-python`` points at another interpreter that has it.
Its ops compile on first use (minutes; cached in ~/.cache/torch_extensions).

On a GPU (``--device cuda --dtype bfloat16``) both compute there: tiertrain with bf16
parameters and fp32 master and moments on the storage tier, DeepSpeed with ``bf16`` on and
NCCL; states stay on the NVMe for both.

Usage: python bench/vs_deepspeed.py [--steps 5] [--rounds 2] [--micro-batches 4]
                                    [--systems deepspeed,baseline,overlap,engines,topk] [--out FILE]
                                    [--device cpu|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from deepspeed_worker import ProcMeter  # noqa: E402

from tiertrain.bench.output import SCRATCH_HELP, checked_out, scratch_dir  # noqa: E402

MODEL = dict(kind="llama", n_layers=12, d_model=768, n_heads=12, d_ff=2048, vocab_size=32000, max_seq_len=256)
OPTIM = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)
SYSTEMS = {  # label, tiertrain update settings (None: DeepSpeed), exact math?
    "deepspeed": ("DeepSpeed ZeRO-Infinity (ZeRO-3, NVMe)", None, True),
    "baseline": ("tiertrain, baseline update path", {"mode": "baseline"}, True),
    "overlap": ("tiertrain, overlapped update", {"mode": "overlap"}, True),
    "engines": ("tiertrain, update engines", {"mode": "engines"}, True),
    "topk": ("tiertrain, engines + top-k 0.05 (changes the math)", {"mode": "engines", "topk": 0.05}, False),
    "plain": ("plain PyTorch, all in RAM (the compute floor)", "plain", True),
}


def tiertrain_config(work: str, spec: dict, update: dict):
    from tiertrain.config import (
        CheckpointConfig,
        Config,
        DataConfig,
        IOConfig,
        MemoryConfig,
        ModelConfig,
        OptimConfig,
        TrainConfig,
        UpdateConfig,
    )
    from tiertrain.cost.budget import STATES_ON_STORAGE

    return Config(
        io=IOConfig(paths=[os.path.join(work, "tt-ssd")]),
        model=ModelConfig(kind="llama", hf_dir=spec["init_dir"]),
        data=DataConfig(
            seq_len=spec["seq_len"], micro_batch_size=spec["micro_batch_size"], micro_batches=spec["micro_batches"]
        ),
        optim=OptimConfig(**OPTIM, warmup_steps=0, schedule="constant"),
        update=UpdateConfig(**update),
        # states on NVMe, as DeepSpeed's; or the one budget (--host-mib), placed by the planner
        memory=MemoryConfig(host_mib=spec["host_mib"]) if spec.get("host_mib") else MemoryConfig(**STATES_ON_STORAGE),
        checkpoint=CheckpointConfig(at_end=False),
        train=TrainConfig(
            steps=spec["steps"],
            progress=False,
            run_dir=os.path.join(work, "tt-run"),
            device=spec.get("device", "cpu"),
            param_dtype=spec.get("dtype", "float32"),
        ),
    )


def tiertrain_worker(work: str, spec: dict, update: dict) -> None:
    """The tiertrain side: one JSON line per step, measured like the DeepSpeed side."""
    from tiertrain.training.trainer import Trainer

    meter = ProcMeter()
    t0 = time.perf_counter()
    tr = Trainer(tiertrain_config(work, spec, update))
    tr.initialize(progress=False)
    print(json.dumps(dict(event="ready", init_s=time.perf_counter() - t0, init_peak_rss=meter.peak_rss())), flush=True)
    pred = tr.predict()  # its probe (a few seconds) before the steps, off their clock
    if pred is not None:
        print(json.dumps(prediction_event(pred)), flush=True)
    meter.reset_peak()
    for step in range(spec["steps"]):
        io0, s0 = meter.io(), time.perf_counter()
        # with engines or overlap, step k's time holds update k-1 (run under its forward), so every step
        # measured counts one update; the last update, finished after the loop, is not counted
        rec = tr.train_step()
        io1 = meter.io()
        print(
            json.dumps(
                dict(
                    event="step",
                    step=rec.step,
                    step_s=time.perf_counter() - s0,
                    loss=rec.loss,
                    read_bytes=io1[0] - io0[0],
                    write_bytes=io1[1] - io0[1],
                    peak_rss=meter.peak_rss(),
                )
            ),
            flush=True,
        )
    tr.close()


def prediction_event(pred) -> dict:
    """The cost model's view of the run, for the report's bound: each phase's compute and I/O,
    the update's bytes and the storage rates probed in this process."""
    t, r = pred.traffic, pred.rates
    return dict(
        event="prediction",
        step_s=pred.step_s,
        update_read=t.update_read,
        update_write=t.update_write,
        read_gbps=r.read_gbps,
        write_gbps=r.write_gbps,
        phases={p.name.split(" ")[0]: dict(compute_s=p.compute_s, io_s=p.io_s) for p in pred.phases},
    )


def plain_worker(spec: dict) -> None:
    """Plain PyTorch: the same model, batches and AdamW, every state in RAM (fused AdamW, clipping
    as the others): what no offloaded system computes faster, measured like them."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    meter = ProcMeter()
    t0 = time.perf_counter()
    dev = "cuda" if spec.get("device") == "cuda" else "cpu"
    model = LlamaForCausalLM.from_pretrained(spec["init_dir"], dtype=torch.float32).to(dev)  # fp32: the reference
    model.config.use_cache = False
    o, M = spec["optim"], spec["micro_batches"]
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o["lr"],
        betas=(o["beta1"], o["beta2"]),
        eps=o["eps"],
        weight_decay=o["weight_decay"],
        fused=True,
    )
    batches = load_file(spec["batches"])
    print(json.dumps(dict(event="ready", init_s=time.perf_counter() - t0, init_peak_rss=meter.peak_rss())), flush=True)
    meter.reset_peak()
    for step in range(spec["steps"]):
        io0, s0, losses = meter.io(), time.perf_counter(), []
        for m in range(M):
            x, y = batches[f"x{step}_{m}"].to(dev), batches[f"y{step}_{m}"].to(dev)
            loss = model(input_ids=x, labels=y, shift_labels=y).loss  # the same loss as the others'
            (loss / M).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        io1 = meter.io()
        print(
            json.dumps(
                dict(
                    event="step",
                    step=step + 1,
                    step_s=time.perf_counter() - s0,
                    loss=sum(losses) / M,
                    read_bytes=io1[0] - io0[0],
                    write_bytes=io1[1] - io0[1],
                    peak_rss=meter.peak_rss(),
                )
            ),
            flush=True,
        )


def prepare(work: str, args) -> dict:
    """Initial weights as a local HF directory (both systems load it) and the batches."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tiertrain.config import DataConfig, ModelConfig
    from tiertrain.data import Corpus
    from tiertrain.models import hf_config_from

    torch.manual_seed(0)
    init_dir = os.path.join(work, "init")
    AutoModelForCausalLM.from_config(hf_config_from(ModelConfig(**MODEL))).save_pretrained(init_dir)
    spec = dict(
        init_dir=init_dir,
        seq_len=64,
        micro_batch_size=1,
        micro_batches=args.micro_batches,
        steps=args.steps,
        optim=OPTIM,
        batches=os.path.join(work, "batches.safetensors"),
        device=args.device,
        dtype=args.dtype,
        host_mib=args.host_mib,
    )
    data = DataConfig(seq_len=64, micro_batch_size=1, micro_batches=args.micro_batches)
    corpus, tensors = Corpus(data), {}
    for step in range(args.steps):
        for m, (x, y) in enumerate(corpus.batches(step)):
            tensors[f"x{step}_{m}"], tensors[f"y{step}_{m}"] = x.clone(), y.clone()
    save_file(tensors, spec["batches"])
    spec["n_params"] = sum(t.numel() for t in load_file(os.path.join(init_dir, "model.safetensors")).values())
    return spec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def clear_stale_locks() -> None:
    """A DeepSpeed op build killed midway leaves a lock that makes the next build wait forever."""
    root = os.path.expanduser(os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions"))
    building = subprocess.run(["pgrep", "-f", "ninja|cc1plus"], capture_output=True).returncode == 0
    for dirpath, _, files in os.walk(root):
        if "lock" in files and not building:
            print(f"removing stale DeepSpeed build lock {os.path.join(dirpath, 'lock')} (no build is running)")
            os.remove(os.path.join(dirpath, "lock"))


def run_worker(cmd: list[str], env: dict, what: str) -> list[dict]:
    """Run one worker process, echo its progress, return its JSON events."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    events = []
    for line in proc.stdout:
        if line.startswith("{"):
            ev = json.loads(line)
            events.append(ev)
            if ev.get("event") == "step":
                print(f"  {what} step {ev['step']}: {ev['step_s']:.2f} s, loss {ev['loss']:.4f}", flush=True)
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{err[-4000:]}")
    return events


def ds_python(args) -> str:
    py = args.ds_python or sys.executable
    probe = subprocess.run([py, "-c", "import deepspeed"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(
            f"DeepSpeed is not importable by {py}: install it with `pip install -e .[bench]` "
            "(and `apt-get install libaio-dev`), or pass --ds-python PATH of an interpreter that has it"
        )
    return py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="steps per run; the first is warm-up and not counted")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (each runs every system once)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--systems", default="deepspeed,baseline,engines,topk")
    ap.add_argument(
        "--host-mib",
        type=int,
        default=None,
        help="tiertrain's memory.host_mib (the one budget; default: every state on the storage tier but "
        "for fixed host buffers)",
    )
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--ds-python", default=None, help="interpreter with DeepSpeed (default: this one)")
    ap.add_argument("--out", default=None, help="markdown report; a PNG plot and the raw events (JSON) go next to it")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both systems compute")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="parameter dtype of both (bfloat16: fp32 master weights and moments)",
    )
    ap.add_argument("--worker", nargs=2, metavar=("SYSTEM", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        system, spec_path = args.worker
        with open(spec_path) as f:
            spec = json.load(f)
        if system == "plain":
            plain_worker(spec)
        else:
            tiertrain_worker(os.path.dirname(spec_path), spec, SYSTEMS[system][1])
        return 0
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first step is warm-up)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if args.out:  # before the 20 minutes of work, not after
        args.out = checked_out(args.out)
    with scratch_dir(args.scratch, "vs-deepspeed") as work:
        return compare(args, systems, work)


def compare(args, systems: list[str], work: str) -> int:
    """Every system ``args.rounds`` times, alternating, in ``work``; the report."""
    spec = prepare(work, args)
    dspy = ds_python(args) if "deepspeed" in systems else None
    if dspy:
        clear_stale_locks()
        print("tuning DeepSpeed's aio on the scratch disk (first use compiles its ops: minutes)", flush=True)
        out = subprocess.run(
            [dspy, os.path.join(HERE, "deepspeed_worker.py"), "tune", work], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise SystemExit(f"DeepSpeed aio tuning failed:\n{out.stderr[-4000:]}")
        spec["aio_sweep"] = json.loads(out.stdout.strip().splitlines()[-1])
        spec["aio"] = spec["aio_sweep"]["best"]
        print(f"  aio: {spec['aio']}", flush=True)
    runs: dict[str, list[list[dict]]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for s in systems:
            print(f"round {r + 1}/{args.rounds}: {SYSTEMS[s][0]}", flush=True)
            runs[s].append(run_once(work, spec, s, dspy))
    report = render(runs, spec, environment(dspy))
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
        plot(runs, os.path.splitext(args.out)[0] + ".png")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:  # every event, to re-plot or re-check
            json.dump(dict(spec=spec, runs=runs), f)
    return 0


def run_once(work: str, spec: dict, system: str, dspy: str | None) -> list[dict]:
    """One run in a fresh process on fresh state files."""
    for d in ("ds-nvme", "tt-ssd", "tt-run"):
        shutil.rmtree(os.path.join(work, d), ignore_errors=True)
    spec = dict(spec, port=free_port())
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, DS_ACCELERATOR=spec.get("device", "cpu"), MASTER_PORT=str(spec["port"]))
    if system == "deepspeed":
        cmd = [dspy, os.path.join(HERE, "deepspeed_worker.py"), "train", work, spec_path]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, spec_path]
    return run_worker(cmd, env, system)


def steady(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("event") == "step"][1:]


def summary(runs: list[list[dict]]) -> dict:
    """Figures of one system over all its runs' steady steps (medians; spread = min..max)."""
    steps = [e for r in runs for e in steady(r)]
    times = [e["step_s"] for e in steps]
    last = [[e for e in r if e.get("event") == "step"][-1] for r in runs]
    preds = [e for r in runs for e in r if e.get("event") == "prediction"]
    return dict(
        pred=preds[0] if preds else None,
        step=statistics.median(times),
        lo=min(times),
        hi=max(times),
        read=statistics.median(e["read_bytes"] for e in steps),
        write=statistics.median(e["write_bytes"] for e in steps),
        rss=max(e["peak_rss"] for e in steps),
        loss=statistics.mean(e["loss"] for e in last),
        n=len(times),
    )


def render(runs: dict, spec: dict, env: dict) -> str:
    tokens = spec["seq_len"] * spec["micro_batch_size"] * spec["micro_batches"]
    figs = {s: summary(r) for s, r in runs.items()}
    ds = figs.get("deepspeed")
    lines = [
        f"# tiertrain vs DeepSpeed ZeRO-Infinity, {env['date']}",
        "",
        f"- machine: {env['cores']} cores, {env['ram_gib']:.0f} GiB RAM, {env.get('gpu', 'no GPU')}; {env['os']}",
        f"- versions: torch {env['torch']}" + (f", deepspeed {env['deepspeed']}" if "deepspeed" in env else ""),
        f"- work: Llama-shaped, {spec['n_params'] / 1e6:.0f} M parameters (d {MODEL['d_model']},"
        f" {MODEL['n_layers']} layers, ff {MODEL['d_ff']}, vocab {MODEL['vocab_size']}),"
        f" {spec.get('dtype', 'float32')} on {spec.get('device', 'cpu')};"
        f" seq {spec['seq_len']}, micro-batch {spec['micro_batch_size']}, {spec['micro_batches']} micro-batches"
        f" ({tokens} tokens) per step; AdamW lr {OPTIM['lr']} betas ({OPTIM['beta1']}, {OPTIM['beta2']})"
        f" eps {OPTIM['eps']} wd {OPTIM['weight_decay']}, constant lr, clip {OPTIM['grad_clip']};"
        " same initial weights and batches for every system",
        f"- {len(next(iter(runs.values())))} alternating rounds x {spec['steps']} steps; the first step of each run"
        " is warm-up; medians over the rest, spread = min..max",
        "- disk bytes from /proc/<pid>/io (read_bytes, write_bytes - cancelled) of the process and its children;"
        " peak RSS = VmHWM summed over them, reset after initialisation (shared pages counted once per process)",
    ]
    if "aio" in spec:
        a = spec["aio"]
        lines.append(
            f"- DeepSpeed: ZeRO-3, offload_param and offload_optimizer on nvme in the same folder, max_in_cpu 0,"
            f" pinned buffers; aio from a sweep of its own handle ({len(spec['aio_sweep']['sweep'])} settings):"
            f" block {a['block_size'] >> 10} KiB, queue depth {a['queue_depth']}, parallelism"
            f" {a['intra_op_parallelism']} (write {a['write_gbps']:.2f} GB/s, read {a['read_gbps']:.2f} GB/s)"
        )
    lines += [
        (
            f"- tiertrain: memory.host_mib = {spec['host_mib']} MiB (the one budget, placed by its planner; the interpreter "
            "and torch are not in it), the rest on disk"
            if spec.get("host_mib")
            else "- tiertrain: defaults (3 device slots, 256 MiB of gradients and 256 MiB of hidden states in RAM), states on disk"
        ),
        "",
        "| system | exact math | s/step (spread) | tokens/s | speed vs DeepSpeed | peak RSS GiB | RSS vs DeepSpeed |"
        " disk read GB/step | disk write GB/step | loss at step " + str(spec["steps"]) + " | loss - DeepSpeed's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, f in figs.items():
        label, _, exact = SYSTEMS[s]
        speed = f"{ds['step'] / f['step']:.2f}x" if ds else "-"
        rss = f"{f['rss'] / ds['rss']:.2f}" if ds else "-"
        gap = f"{f['loss'] - ds['loss']:+.1e}" if ds else "-"
        lines.append(
            f"| {label} | {'yes' if exact else 'no'} | {f['step']:.2f} ({f['lo']:.2f}..{f['hi']:.2f}) |"
            f" {tokens / f['step']:.0f} | {speed} | {f['rss'] / 2**30:.2f} | {rss} | {f['read'] / 1e9:.2f} |"
            f" {f['write'] / 1e9:.2f} | {f['loss']:.4f} | {gap} |"
        )
    lines += ["", *verdict(figs, spec), "", "Loss per step (first round):", ""]
    lines.append("| step | " + " | ".join(runs) + " |")
    lines.append("|---" * (len(runs) + 1) + "|")
    per = {s: [e["loss"] for e in r[0] if e.get("event") == "step"] for s, r in runs.items()}
    for i in range(spec["steps"]):
        lines.append(f"| {i + 1} | " + " | ".join(f"{per[s][i]:.4f}" for s in runs) + " |")
    return "\n".join(lines) + "\n"


def verdict(figs: dict, spec: dict | None = None) -> list[str]:
    """The issue's goal, computed: exact-math tiertrain >= 2x DeepSpeed's speed at <= half its RSS."""
    ds, plain = figs.get("deepspeed"), figs.get("plain")
    exact = [s for s in figs if s not in ("deepspeed", "plain") and SYSTEMS[s][2]]
    if not ds or not exact:
        return []
    best = min(exact, key=lambda s: figs[s]["step"])
    f = figs[best]
    speed, rss = ds["step"] / f["step"], f["rss"] / ds["rss"]
    met = speed >= 2 and rss <= 0.5
    out = [
        f"Goal (exact math, >= 2x DeepSpeed's speed at <= 0.5x its peak RSS): best exact tiertrain"
        f" ({SYSTEMS[best][0]}) is {speed:.2f}x as fast at {rss:.2f}x the RSS: {'met' if met else 'NOT met'}."
    ]
    if plain:  # what any exact system can reach here: plain PyTorch's in-RAM step, the same run
        four = ds["step"] / 4
        out.append(
            f"Against the compute floor: plain PyTorch in RAM takes {plain['step']:.2f} s/step at "
            f"{plain['rss'] / 2**30:.2f} GiB; 4x DeepSpeed would be {four:.2f} s/step, "
            + (
                "below plain PyTorch's own step: no exact system reaches it on this machine in this run"
                if four < plain["step"]
                else "at or above plain PyTorch's step: reachable in principle"
            )
            + f"; best exact tiertrain is {f['step'] / plain['step']:.2f}x plain's step at "
            f"{f['rss'] / plain['rss']:.2f}x its peak RSS."
        )
    if f.get("pred") and OPTIM["grad_clip"]:
        out.append(clipping_bound(f["pred"], ds["step"] / 4, (spec or {}).get("aio")))
    return out


def clipping_bound(pred: dict, four: float, aio: dict | None) -> str:
    """The least step any exact schedule has when gradients are clipped: the update needs the
    whole gradient's norm, so it starts when the backward ends, and the next backward starts
    when the next forward, which needs every updated unit, is done: the step holds the
    backward's compute and then the update's I/O, one after the other (reads and writes
    added: on one disk they do not overlap, see ``tiertrain bench io``'s mixed pass)."""
    bwd = pred["phases"]["backward"]["compute_s"]
    rd, wr = pred["update_read"], pred["update_write"]

    def least(read_gbps: float, write_gbps: float) -> float:
        return bwd + rd / (read_gbps * 1e9) + wr / (write_gbps * 1e9)

    here = least(pred["read_gbps"], pred["write_gbps"])
    text = (
        f"Bound with clipping: a step holds the backward's compute ({bwd:.2f} s, probed) and then the update's "
        f"I/O ({rd / 1e9:.2f} GB read, {wr / 1e9:.2f} GB written at this budget): at least {here:.2f} s at the "
        f"rates tiertrain probed in this run ({pred['read_gbps']:.2f} GB/s read, {pred['write_gbps']:.2f} write)"
    )
    best = here
    if aio:
        best = least(aio["read_gbps"], aio["write_gbps"])
        text += (
            f", {best:.2f} s at DeepSpeed's tuned aio rates ({aio['read_gbps']:.2f} read, "
            f"{aio['write_gbps']:.2f} write)"
        )
    if four < min(here, best):
        tail = "below the bound at every rate measured: no exact schedule of these bytes reaches it at this budget here"
    elif four < max(here, best):
        tail = (
            "below the bound at one of the rates measured: reachable only at the disk's best rates, with "
            "nothing else taking time"
        )
    else:
        tail = "above the bound: reachable in principle"
    return text + f". 4x DeepSpeed ({four:.2f} s/step) is {tail}."


def plot(runs: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (s, rs) in enumerate(runs.items()):
        times = [e["step_s"] for r in rs for e in steady(r)]
        a.scatter([i] * len(times), times, s=14)
        a.hlines(statistics.median(times), i - 0.3, i + 0.3)
        first = [e for e in rs[0] if e.get("event") == "step"]
        b.plot([e["step"] for e in first], [e["loss"] for e in first], marker="o", label=SYSTEMS[s][0])
    a.set_xticks(range(len(runs)), list(runs), rotation=15)
    a.set_ylabel("s / step (steady steps, all rounds; line = median)")
    a.set_ylim(bottom=0)
    b.set_xlabel("step")
    b.xaxis.get_major_locator().set_params(integer=True)
    b.set_ylabel("loss")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def environment(dspy: str | None) -> dict:
    import torch

    env = dict(
        cores=os.cpu_count(),
        ram_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        os=f"{platform.system()} {platform.release()}",
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
    )
    if torch.cuda.is_available():
        env["gpu"] = f"GPU {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    if dspy:
        env["deepspeed"] = (
            subprocess.run(
                [dspy, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True, text=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
    return env


if __name__ == "__main__":
    sys.exit(main())
