"""tiertrain within a fifth of plain PyTorch's memory, against plain PyTorch in memory.

Each system runs in a fresh process of its own, so each peak RSS (``ru_maxrss``) is that
system's alone:

1. ``init``: the model (the reference's own initialisation, seed 0) written to a safetensors
   file, which both systems start from;
2. ``plain``: plain PyTorch, the whole model and its AdamW state in memory (the reference
   trainer: micro-batch-major accumulation, clipping, fused AdamW); its steps, losses and
   peak RSS;
3. ``tiertrain``: the same model (``model.init_from``), data and optimizer with
   ``memory.host_mib`` = plain's peak RSS / ``--fraction`` (default 5): the budget planner
   places what fits and streams the rest from the storage tier; update path and activations
   on their defaults (auto). Its steps, losses, bytes, predicted step and peak RSS.
   ``--fraction 0``: tiertrain's default budget instead (half the available memory), where a
   model this size fits whole.

The disk's bandwidth is measured in the same run, for the floor:

    floor = max(plain PyTorch's step, bytes read / read GB/s + bytes written / write GB/s)

Losses are compared step by step (the math is the same; the default vocabulary pieces change
the head's rounding: see tests/test_pieces.py).

Usage: python bench/vs_plain.py [--model n_layers=12,d_model=768,...] [--micro-batches 4]
                                [--seq-len 64] [--steps 4] [--fraction 5] [--set SECTION.FIELD=VALUE ...]
                                [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

MODEL = dict(kind="llama", n_layers=12, d_model=768, n_heads=12, d_ff=2048, vocab_size=32000)


def model_fields(args) -> dict[str, str]:
    """The model's fields (``--model``), or, with ``--hf-config``, the directory's config.json."""
    if getattr(args, "hf_config", None):
        return {"hf_dir": args.hf_config, "from_scratch": "true"}
    return dict(MODEL, **dict(kv.split("=", 1) for kv in filter(None, args.model.split(","))))


def flags(args, scratch: str) -> list[str]:
    model = model_fields(args)
    return [f"--model.{k}={v}" for k, v in model.items()] + [
        f"--model.max_seq_len={args.seq_len}",
        f"--data.seq_len={args.seq_len}",
        "--data.micro_batch_size=1",
        f"--data.micro_batches={args.micro_batches}",
        f"--train.steps={args.steps}",
        "--train.progress=false",
        f"--io.paths={scratch}/ssd",
        f"--train.run_dir={scratch}/run",
        "--checkpoint.at_end=false",
        *[f"--{x}" for x in args.set],
    ]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def untied(state: dict) -> dict:
    """``state`` with each storage once (a head tied to the embedding saved as its embedding, as
    ``save_pretrained`` does: safetensors refuses tensors that share memory)."""
    seen, out = set(), {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            out[k] = v.contiguous()
    return out


def load_into(inner, path: str) -> None:
    """The weights in ``path`` into ``inner``'s parameters, one tensor at a time (no second copy
    in the peak); a tied head, not in the file, shares the embedding's."""
    import torch
    from safetensors import safe_open

    with torch.no_grad(), safe_open(path, "pt") as f:
        keys = set(f.keys())
        for k, v in inner.state_dict().items():
            if k in keys:
                v.copy_(f.get_tensor(k))


def worker_init(cfg, path: str, device: str = "cpu") -> dict:
    """The initial weights both systems read, made on ``device`` (the reference's initialisation
    on the GPU where the run is there: 90 s on the CPU for 5.6 B parameters), written from host
    memory."""
    import torch
    from safetensors.torch import save_file

    from tiertrain.reference import HFWrapper, reference_model

    with torch.device(device):
        model = reference_model(cfg)
    inner = model.hf if isinstance(model, HFWrapper) else model
    save_file({k: v.cpu() for k, v in untied(inner.state_dict()).items()}, path)
    out = {"params": sum(p.numel() for p in model.parameters())}
    if cfg.model.hf_dir is not None:  # the shape as its config.json gives it
        c = inner.config
        keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_experts",
                "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits", "vocab_size")  # fmt: skip
        out["family"] = type(inner).__name__
        out["shape"] = {k: getattr(c, k) for k in keys if getattr(c, k, None) is not None}
    return out


