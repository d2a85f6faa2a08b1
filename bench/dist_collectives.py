"""What sharded training's collectives cost over Gloo on this machine (loopback), per rank.

For each world size and message size: ``RankGroup.all_gather`` (a unit from its shards) and
``RankGroup.reduce_scatter`` (a unit's gradient summed in rank order, each rank keeping its
shard: ``all_to_all`` plus the sum), and for comparison Gloo's own ``reduce_scatter`` (whose
summation order is the backend's). Printed per rank: seconds per call, bytes sent + received
by the algorithm's count, and GB/s of those bytes. A sharded step moves about
3 x parameter bytes x (N - 1) / N per rank (two gathers and one reduce-scatter per unit):
with these rates that gives the network term of the step.

Usage: python bench/dist_collectives.py [--worlds 2,3] [--mib 4,64] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tiertrain.dist import RankGroup  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res = {}
    with RankGroup(rank, world, timeout_s=120) as g:
        rs_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        for mib in sizes:
            n = (mib << 20) // 4 // world * world  # float32 elements of the whole unit
            full, shard = torch.randn(n), torch.randn(n // world)
            for name, fn in (
                ("all_gather", lambda full=full, shard=shard: g.all_gather(full, shard)),
                ("reduce_scatter (rank order)", lambda full=full: g.reduce_scatter(full)),
                ("gloo reduce_scatter", lambda full=full, shard=shard: rs_native(shard, full)),
            ):
                fn()  # warm-up
                g.barrier()
                before = g.traffic.sent + g.traffic.received
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                moved = (g.traffic.sent + g.traffic.received - before) / repeats
                if name == "gloo reduce_scatter":  # not counted by the group: the same bytes as ours
                    moved = 2 * (world - 1) * shard.numel() * 4
                res[(mib, name)] = (statistics.median(times), moved)
                g.barrier()
    torch.save(res, os.path.join(out_dir, f"{rank}.pt"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--mib", default="4,64", help="unit sizes, MiB of float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.mib.split(",")]
    lines = [
        f"# Collectives over Gloo (loopback), {time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"median of {args.repeats} calls after a warm-up, one thread per rank",
        "",
        "| ranks | unit MiB | collective | s per call | MB sent + received per rank | GB/s per rank |",
        "|---|---|---|---|---|---|",
    ]
    for world in [int(x) for x in args.worlds.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(world, _port(), sizes, args.repeats, d), nprocs=world, join=True)
            res = torch.load(os.path.join(d, "0.pt"))
        for (mib, name), (s, moved) in res.items():
            lines.append(f"| {world} | {mib} | {name} | {s:.4f} | {moved / 1e6:.1f} | {moved / s / 1e9:.2f} |")
    lines += [
        "",
        "A sharded step moves about 3 x parameter bytes x (N - 1) / N per rank, each way; at the "
        "rates above that is the network term of its step (hidden under compute where the "
        "gathers are prefetched).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
