"""Where the GPU is the bound (issue 52): tiertrain against plain PyTorch in device memory, in
TFLOPS and tokens/s, at the tokens a step that `tiertrain plan` names as compute-bound.

The model: a transformers config of a dense family at a named shape (``qwen2.5-3b``,
``llama3-8b``) or ``LAYERSxWIDTH`` (a Llama), random weights written once by the reference's
initialisation and read by both systems. Each system runs in a process of its own:

1. ``plan``: `tiertrain plan` at the run's settings; its knee line gives the micro-batches from
   which the step is compute-bound (``--micro-batches auto``) and what bounds it below;
2. ``plain``: plain PyTorch with the whole model in device memory: bf16 compute with fp32 master
   weights and fused AdamW moments on the device (the math tiertrain's bf16 runs keep, and its
   parity tests' reference), HF's activation checkpointing where ``--checkpointing`` asks for it
   (``auto``: when the micro-batch's activations would not fit beside the states). Skipped with
   ``--plain off``, or where the states alone do not fit the device (said);
3. ``tiertrain``: the same weights (``model.init_from``), data and optimizer within
   ``--host-mib`` of host memory (default: tiertrain's default budget), the rest on the drive.

TFLOPS are the model's FLOPs a token (``tiertrain.training.metrics.flops_per_token``; for
these dense models trained whole: 6 per weight a token multiplies through, plus attention's 12 x
layers x hidden x sequence, PaLM's accounting without halving for the causal mask) times tokens/s. Reported: each system's
s/step, tokens/s and TFLOPS, tiertrain's tokens/s over plain's, its phases and the cost model's
prediction against the measured step, and the losses of both step by step (bf16: within the
tolerance the parity tests state).

Usage: python bench/compute_bound.py [--shape qwen2.5-3b] [--seq-len 2048] [--micro-batches auto]
                                     [--device cuda] [--host-mib N] [--steps 4] [--plain auto|off]
                                     [--checkpointing auto|on|off] [--scratch DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vs_plain  # noqa: E402

# transformers config fields of the named shapes (their published configs' sizes)
SHAPES = {
    "qwen2.5-3b": dict(
        family="qwen2", layers=36, hidden=2048, ff=11008, heads=16, kv_heads=2, vocab=151936, tie=True, theta=1e6
    ),
    "llama3-8b": dict(
        family="llama", layers=32, hidden=4096, ff=14336, heads=32, kv_heads=8, vocab=128256, tie=False, theta=5e5
    ),
}


def shape_of(name: str) -> dict:
    """A named shape, or ``[FAMILY:]LAYERSxWIDTH``: a Llama (or, ``qwen2:``, a Qwen2 with its
    embedding tied, as the small Qwen2.5 are) of that depth and width (heads of 128, or of 32
    below 512 wide; GQA 4:1; an MLP of 8/3 the width rounded up to 64; a 32,000 vocabulary)."""
    if name in SHAPES:
        return dict(SHAPES[name])
    m = re.fullmatch(r"(?:(llama|qwen2):)?(\d+)x(\d+)", name)
    if not m:
        raise SystemExit(
            f"--shape {name!r}: one of {', '.join(SHAPES)} or [FAMILY:]LAYERSxWIDTH (e.g. 24x2048, qwen2:2x256)"
        )
    family = m.group(1) or "llama"
    m = re.fullmatch(r"(\d+)x(\d+)", name.rpartition(":")[2])
    layers, hidden = int(m.group(1)), int(m.group(2))
    heads = max(1, hidden // (128 if hidden >= 512 else 32))
    ff = -(-8 * hidden // 3 // 64) * 64
    return dict(
        family=family, layers=layers, hidden=hidden, ff=ff, heads=heads, kv_heads=max(1, heads // 4), vocab=32000,
        tie=family == "qwen2", theta=5e5,
    )  # fmt: skip


def write_config(shape: dict, seq_len: int, directory: str) -> None:
    import transformers as t

    s = shape
    cls = {"qwen2": t.Qwen2Config, "llama": t.LlamaConfig}[s["family"]]
    cfg = cls(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["ff"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=max(seq_len, 128),
        rope_theta=s["theta"],
        tie_word_embeddings=s["tie"],
    )
    cfg.save_pretrained(directory)


def worker_plain(cfg, path: str, checkpointing: str) -> dict:
    """Plain PyTorch in device memory: the reference's mixed precision (bf16 model, fp32 master
    weights and fused AdamW on them), or fp32 where tiertrain computes in fp32."""
    import gc

    import torch

    from tiertrain.data import Corpus
    from tiertrain.device import resolve_device, resolve_dtype
    from tiertrain.reference import HFWrapper, reference_model

    dev = resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.train.param_dtype, dev)
    model = reference_model(cfg)
    inner = model.hf if isinstance(model, HFWrapper) else model
    vs_plain.load_into(inner, path)
    model.to(dev)  # fp32 on the device: the master weights, then the bf16 model beside them
    params = list(model.parameters())
    master = [p.detach().clone() for p in params] if dtype != torch.float32 else params
    model.to(dtype)
    o = cfg.optim
    opt = torch.optim.AdamW(
        master, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
    )
    step = lambda s: _plain_step(model, params, master, opt, corpus, cfg, s, dev)  # noqa: E731
    corpus, times, losses, used = Corpus(cfg.data), [], [], checkpointing == "on"
    if used:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for s in range(cfg.train.steps):
        t0 = time.perf_counter()
        oom = False
        try:
            losses.append(step(s))
        except torch.OutOfMemoryError:
            if s > 0 or used or checkpointing != "auto":
                raise
            oom = True  # retried below, out of this block: its traceback holds the step's graph
        if oom:  # auto: tried without first; the activations did not fit beside the states
            opt.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            used = True
            print("plain: out of device memory without activation checkpointing: with it", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            losses.append(step(s))
        times.append(time.perf_counter() - t0)
        print(f"plain step {s + 1}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    return {"times": times, "losses": losses, "peak_device": peak, "checkpointing": used}


def _plain_step(model, params, master, opt, corpus, cfg, step: int, dev) -> float:
    """One step of plain PyTorch (micro-batch-major accumulation, then the reference's update:
    clipping, fused AdamW on the fp32 master weights where they are kept); its mean loss. Ends
    at a sync point: the step's kernels have run."""
    import torch

    from tiertrain.reference import optimizer_step

    M = cfg.data.micro_batches
    ls = []
    for x, y in corpus.batches(step):
        loss = model(x.to(dev), y.to(dev))
        (loss / M).backward()
        ls.append(loss.detach())
    optimizer_step(opt, params, master, cfg.optim, step, cfg.train.steps, mixed=master is not params)
    loss = float(sum(ls)) / M  # sync point: the step's kernels have run
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return loss


