"""Training benchmark: a ~134M-parameter Llama-shaped model, fp32, states on SSD.

For each update path (--modes: baseline, overlap, engines, engines-ahead1g, engines-ahead2g, topk =
engines + top-k 0.05; see MODES) and each
number of micro-batches (--micro-batches, default 1 and 4) it measures, in one run:
- plain PyTorch with everything in RAM (same model, data, fused AdamW): the compute floor;
- the disk's sequential read and write bandwidth (tiertrain's storage tier, 1 GiB);
- tiertrain's step time, bytes read and written per step against the formula, and the
  step's floor: max(compute, bytes read / read bandwidth + bytes written / write bandwidth).

Usage: python bench/train.py [--steps 4] [--modes baseline,engines,topk] [--micro-batches 1,4]
                             [--checksums on,off] [--model n_layers=8,d_model=1024,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import shutil
import statistics
import sys
import time

import torch

from tiertrain.bench.io import run_io_bench
from tiertrain.bench.output import SCRATCH_HELP, checked_out, scratch_dir
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
from tiertrain.data import Corpus
from tiertrain.models import build_model, tensor_source
from tiertrain.reference import reference_model, weights_of
from tiertrain.training.trainer import Trainer
from tiertrain.update.adamw8bit import plain_optimizer

MODEL = dict(kind="llama", n_layers=12, d_model=768, n_heads=12, d_ff=2048, vocab_size=32000, max_seq_len=256)


MODES = {  # name: (label, update section, memory fields other than the defaults)
    "baseline": ("baseline", UpdateConfig(mode="baseline"), {}),
    # the one budget at its default (half the available memory): this model's states fit in it
    "budget": ("baseline, default memory budget", UpdateConfig(mode="baseline"), {"planned": True}),
    "overlap": ("overlap (update under the next forward)", UpdateConfig(mode="overlap"), {}),
    # no clipping: each unit is updated as its gradient arrives, under the backward
    "overlap-eager": ("overlap, eager (no clipping)", UpdateConfig(mode="overlap", eager=True), {"grad_clip": 0.0}),
    "engines": ("engines", UpdateConfig(mode="engines"), {}),  # no read-ahead (the default)
    "engines-ahead1g": ("engines, read-ahead 1 GiB", UpdateConfig(mode="engines"), {"engine_read_ahead_mib": 1024}),
    "engines-ahead2g": ("engines, read-ahead 2 GiB", UpdateConfig(mode="engines"), {"engine_read_ahead_mib": 2048}),
    "topk": ("engines + top-k 0.05", UpdateConfig(mode="engines", topk=0.05), {}),
    # activation policies within memory.keep_act_mib (see --keep-mib): the default keeps the blocks
    # the backward reaches first; these keep the first blocks, or none
    "baseline-keep-first": (
        "baseline, keep first blocks",
        UpdateConfig(mode="baseline"),
        {"activations": "keep-first"},
    ),
    "baseline-recompute": ("baseline, recompute all", UpdateConfig(mode="baseline"), {"activations": "recompute"}),
    # 8-bit optimizer states (bitsandbytes' AdamW8bit; plain PyTorch runs it too)
    "baseline-8bit": ("baseline, 8-bit states", UpdateConfig(mode="baseline"), {"optim": "adamw8bit"}),
    "overlap-8bit": ("overlap, 8-bit states", UpdateConfig(mode="overlap"), {"optim": "adamw8bit"}),
}


DEVICE = {"device": "cpu", "dtype": "float32"}  # --device / --dtype


def config(
    scratch: str,
    micro_batches: int,
    steps: int,
    mode: str = "baseline",
    checksum: bool = True,
    keep_mib: int | None = None,
) -> Config:
    _, update, memory = MODES[mode]
    # states on the storage tier, as DeepSpeed's (the budget would place this model in RAM)
    planned = memory.get("planned", False)
    clip = memory.get("grad_clip", OptimConfig().grad_clip)
    name = memory.get("optim", OptimConfig().name)
    memory = {k: v for k, v in memory.items() if k not in ("planned", "grad_clip", "optim")}
    memory = {
        **({} if planned else STATES_ON_STORAGE),
        **memory,
        **({"keep_act_mib": keep_mib} if keep_mib is not None else {}),
    }
    return Config(
        io=IOConfig(paths=[scratch], checksum=checksum),
        model=ModelConfig(**MODEL),
        data=DataConfig(seq_len=64, micro_batch_size=1, micro_batches=micro_batches),
        update=update,
        optim=OptimConfig(name=name, grad_clip=clip),
        memory=MemoryConfig(**memory),
        checkpoint=CheckpointConfig(at_end=False),
        train=TrainConfig(
            steps=steps,
            progress=False,
            run_dir=os.path.join(scratch, "run"),
            device=DEVICE["device"],
            param_dtype=DEVICE["dtype"],
        ),
    )


def plain_steps(cfg: Config, model: torch.nn.Module, in_place: bool = False) -> list[float]:
    """Step times of plain PyTorch with everything in (device) memory, on the same work
    (``in_place``: on ``model`` itself, not a copy: one model's memory less, for large ones)."""
    dev = torch.device("cuda" if DEVICE["device"] == "cuda" else "cpu")
    m = model if in_place and dev.type == "cpu" else copy.deepcopy(model)
    m = m.to(dev, getattr(torch, DEVICE["dtype"]))
    o = cfg.optim
    opt = plain_optimizer(o, m.parameters())  # torch's fused AdamW, or bitsandbytes' AdamW8bit
    corpus, M, times = Corpus(cfg.data), cfg.data.micro_batches, []
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        for x, y in corpus.batches(step):
            (m(x.to(dev), y.to(dev)) / M).backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def tiertrain_steps(cfg: Config, init: dict) -> tuple[list, Trainer, float]:
    """The steps' records, the trainer, and the cost model's step (s) as `tiertrain train`
    predicts it at start (nan where nothing was measured)."""
    skeleton, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    tr = Trainer(cfg, weights=tensor_source(skeleton, init))
    tr.initialize(progress=False)
    pred = tr.predict()
    recs = [tr.train_step() for _ in range(cfg.train.steps)]
    return recs, tr, pred.step_s if pred else float("nan")


def formula_bytes(tr: Trainer) -> tuple[int, int]:
    """Bytes per step by the cost model (docs/DESIGN.md) for this run's placement, slot hits and
    kept graphs (tiertrain.cost.step_traffic: in the trainer or in the engines)."""
    from tiertrain.cost import run_traffic

    t = run_traffic(tr)
    return t.read, t.write


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4, help="steps per configuration (the first is warm-up)")
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default="baseline", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--micro-batches", default="1,4")
    ap.add_argument("--checksums", default="on", help="'on', 'off' or 'on,off' (CRC32C of every block on disk)")
    ap.add_argument(
        "--keep-mib", type=int, default=None, help="memory.keep_act_mib for every row (default: the config's)"
    )
    ap.add_argument("--io-gib", type=float, default=1.0, help="GiB written and read to measure the disk")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameters' dtype")
    ap.add_argument(
        "--model",
        default="",
        help="model fields to change, e.g. n_layers=8,d_model=1024,n_heads=16 "
        "(figures are to be checked on shapes other than the default)",
    )
    args = ap.parse_args()
    DEVICE.update(device=args.device, dtype=args.dtype)
    for kv in filter(None, args.model.split(",")):
        k, _, v = kv.partition("=")
        if k not in MODEL:
            ap.error(f"--model: unknown field {k!r}; fields: {', '.join(MODEL)}")
        MODEL[k] = type(MODEL[k])(v)
    checksums = [{"on": True, "off": False}[x] for x in args.checksums.split(",")]
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    mbs = [int(x) for x in args.micro_batches.split(",")]
    if args.out:  # before the work, not after
        args.out = checked_out(args.out)
    with scratch_dir(args.scratch, "bench-train") as args.scratch:  # measure() empties it between rows
        rows, rbw, wbw, init = run(args, mbs, modes, checksums)
    report = render(rows, rbw, wbw, n_params(init), args.steps, args.keep_mib)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


