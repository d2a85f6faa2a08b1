"""GPUDirect Storage on a real run (stage 6 of the GPU window).

The default job's model with its parameters on the storage tier (``memory.host_param_mib =
0``: otherwise this small model's parameters stay in host memory and no unit is ever read from
a file, so kvikio is never reached), trained twice from the same seed: with ``io.gds = on``
(every unit read from the drive straight into GPU memory through kvikio, checksums verified on
the GPU) and with ``io.gds = off`` (through pinned host memory). Only the read path differs,
so the losses and weights must be the same bits; the bytes kvikio read must be the parameter
reads of every step.

    python3 bench/gpu_window/gds_check.py --scratch DIR [--steps 5] [--device cuda] [--set SECTION.FIELD=VALUE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

from tiertrain.config import Config, load_config
from tiertrain.io import gds
from tiertrain.training.trainer import Trainer


def config(scratch: str, gds_mode: str, *, device: str = "cuda", steps: int = 5, extra: tuple[str, ...] = ()) -> Config:
    """The run: the default job's model, its parameters on the storage tier (never in host
    memory), ``io.gds`` as given, checksums on."""
    return load_config(
        None,
        [
            f"--io.paths={os.path.join(scratch, gds_mode, 'ssd')}",
            f"--train.run_dir={os.path.join(scratch, gds_mode, 'run')}",
            "--train.overwrite=true",
            f"--train.device={device}",
            f"--train.steps={steps}",
            "--train.progress=false",
            "--train.predict=false",
            "--checkpoint.at_end=false",
            "--io.checksum=true",
            f"--io.gds={gds_mode}",
            "--memory.host_param_mib=0",
            *extra,
        ],
    )


class DirectBytes:
    """Counts the bytes read and written through ``gds.open_file`` (kvikio, or a test's stand-in)."""

    def __init__(self) -> None:
        self.read = self.written = 0

    @contextlib.contextmanager
    def counting(self):
        real = gds.open_file

        def open_counted(path: str, writable: bool):
            f = real(path, writable)
            counter = self

            class Counted:
                def pread(self, buf, size, file_offset):
                    counter.read += size
                    return f.pread(buf, size, file_offset)

                def pwrite(self, buf, size, file_offset):
                    counter.written += size
                    return f.pwrite(buf, size, file_offset)

                def close(self):
                    f.close()

            return Counted()

        gds.open_file = open_counted
        try:
            yield self
        finally:
            gds.open_file = real


def train(cfg: Config, device=None) -> dict:
    """Losses, final weights, step times and bytes through the direct path of one run."""
    counter = DirectBytes()
    with counter.counting(), Trainer(cfg, device=device) as tr:
        tr.initialize(progress=False)
        direct = tr.dev.direct
        recs = [tr.train_step() for _ in range(cfg.train.steps)]
        weights = tr.weights()
    return dict(
        losses=[r.loss for r in recs],
        weights=weights,
        step_s=[r.step_s for r in recs],
        read=sum(r.ssd_read_bytes for r in recs),
        direct=direct,
        direct_read=counter.read,
    )


def compare(on: dict, off: dict) -> list[str]:
    """What differs between the direct run and the staged one (nothing, when all is well), with
    the first step and the largest weight difference: a difference from the first step on with
    the same bytes read would be the kernels' nondeterminism, not the read path."""
    bad = []
    if on["losses"] != off["losses"]:
        first = next(i for i, (a, b) in enumerate(zip(on["losses"], off["losses"]), 1) if a != b)
        bad.append(f"losses differ from step {first}: {on['losses']} vs {off['losses']}")
    differ = [k for k in off["weights"] if not torch.equal(on["weights"][k], off["weights"][k])]
    if differ:
        worst = max((on["weights"][k].float() - off["weights"][k].float()).abs().max().item() for k in differ)
        bad.append(
            f"{len(differ)} of {len(off['weights'])} weights differ (first: {differ[0]}; largest "
            f"difference {worst:.3g})"
        )
    if not on["direct"]:
        bad.append("the device did not read files directly (io.gds = on did not take effect)")
    if on["direct_read"] == 0:
        bad.append("no byte was read through kvikio: the parameters never came from the drive")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="further config flags, e.g. model.n_layers=8",
    )
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)  # the two runs may differ by the read path alone
    extra = tuple(f"--{s}" for s in args.set)
    runs = {}
    for mode in ("on", "off"):
        t0 = time.perf_counter()
        runs[mode] = train(config(args.scratch, mode, device=args.device, steps=args.steps, extra=extra))
        r = runs[mode]
        steady = sorted(r["step_s"][1:]) or r["step_s"]
        print(
            f"io.gds={mode}: {args.steps} steps in {time.perf_counter() - t0:.1f} s, median step "
            f"{steady[len(steady) // 2]:.3f} s, {r['read'] / 1e9:.3f} GB read from the tier, "
            f"{r['direct_read'] / 1e9:.3f} GB of it through kvikio; losses {', '.join(f'{x:.4f}' for x in r['losses'])}"
        )
    bad = compare(runs["on"], runs["off"])
    print("direct and staged runs: " + ("the same losses and weights, bit for bit" if not bad else "; ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