def worker_tiertrain(cfg) -> dict:
    from tiertrain.cost.report import knee
    from tiertrain.training.metrics import flops_per_token

    def more(tr, recs, pred) -> dict:
        return {
            "flops_per_token": flops_per_token(tr.model, cfg.data.seq_len, tr.rt.hidden_size),
            "knee": knee(tr.cfg, tr.rt, pred) if pred else "",
            "tokens": recs[-1].tokens,
            "peak_device": max(r.peak_device_bytes for r in recs),
            "mfu": [r.mfu for r in recs],
        }

    return vs_plain.worker_tiertrain(cfg, more)


def worker(argv: list[str]) -> int:
    kind, out, path, checkpointing, *cli = argv
    from tiertrain.config import load_config

    cfg = load_config(None, cli)
    res = {
        "init": lambda: vs_plain.worker_init(cfg, path, "cuda" if cfg.train.device == "cuda" else "cpu"),
        "plain": lambda: worker_plain(cfg, path, checkpointing),
        "tiertrain": lambda: worker_tiertrain(cfg),
    }[kind]()
    return vs_plain.finish_worker(out, res)


def spawn(kind: str, scratch: str, cli: list[str], checkpointing: str = "off") -> dict:
    return vs_plain.spawn(kind, scratch, cli, script=__file__, extra=[checkpointing])


KNEE = re.compile(r"compute-bound from ([\d,]+) tokens a step \((\d+) micro-batches")


