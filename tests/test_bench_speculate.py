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
    text = speculate.report(args, {"params": 1e6}, None, plain, runs, rbw=1.0, wbw=0.5)
    assert (
        "variants DIFFER across runs (from the overlapped round 1, largest relative difference: speculate round 2 (5.0e-02))"
        in text
    )


def test_with_the_engines_their_rows_and_their_speculation_are_compared():
    args = argparse.Namespace(
        workload="clip", model="", micro_batches=8, seq_len=16, lr=1e-3, clip=1e-3, steps=3, rounds=1,
        host_mib=1024, pretrain_steps=0, pretrain_lr=1e-3,
    )  # fmt: skip
    plain = dict(times=[9.0, 2.0, 2.0], losses=[3.0, 2.5, 2.0], norms=[0.5, 1.5, 0.9])
    engines = _run([9, 6.0, 6.0], 2e9, 1e9)  # the worker counts the engines' own bytes in
    spec = _run([9, 3.0, 3.0], 3e9, 2e9, tally="speculation held in 0 of 3 steps")
    runs = {
        "overlap": [_run([9, 6.0, 6.0], 2e9, 1e9)],
        "speculate": [_run([9, 4.0, 4.0], 3e9, 1e9)],
        "engines": [engines],
        "engines speculating": [spec],
    }
    text = speculate.report(args, {"params": 134e6}, None, plain, runs, rbw=1.0, wbw=0.5)
    assert "| tiertrain engines | 6.00 (6.0) | **1.50x** | 1.00 / 2.00 / 0.50 | 2.00 / 1.00 |" in text
    assert "| tiertrain engines speculating | 3.00 (3.0) | **0.75x** | 1.00 / 2.00 / 0.50 | 3.00 / 2.00 |" in text
    assert "engines speculating / engines: 0.50x (+3.00 s a step); speculating / overlapped speculating: 0.75x" in text
    assert "round 1: speculation held in 0 of 3 steps" in text and "update.mode = overlap and engines" in text
    engines["losses"], engines["pieces"] = [3.0, 2.5, 2.0000006], 4  # the planner cut the vocabulary
    text = speculate.report(args, {"params": 134e6}, None, plain, runs, rbw=1.0, wbw=0.5)
    assert "largest relative difference: engines round 1 (3.0e-07, the vocabulary in 4 pieces)" in text
    assert "cut them in pieces, whose cross-entropy differs by rounding" in text


# end to end on a tiny model: tests/test_gpu_window.py, stage 7's dry run (the same script, flags
# and process spawning; the fine-tuning workload with its pretraining)
