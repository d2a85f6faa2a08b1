"""bench/speculate.py: the report's figures come from the runs (the floor, the ratios, how often
the clip acted, the tally); end to end: stage 7 of the GPU window, dry (tests/test_gpu_window.py)."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import speculate  # noqa: E402


def _run(times, read, write, losses=(3.0, 2.5, 2.0), tally="speculation held in 3 of 3 steps", predicted=5.0):
    return dict(
        times=list(times),
        losses=list(losses),
        read=[read] * len(times),
        write=[write] * len(times),
        parts=[[1.0, 2.0, 0.5]] * len(times),
        speculation=tally,
        space="1.00 GiB (exp_avg.bin 1 MiB, exp_avg.spec.bin 1 MiB)",
        predicted=predicted,
    )


def test_the_report_puts_each_variant_against_the_floor_and_the_other():
    args = argparse.Namespace(
        workload="finetune", model="", micro_batches=8, seq_len=16, lr=1e-5, clip=1.0, steps=3, rounds=2,
        host_mib=1024, pretrain_steps=200, pretrain_lr=1e-3,
    )  # fmt: skip
    plain = dict(times=[9.0, 2.0, 2.0], losses=[3.0, 2.5, 2.0], norms=[0.5, 1.5, 0.9])
    runs = {
        "overlap": [_run([9, 6.0, 6.0], 2e9, 1e9), _run([9, 8.0, 8.0], 2e9, 1e9)],
        "speculate": [_run([9, 4.5, 4.5], 3e9, 1e9), _run([9, 5.5, 5.5], 3e9, 1e9)],
    }
    text = speculate.report(args, {"params": 134e6}, {"losses": [10.0, 2.3]}, plain, runs, rbw=1.0, wbw=0.5)
    # floor: max(plain 2.0, overlap's 2 GB at 1 GB/s + 1 GB at 0.5 GB/s = 4.0) = 4.0
    assert "= 4.00 s" in text
    assert "| tiertrain overlap | 7.00 (6.0, 8.0) | **1.75x** |" in text
    assert "| tiertrain speculate | 5.00 (4.5, 5.5) | **1.25x** |" in text
    assert "speculative / overlapped: 0.71x (+2.00 s a step" in text
    assert "the clip acted in 1 of 3 plain PyTorch steps" in text
    assert "variants identical across runs" in text and "loss 10.000 -> 2.300" in text
    runs["speculate"][1]["losses"] = [3.0, 2.5, 2.1]
    assert "variants DIFFER" in speculate.report(args, {"params": 1e6}, None, plain, runs, rbw=1.0, wbw=0.5)


# end to end on a tiny model: tests/test_gpu_window.py, stage 7's dry run (the same script, flags
# and process spawning; the fine-tuning workload with its pretraining)