def run(args, mbs: list[int], modes: list[str], checksums: list[bool]):
    """Every row: (rows, read and write bandwidth in B/s, initial weights)."""
    torch.manual_seed(0)
    base_cfg = config(args.scratch, 4, args.steps)
    ref = reference_model(base_cfg)
    init = weights_of(ref)
    io = run_io_bench([args.scratch], size_bytes=int(args.io_gib * 2**30), repeats=2, use_fio=False, progress=False)
    rbw, wbw = io.median("ours", "read") * 1e9, io.median("ours", "write") * 1e9
    rows = []
    for M in mbs:  # one M and one optimizer: plain PyTorch trains the reference itself (init holds the weights)
        plain = {}
        optims = {config(args.scratch, M, args.steps, mode).optim.name: mode for mode in modes}
        for name, mode in optims.items():  # its optimizer's own (AdamW8bit's kernels are not fused AdamW's)
            cfg = config(args.scratch, M, args.steps, mode)
            # in place with one M: the reference trained on by the next optimizer's rows is only timed
            plain[name] = statistics.median(plain_steps(cfg, ref, in_place=len(mbs) == 1)[1:])
        for ck in checksums:
            for mode in modes:
                name = config(args.scratch, M, args.steps, mode).optim.name
                rows.append(measure(args, mode, M, plain[name], init, rbw, wbw, ck))
    return rows, rbw, wbw, init


