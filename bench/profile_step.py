"""Where one step's time goes: tiertrain on a named shape (``bench/compute_bound.py``'s), a few
steps with their step lines, then one step under torch's profiler (the operators by their own
device time and by their own CPU time, every thread's), and, first, the host's own rates that
the update stands on (fused AdamW over a quarter GiB of fp32 states in this thread and in
another one, a large copy): for a short GPU window, where one command must say why a step is
slower than plain PyTorch's without a second try.

Usage: python bench/profile_step.py [--shape qwen2.5-3b] [--seq-len 2048] [--micro-batches 8]
                                    [--device cuda] [--steps 3] [--set SECTION.FIELD=VALUE ...]
                                    [--rows 25] [--no-profile] [--scratch DIR] [--log FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compute_bound  # noqa: E402

LOG: list = []  # --log FILE: everything said goes there too (a GPU window keeps only a stage log's tail)


def say(*a) -> None:
    print(*a, flush=True)
    for f in LOG:
        print(*a, file=f, flush=True)


def host_rates(n: int = 1 << 26) -> None:
    """Fused AdamW over ``n`` fp32 elements (four states: the memory's rate, not the caches'),
    on this thread and on a new one (the update thread's case), and a copy of as many bytes."""
    import torch

    from tiertrain.config import OptimConfig
    from tiertrain.update.kernels import adamw_segments

    p, g, m, v = (torch.rand(n) for _ in range(4))
    cfg = OptimConfig()

    def adamw() -> float:
        t0 = time.perf_counter()
        adamw_segments([p], [g], [m], [v], step=2, lr=1e-4, cfg=cfg)
        return time.perf_counter() - t0

    adamw()
    here = min(adamw() for _ in range(3))
    out: list[float] = []
    t = threading.Thread(target=lambda: out.extend([adamw(), min(adamw() for _ in range(3))]))
    t.start()
    t.join()
    dst = torch.empty_like(p)
    dst.copy_(p)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(p)
    copy = (time.perf_counter() - t0) / 3
    say(
        f"host: {torch.get_num_threads()} threads; fused AdamW {n / here / 1e9:.2f} G elements/s here, "
        f"{n / out[1] / 1e9:.2f} on a new thread; copy {2 * 4 * n / copy / 1e9:.1f} GB/s (read + write)"
    )


def run(args, scratch: str) -> None:
    import torch

    from tiertrain.config import load_config
    from tiertrain.training.trainer import Trainer

    hf = os.path.join(scratch, "config")
    compute_bound.write_config(compute_bound.shape_of(args.shape), args.seq_len, hf)
    cli = [
        f"--model.hf_dir={hf}",
        "--model.from_scratch=true",
        f"--model.max_seq_len={args.seq_len}",
        f"--data.seq_len={args.seq_len}",
        "--data.micro_batch_size=1",
        f"--data.micro_batches={args.micro_batches}",
        f"--train.steps={args.steps + 1}",
        f"--train.device={args.device}",
        "--train.progress=false",
        f"--io.paths={scratch}/ssd",
        f"--train.run_dir={scratch}/run",
        "--checkpoint.at_end=false",
        *[f"--{x}" for x in args.set],
    ]
    cfg = load_config(None, cli)
    t0 = time.perf_counter()
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        say(f"started in {time.perf_counter() - t0:.0f} s; " + "; ".join(tr.budget.lines()[:2] if tr.budget else []))
        pred = tr.predict()
        if pred is not None:
            say(f"predicted {pred.step_s:.2f} s a step")
        for _ in range(args.steps):
            r = tr.train_step()
            say(r.line(cfg.train.steps))
            say(f"  extra: { {k: v for k, v in r.extra.items() if k != 'losses' and not isinstance(v, (list, dict))} }")
        if args.no_profile:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            r = tr.train_step()
        say(r.line(cfg.train.steps) + "  (profiled)")
    avg = prof.key_averages()
    for key in ("self_device_time_total", "self_cpu_time_total"):
        if key == "self_device_time_total" and args.device != "cuda":
            continue
        say(f"\n== operators by {key}")
        say(avg.table(sort_by=key, row_limit=args.rows, max_name_column_width=48))


def main(argv: list[str] | None = None) -> int:
    from tiertrain.bench.output import SCRATCH_HELP, scratch_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-3b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=3, help="steps before the profiled one")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--host-elements", type=int, default=1 << 26, help="the host rates' size (0: not measured)")
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--log", default=None, help="a file that gets everything printed, too")
    args = ap.parse_args(argv)
    if args.log:
        LOG.append(open(args.log, "w"))
    if args.host_elements:
        host_rates(args.host_elements)
    with scratch_dir(args.scratch, "profile-step") as scratch:
        run(args, scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