def worker_plain(cfg, path: str, keep: bool = False):
    """Plain PyTorch's steps from the weights in ``path``: times, losses, gradient norms (and,
    with ``keep``, the trained model after the result)."""
    import torch

    from tiertrain.data import Corpus
    from tiertrain.reference import HFWrapper, reference_model

    model = reference_model(cfg)
    load_into(model.hf if isinstance(model, HFWrapper) else model, path)
    # tiertrain's device and parameter dtype (train.device, train.param_dtype), resolved as it
    # resolves them: on a CPU (fp32) a no-op; on a GPU the in-memory run is the floor there
    from tiertrain.device import resolve_device, resolve_dtype

    dev = resolve_device(cfg.train.device)
    model.to(dev, resolve_dtype(cfg.train.param_dtype, dev))
    o, M = cfg.optim, cfg.data.micro_batches
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
    )
    from tiertrain.update.lr import lr_at

    corpus, times, losses, norms = Corpus(cfg.data), [], [], []
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        ls = []
        for x, y in corpus.batches(step):
            loss = model(x.to(dev), y.to(dev))
            (loss / M).backward()
            ls.append(loss.item())  # sync point on a GPU (one scalar per micro-batch, as tiertrain's)
        if o.grad_clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step + 1, o, cfg.train.steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()  # sync point: the step's time includes the update's kernels
        times.append(time.perf_counter() - t0)
        losses.append(sum(ls) / M)
        print(f"plain step {step + 1}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    res = {"times": times, "losses": losses, "norms": norms}
    return (res, model) if keep else res


def worker_tiertrain(cfg, more=None) -> dict:
    """tiertrain's steps; ``more(trainer, records, prediction)``: further figures for the result."""
    from tiertrain.training.trainer import Trainer

    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        budget = tr.budget.lines() if tr.budget else []
        # at start, as `tiertrain train` predicts: from the rates the budget measured before the
        # pools were taken (a fresh probe here, pools in place, would add its own buffers and a
        # block's forward and backward to the peak RSS this benchmark reports)
        pred = tr.predict()
        recs = []
        for _ in range(cfg.train.steps):
            recs.append(tr.train_step())
            print(recs[-1].line(cfg.train.steps), file=sys.stderr, flush=True)
        return {
            "times": [r.step_s for r in recs],
            "losses": [r.loss for r in recs],
            # the update engines' own bytes with the trainer's (an engine's update of step s is
            # reported during step s + 1): one disk's work either way
            "read": [r.ssd_read_bytes + r.extra.get("engine_read_bytes", 0) for r in recs],
            "write": [r.ssd_write_bytes + r.extra.get("engine_write_bytes", 0) for r in recs],
            "parts": [[r.forward_s, r.backward_s, r.update_s, r.io_wait_s] for r in recs],
            "acts": {k: recs[-1].extra.get(k, 0) for k in ("act_kept", "act_offloaded", "act_recomputed")},
            "mode": tr.cfg.update.mode,
            "budget": budget,
            "predicted": pred.step_s if pred else float("nan"),
            # what the prediction stood on: the disk rates this run's budget probed at start
            "probed": [pred.rates.read_gbps, pred.rates.write_gbps] if pred else None,
            "pools": sum(tr.pool_bytes.values()),
            "norms": [r.grad_norm for r in recs],
            **(more(tr, recs, pred) if more else {}),
        }


def worker(argv: list[str]) -> int:
    kind, out, path, *cli = argv
    from tiertrain.config import load_config

    cfg = load_config(None, cli)
    res = {
        "init": lambda: worker_init(cfg, path),
        "plain": lambda: worker_plain(cfg, path),
        "tiertrain": lambda: worker_tiertrain(cfg),
    }[kind]()
    return finish_worker(out, res)


def finish_worker(out: str, res: dict) -> int:
    """A worker's result, with its process's peak RSS, written to ``out`` (JSON) for ``spawn``."""
    res["peak_rss"] = peak_rss()
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


def spawn(kind: str, scratch: str, cli: list[str], *, script: str | None = None, extra: list[str] = ()) -> dict:
    """Worker ``kind`` of ``script`` (this file by default) in a process of its own: its argv
    ``--worker KIND OUT INIT [EXTRA...] CLI...``, its result read back."""
    out = os.path.join(scratch, f"{kind}.json")
    t0 = time.perf_counter()
    init = os.path.join(scratch, "init.safetensors")
    subprocess.run([sys.executable, script or __file__, "--worker", kind, out, init, *extra, *cli], check=True)
    print(f"{kind}: {time.perf_counter() - t0:.0f} s", flush=True)
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="", help="model fields to change, e.g. n_layers=16,d_model=2048,n_heads=16,d_ff=5632"
    )
    ap.add_argument(
        "--hf-config", default=None, help="a directory with a transformers config.json: that model, random weights"
    )
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="steps (the first is warm-up)")
    ap.add_argument(
        "--fraction",
        type=float,
        default=5.0,
        help="tiertrain's memory.host_mib = plain's peak RSS / this (0: the default budget, half the available memory)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="any other config field for both systems (repeatable)",
    )
    ap.add_argument(
        "--io-mib", type=int, default=1024, help="MiB the disk's bandwidth is measured with (for the floor)"
    )
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = checked_out(args.out) if args.out else None
    with scratch_dir(args.scratch, "vs-plain") as scratch:
        report = run(args, scratch)
    publish(report, out)
    return 0