def n_params(init: dict) -> int:
    return sum(t.numel() for t in init.values())


def measure(args, mode: str, M: int, plain: float, init: dict, rbw: float, wbw: float, checksum: bool = True):
    """One configuration: median step figures after a warm-up step."""
    cfg = config(args.scratch, M, args.steps, mode, checksum, args.keep_mib)
    recs, tr, predicted = tiertrain_steps(cfg, init)
    recomputed = tr.executor.recomputed
    steady = recs[1:]
    step = statistics.median(r.step_s for r in steady)
    eng = lambda r, k: r.extra.get(k, 0)  # noqa: E731
    rb = statistics.median(r.ssd_read_bytes + eng(r, "engine_read_bytes") for r in steady)
    wb = statistics.median(r.ssd_write_bytes + eng(r, "engine_write_bytes") for r in steady)
    sent = statistics.median(eng(r, "engine_sent_bytes") for r in steady)
    handed = statistics.median(eng(r, "engine_handoff_bytes") for r in steady)
    fr, fw = formula_bytes(tr)
    io_floor = rb / rbw + wb / wbw
    floor = max(plain, io_floor)
    parts = {
        k: statistics.median(getattr(r, k) for r in steady)
        for k in ("forward_s", "backward_s", "update_s", "io_wait_s")
    }
    tokens = steady[0].tokens
    pools = sum(tr.pool_bytes.values())
    engines_rss = max(eng(r, "engine_peak_host_bytes") for r in recs)
    engines_cpu = statistics.median(eng(r, "engine_cpu_s") for r in steady)
    tr.close()
    shutil.rmtree(args.scratch, ignore_errors=True)
    os.makedirs(args.scratch, exist_ok=True)
    label = MODES[mode][0] + ("" if checksum else ", no checksums")
    print(
        f"{label} M={M}: {step:.2f} s/step, plain {plain:.2f} s, floor {floor:.2f} s ({step / floor:.2f}x),"
        f" {recomputed} block recomputes",
        flush=True,
    )
    return (
        mode,
        checksum,
        M,
        tokens,
        plain,
        step,
        rb,
        fr,
        wb,
        fw,
        io_floor,
        floor,
        parts,
        sent,
        handed,
        pools,
        engines_rss,
        engines_cpu,
        recomputed,
        predicted,
    )