def plan(cli: list[str]) -> tuple[str, int | None]:
    """`tiertrain plan` at these settings: its knee line, and the micro-batches it names (None:
    this run's are already compute-bound, or none up to the most it tries)."""
    r = subprocess.run(
        [sys.executable, "-m", "tiertrain", "plan", "--probe-mib=64", *cli], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        raise SystemExit(f"tiertrain plan failed:\n{r.stderr[-3000:]}")
    line = next((ln for ln in r.stdout.splitlines() if "compute-bound" in ln), "")
    m = KNEE.search(line)
    return line, int(m.group(2)) if m else None


def run(args, scratch: str) -> str:
    shape = shape_of(args.shape)
    hf = os.path.join(scratch, "config")
    write_config(shape, args.seq_len, hf)
    base = [
        f"--model.hf_dir={hf}",
        "--model.from_scratch=true",
        f"--model.max_seq_len={args.seq_len}",
        f"--data.seq_len={args.seq_len}",
        f"--data.micro_batch_size={args.micro_batch_size}",
        f"--train.device={args.device}",
        "--train.progress=false",
        f"--io.paths={scratch}/ssd",
        f"--train.run_dir={scratch}/run",
        "--checkpoint.at_end=false",
        *([f"--memory.host_mib={args.host_mib}"] if args.host_mib else []),
        *[f"--{x}" for x in args.set],
    ]
    os.makedirs(f"{scratch}/ssd")
    said, m = plan([*base, "--data.micro_batches=1"])
    M = (m or 1) if args.micro_batches == "auto" else int(args.micro_batches)
    cli = [*base, f"--data.micro_batches={M}", f"--train.steps={args.steps}"]
    n = params_of(shape)
    need = n * 20  # plain's states: bf16 weights and gradients, fp32 master, its gradient and two moments
    room = _device_bytes(args.device)
    plain, init = None, {"params": n}
    why = "--plain off" if args.plain == "off" else ""
    if not why and room and need > room:
        why = f"its states alone ({need / 2**30:.0f} GiB) exceed the device's {room / 2**30:.0f} GiB"
    if not why:  # the same weights for both, written once (fp32)
        init = spawn("init", scratch, cli)
        plain = spawn("plain", scratch, cli, args.checkpointing)
        cli = [*cli, f"--model.init_from={scratch}/init.safetensors"]
    tt = spawn("tiertrain", scratch, cli)  # alone: its own random weights (model.from_scratch), no file
    also = [(x, spawn("tiertrain", scratch, [*cli, f"--{x}"])) for x in args.also]  # the same run, one more setting
    return report(args, shape, M, said, init, plain, tt, why, also)


def params_of(shape: dict) -> int:
    """The parameters of ``shape`` (attention with grouped keys and values, a gated MLP, two
    norms a layer, the embedding and, untied, the head)."""
    h, f, L, v = shape["hidden"], shape["ff"], shape["layers"], shape["vocab"]
    kv = h // shape["heads"] * shape["kv_heads"]
    bias = 2 * kv + h if shape["family"] == "qwen2" else 0  # Qwen2's q, k and v biases
    layer = 2 * h * h + 2 * h * kv + bias + 3 * h * f + 2 * h
    return L * layer + h + v * h * (1 if shape["tie"] else 2)


def _device_bytes(device: str) -> int:
    """The device's memory (0: not a CUDA device: plain runs in host memory). Asked in a child:
    a CUDA context in this process would hold device memory through the runs."""
    if device == "cpu":
        return 0
    ask = "import torch; print(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0)"
    r = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=False)
    return int(r.stdout.strip() or 0) if r.returncode == 0 else 0