def run(args, scratch: str) -> str:
    from tiertrain.bench.io import run_io_bench

    cli = flags(args, scratch)
    os.makedirs(f"{scratch}/ssd")
    init = spawn("init", scratch, cli)
    plain = spawn("plain", scratch, cli)
    host_mib = int(plain["peak_rss"] / 2**20 / args.fraction) if args.fraction else None
    tt = spawn(
        "tiertrain",
        scratch,
        [
            *cli,
            f"--model.init_from={scratch}/init.safetensors",
            *([f"--memory.host_mib={host_mib}"] if host_mib else []),
        ],
    )
    io_mib = getattr(args, "io_mib", 1024)
    io = run_io_bench([f"{scratch}/ssd"], size_bytes=io_mib << 20, repeats=2, use_fio=False, progress=False)
    rbw, wbw = io.median("ours", "read"), io.median("ours", "write")
    steady = slice(1, None)
    med = lambda xs: statistics.median(xs[steady])  # noqa: E731
    p_step, t_step = med(plain["times"]), med(tt["times"])
    rb, wb = med(tt["read"]), med(tt["write"])
    io_s = rb / (rbw * 1e9) + wb / (wbw * 1e9)
    floor = max(p_step, io_s)
    dl = max(abs(a - b) / abs(a) for a, b in zip(plain["losses"], tt["losses"]))
    parts = [statistics.median(p[i] for p in tt["parts"][steady]) for i in range(4)]
    budget = f"budget {host_mib} MiB" if host_mib else "default budget"
    M, model = args.micro_batches, model_fields(args)
    family = init.get("family", "Llama")
    return "\n".join(
        [
            "# tiertrain "
            + (
                f"at 1/{args.fraction:g} of plain PyTorch's peak RSS"
                if host_mib
                else "within its default memory budget"
            )
            + ", against plain PyTorch in memory, "
            f"{time.strftime('%Y-%m-%d')}",
            "",
            f"- machine: {platform.machine()}, {os.cpu_count()} cores, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB RAM, one virtual disk "
            f"(read {rbw:.2f} GB/s, write {wbw:.2f} GB/s, measured in this run after training); fp32 on CPU",
            f"- model: {family}, {init['params'] / 1e6:.1f} M parameters ("
            + ", ".join(f"{k} {v}" for k, v in (init.get("shape") or model).items() if k != "kind")
            + f"); M = {M} micro-batches of 1 x {args.seq_len} tokens; {len(plain['times'])} steps, the first discarded; "
            f"medians{'; other settings: ' + ', '.join(args.set) if args.set else ''}",
            "- each system in a process of its own; tiertrain's "
            + (
                f"memory.host_mib = {host_mib} (plain's peak RSS / {args.fraction:g})"
                if host_mib
                else "memory.host_mib at its default (half the available memory)"
            )
            + f"; update path {tt['mode']}; activations: "
            + ", ".join(f"{k[4:]} {v}" for k, v in tt["acts"].items()),
            "",
            *[f"    {x}" for x in tt["budget"]],
            "",
            "| system | s/step | vs plain | peak RSS | read / written GB per step | losses |",
            "|---|---|---|---|---|---|",
            f"| plain PyTorch, in memory | {p_step:.2f} | 1.00x | {plain['peak_rss'] / 2**30:.2f} GiB | 0 / 0 | "
            + " ".join(f"{x:.4f}" for x in plain["losses"])
            + " |",
            f"| tiertrain, {budget} | {t_step:.2f} | **{t_step / p_step:.2f}x** | "
            f"{tt['peak_rss'] / 2**30:.2f} GiB ({tt['peak_rss'] / plain['peak_rss']:.2f}x) | {rb / 1e9:.2f} / {wb / 1e9:.2f} | "
            + " ".join(f"{x:.4f}" for x in tt["losses"])
            + " |",
            "",
            "- tiertrain's phases (forward / backward / update / I/O wait): "
            + " / ".join(f"{x:.2f}" for x in parts)
            + " s",
            f"- floor: max(plain's step {p_step:.2f} s, I/O {io_s:.2f} s) = {floor:.2f} s; tiertrain "
            f"**{t_step / floor:.2f}x the floor**",
            f"- the cost model's prediction at start: {tt['predicted']:.2f} s (measured / predicted "
            f"{t_step / tt['predicted']:.2f})",
            f"- losses: largest relative difference {dl:.1e}",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