def render(rows, rbw, wbw, n_params, steps, keep_mib: int | None = None) -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [
        f"# Training benchmark: update paths, {time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()},"
        f" {torch.cuda.get_device_name(0) if DEVICE['device'] == 'cuda' else 'no GPU'};"
        f" torch {torch.__version__}",
        f"- model: Llama-shaped, {n_params / 1e6:.1f} M parameters (d {MODEL['d_model']}, {MODEL['n_layers']} layers, vocab {MODEL['vocab_size']}),"
        f" {DEVICE['dtype']} on {DEVICE['device']};"
        " seq 64, micro-batch 1; states on the local disk (CRC32C checksums on unless the row says no);"
        " memory defaults"
        " (3 device slots, 256 MiB of gradients and 256 MiB of hidden states in RAM, the rest on disk,"
        f" {keep_mib if keep_mib is not None else 512} MiB of kept autograd graphs, no engine read-ahead)"
        " unless the row says otherwise",
        f"- disk measured in the same run: read {rbw / 1e9:.2f} GB/s, write {wbw / 1e9:.2f} GB/s (O_DIRECT)",
        f"- {steps} steps per configuration, the first discarded; medians",
        "",
        "| update path | M | tokens/step | plain PyTorch in RAM s/step | tiertrain s/step | vs baseline |"
        " read GB/step (formula) | write GB/step (formula) | GB to engines | GB from engines in memory |"
        " I/O floor s | floor s | tiertrain / floor | fwd / bwd / update / io-wait s |"
        " trainer pools GiB | engines' peak RSS GiB | engines' CPU s/step | block recomputes/step |"
        " predicted s/step (measured / predicted) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(M, ck): step for mode, ck, M, _, _, step, *_ in rows if mode == "baseline"}
    for (
        mode,
        ck,
        M,
        tokens,
        plain,
        step,
        rb,
        fr,
        wb,
        fw,
        io_floor,
        floor,
        p,
        sent,
        handed,
        pools,
        ers,
        ecpu,
        rec,
        predicted,
    ) in rows:
        if mode == "baseline":
            speed = (
                f"1.00x (at most {step / (step - p['update_s']):.2f}x with the update hidden;"
                f" 1.5x needs {step / 1.5:.2f} s, {step / 1.5 / floor:.2f}x the floor)"
            )
        else:
            speed = f"{base[M, ck] / step:.2f}x" if (M, ck) in base else "-"
        label = MODES[mode][0] + ("" if ck else ", no checksums")
        lines.append(
            f"| {label} | {M} | {tokens} | {plain:.2f} | {step:.2f} | {speed} | {rb / 1e9:.2f} ({fr / 1e9:.2f}) |"
            f" {wb / 1e9:.2f} ({fw / 1e9:.2f}) | {sent / 1e9:.2f} | {handed / 1e9:.2f} | {io_floor:.2f} | {floor:.2f} | {step / floor:.2f} |"
            f" {p['forward_s']:.2f} / {p['backward_s']:.2f} / {p['update_s']:.2f} / {p['io_wait_s']:.2f} |"
            f" {pools / 2**30:.2f} | {ers / 2**30:.2f} | {ecpu:.2f} | {rec} |"
            f" {predicted:.2f} ({step / predicted:.2f}x) |"
        )
    lines += [
        "",
        f"Formula (docs/DESIGN.md; {DEVICE['dtype']} parameters, fp32 master and moments): parameters are read"
        " twice (forward, backward), then the",
        "update reads parameters, gradients (the part not kept in RAM) and both moments and writes them",
        "back. Measured reads are lower: units still resident in a slot from the end of the forward are",
        "not fetched again for the backward, and with engines the forward gets the units the engines",
        "were still updating straight from them, in shared memory (GB from engines in memory), instead",
        "of from their files. Engines' bytes include the gradients they spill to disk and read back.",
        "Blocks' autograd graphs are kept from the forward within memory.keep_act_mib (default 512 MiB,",
        "or --keep-mib), chosen by memory.activations; the others are recomputed in the backward",
        "(block recomputes/step). The floor is max(plain in-RAM compute,",
        "bytes read / read bandwidth + bytes written / write bandwidth): reads and writes taken in turn;",
        "a drive that serves both at once can beat it (tiertrain / floor under 1.00).",
        "",
        "The baseline row's bound: its step over its step without the update phase, the speed-up an",
        "update path would reach if its update cost nothing at all (no CPU, no disk time taken from",
        f"the forward and backward). Engines run on the same {os.cpu_count()} cores and the same disk here, so they",
        "stay below it unless they also shorten the forward or backward. Trainer pools: the trainer's fixed buffers (slots, gradient buffers, stash,",
        "update sets, bounce and checkpoint buffers); the engines' peak RSS is whole processes",
        "(interpreter and torch included), summed over the engines; their read-ahead is",
        "memory.engine_read_ahead_mib (default 0, never more than their state). Engines' CPU: CPU",
        "seconds of the engine processes (all threads) per step, taken from the cores the",
        "trainer computes on. Predicted: the cost model's step from the rates it probed at start, as",
        "`tiertrain train` prints it (docs/DESIGN.md).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
