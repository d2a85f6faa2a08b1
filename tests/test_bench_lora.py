"""bench/lora.py: the report's figures are computed from the runs (floors, ratios, the budget a
run needed); end to end: stage 8 of the GPU window, dry."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import lora  # noqa: E402


def _run(**kw):
    out = dict(
        steps=[9.0, 4.0, 5.0],
        read=[2e9, 2e9, 2e9],
        write=[0, 0, 0],
        losses=[10.0, 9.0, 8.0],
        peak=3 << 30,
        read_gbps=1.0,
        write_gbps=2.0,
        compute_s=3.0,
        walk_s=[4.2, 3.75],
        base_bytes=2e9,
        params=1_000_000_000,
        adapters=1_000_000,
        budget=["host memory budget ..."],
        asked_mib=2048,
        host_mib=2048,
        base_dtype="bfloat16",
        held_mib=450,
        asked_rss_mib=600,
    )
    out.update(kw)
    return out


def test_report_puts_the_step_against_both_floors_and_peft():
    args = argparse.Namespace(big="2x64", peer="same", host_mib=2048, steps=3, family="llama", peer_mib=400, set=[])
    big = _run(steps=[9.0, 4.0, 5.0])  # median of steps 2.. = 4.5 s; I/O floor 2 x 2 GB at 1 GB/s = 4 s
    peer = [dict(steps=[5.0, 3.0, 3.0], peak=2 << 30), dict(steps=[5.0, 4.0, 4.0], peak=2 << 30)]
    peer_tt = [_run(steps=[7.0, 3.6, 3.6], peak=1 << 29, host_mib=700), _run(steps=[7.0, 4.0, 4.0], peak=400 << 20)]
    text = lora.report(args, big, {"bytes_bf16": 2e9}, peer, peer_tt)
    assert "4.5 s = **1.12x the I/O floor**" in text and "1.12x max(I/O, compute)" in text
    # the visits with no compute: the faster of the two, 3.75 s; 4.5 / 3.75 = 1.20
    assert "right after the steps: 4.2, 3.8 s" in text and "1.20x max(visits with no compute, compute)" in text
    # two rounds alternated: 1.20x and 1.00x, their median 1.10x; the larger RSS ratio 0.25x
    assert "**1.10x peft's step at 0.250x its peak RSS** (median of the rounds' ratios: 1.20x, 1.00x" in text
    assert "| 1 | tiertrain, budget 700 MiB (peak RSS aimed at 600 MiB, a fifth of peft's, less 450 MiB" in text
    assert "| 2 | plain PyTorch + peft, in memory | 4.00 | 2.00 |" in text
    assert "base on the tier in bfloat16" in text and "2 round(s), the two alternated" in text
    refused = lora.report(args, _run(host_mib=2500), {"bytes_bf16": 2e9}, [], [])
    assert "2048 MiB was refused" in refused and "Against plain peft" not in refused
    assert "Not run: no interpreter with DeepSpeed given" in refused
    ds = dict(steps=[20.0, 9.0, 9.0], read=[8e9] * 3, peak=6 << 30, init_s=100.0, losses=[1.0] * 3)
    text = lora.report(args, big, {"bytes_bf16": 2e9}, [], [], ds)
    assert "**2.00x faster than DeepSpeed at 0.50x its peak RSS**" in text  # 9 s against 4.5 s, 3 against 6 GiB
    failed = lora.report(args, big, {"bytes_bf16": 2e9}, [], [], {"error": "AssertionError: x", "ran_steps": 0})
    assert "Did not run through (0 steps): `AssertionError: x`" in failed


# end to end on a tiny model: tests/test_gpu_window.py, stage 8's dry run (the same command)


def test_report_of_the_run_against_peft_alone():
    args = argparse.Namespace(
        big="2x64", peer="same", host_mib=2048, steps=3, family="llama", set=["model.layer_pieces=4"]
    )
    peer = [dict(steps=[5.0, 3.0, 3.0], peak=2 << 30)]
    text = lora.report(args, None, {"bytes_bf16": 2e9}, peer, [_run(steps=[7.0, 3.3, 3.3], peak=400 << 20)])
    assert text.startswith("# LoRA against plain peft in memory")
    assert "**1.10x peft's step at 0.195x its peak RSS**" in text and "DeepSpeed" not in text
    assert "(set: `model.layer_pieces=4`)" in text  # the settings given with --set, said
    with pytest.raises(SystemExit):  # nothing to run but the peer, and nothing to put DeepSpeed against
        lora.main(["--skip-big", "--ds-python", sys.executable])
