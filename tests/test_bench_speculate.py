"""bench/speculate.py: the report's figures come from the runs (the floor, the ratios, how often
the clip acted, the tally), and the script runs end to end on a tiny model."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

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


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end_on_a_tiny_model(tmp_path):
    out = tmp_path / "r.md"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(os.path.dirname(__file__), "..", "bench", "speculate.py"),
            "--workload=clip",
            "--model=n_layers=2,d_model=64,n_heads=4,d_ff=128,vocab_size=512",
            "--micro-batches=2",
            "--steps=2",
            "--rounds=1",
            "--host-mib=200",
            "--io-mib=64",
            f"--scratch={tmp_path}",
            f"--out={out}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert "speculation held in 0 of 2 steps" in text and "variants identical" in text