def report(args, shape: dict, M: int, said: str, init: dict, plain: dict | None, tt: dict, why: str, also=()) -> str:
    med = lambda xs: statistics.median(xs[1:]) if len(xs) > 1 else xs[0]  # noqa: E731
    tokens = tt["tokens"]
    fpt = tt["flops_per_token"]
    t_step = med(tt["times"])
    rows = ["| system | s/step | tokens/s | TFLOPS | vs plain (tokens/s) | peak device GiB | peak RSS GiB | losses |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def row(name: str, r: dict, step: float, ratio: str) -> str:
        return (
            f"| {name} | {step:.3f} | {tokens / step:,.0f} | {fpt * tokens / step / 1e12:.1f} | {ratio} | "
            f"{r['peak_device'] / 2**30:.1f} | {r['peak_rss'] / 2**30:.1f} | "
            + " ".join(f"{x:.4f}" for x in r["losses"])
            + " |"
        )

    lines = [
        f"# Where the GPU is the bound: {args.shape} ({shape['family']}, {init['params'] / 1e9:.2f} B), "
        f"{time.strftime('%Y-%m-%d')}",
        "",
        f"- device {args.device}; {M} micro-batches of {args.micro_batch_size} x {args.seq_len} tokens "
        f"({tokens:,} a step); {len(tt['times'])} steps, the first discarded, medians; "
        f"{fpt / 1e9:.2f} GFLOP a token (6 x the weights a token multiplies through + 12 x layers x hidden x seq)",
        f"- `tiertrain plan` at 1 micro-batch: {said or '(no knee line)'}",
        f"- tiertrain at this run's: {tt['knee']}",
        "- tiertrain's budget: " + "; ".join(tt["budget"][:2]),
        "",
        *rows,
    ]
    if plain is not None:
        p_step = med(plain["times"])
        ck = "with" if plain["checkpointing"] else "without"
        where = "in memory" if args.device == "cpu" else "in device memory"
        lines.append(row(f"plain PyTorch {where} ({ck} activation checkpointing)", plain, p_step, "1.00x"))
        lines.append(row("tiertrain", tt, t_step, f"**{p_step / t_step:.2f}x**"))
        for x, r in also:
            lines.append(row(f"tiertrain, --{x}", r, med(r["times"]), f"**{p_step / med(r['times']):.2f}x**"))
        dl = max(abs(a - b) / abs(a) for r in (tt, *(r for _, r in also)) for a, b in zip(plain["losses"], r["losses"]))
        tail = [f"- losses: largest relative difference {dl:.1e} (the parity tests' bf16 tolerances: docs/testing.md)"]
    else:
        lines.append(row("tiertrain", tt, t_step, "-"))
        for x, r in also:
            lines.append(row(f"tiertrain, --{x}", r, med(r["times"]), "-"))
        tail = [f"- plain PyTorch not run: {why}"]
    for x, r in also:
        parts = [statistics.median(p[i] for p in r["parts"][1:] or r["parts"]) for i in range(4)]
        tail.append(
            f"- with --{x}: phases (forward / backward / update / I/O wait) "
            + " / ".join(f"{v:.2f}" for v in parts)
            + f" s; predicted {r['predicted']:.3f} s (measured / predicted {med(r['times']) / r['predicted']:.2f}); "
            + "; ".join(r["budget"][2:])[-400:]
        )
    parts = [statistics.median(p[i] for p in tt["parts"][1:] or tt["parts"]) for i in range(4)]
    lines += [
        "",
        "- tiertrain's phases (forward / backward / update / I/O wait): "
        + " / ".join(f"{x:.2f}" for x in parts)
        + " s; "
        f"read / written a step {med(tt['read']) / 1e9:.2f} / {med(tt['write']) / 1e9:.2f} GB; update path {tt['mode']}",
        f"- the cost model's prediction at start: {tt['predicted']:.3f} s (measured / predicted "
        f"{t_step / tt['predicted']:.2f}); MFU on the step line "
        + (
            f"{med(tt['mfu']) * 100:.1f}%"
            if all(x is not None for x in tt["mfu"])
            else "- (no peak known for this device)"
        ),
        *tail,
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape", default="qwen2.5-3b", help=f"{', '.join(SHAPES)} or [llama:|qwen2:]LAYERSxWIDTH (a Llama by default)"
    )
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument(
        "--micro-batches", default="auto", help="a number, or auto: the fewest `tiertrain plan` names compute-bound"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-mib", type=int, default=0, help="tiertrain's memory.host_mib (0: its default)")
    ap.add_argument("--steps", type=int, default=4, help="steps (the first is warm-up)")
    ap.add_argument("--plain", choices=("auto", "off"), default="auto")
    ap.add_argument("--checkpointing", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="tiertrain once more with this setting too (same weights and data), another row",
    )
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = checked_out(args.out) if args.out else None
    with scratch_dir(args.scratch, "compute-bound") as scratch:
        text = run(args, scratch)
    publish(text, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
