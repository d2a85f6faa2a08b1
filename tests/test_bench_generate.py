"""bench/generate.py's report, computed from the runs (no model needed)."""

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import generate as bench  # noqa: E402


def test_report_ratios_floor_and_agreement():
    rows = {
        (1, "tiertrain"): dict(seconds=4.0, tokens=8, peak_rss=1 << 30, read=8e9, first=[1, 2]),
        (1, "accelerate"): dict(seconds=16.0, tokens=8, peak_rss=2 << 30, read=1e9, first=[1, 2]),
        (1, "plain"): dict(seconds=2.0, tokens=8, peak_rss=3 << 30, read=0, first=[1, 2]),
        (16, "tiertrain"): dict(seconds=8.0, tokens=128, peak_rss=1 << 30, read=8e9, first=[1, 3]),
        (16, "accelerate"): dict(seconds=64.0, tokens=128, peak_rss=2 << 30, read=1e9, first=[1, 2]),
        (16, "plain"): dict(seconds=4.0, tokens=128, peak_rss=3 << 30, read=0, first=[1, 2]),
    }
    for r in rows.values():
        r["same"] = [r["first"]]
    args = SimpleNamespace(
        layers=16,
        d_model=1536,
        d_ff=4096,
        prompt_len=8,
        new_tokens=8,
        budget_mib=512,
        memory_limit_mib=None,
        family="llama",
    )
    text = bench.render(rows, ["tiertrain", "accelerate", "plain"], args, n_params=250_000_000, read_gbps=2.0)
    assert "| 1 | tiertrain (weights from the storage tier, 3 slots) | 2.0 | 4.00x | 0.50x | 1.00 | 8.00 |" in text
    assert "| 16 | tiertrain (weights from the storage tier, 3 slots) | 16.0 | 8.00x | 0.50x |" in text
    assert "1.00 GB per token / 2.00 GB/s = 0.50 s per token; tiertrain takes 0.50 s per token (1.00x" in text
    assert "identical across systems: NO." in text  # batch 16's tiertrain row differs


def test_a_mixture_of_experts_bytes_a_token_against_every_expert_and_the_routed_floor():
    """2 layers of 4 experts of 1 M parameters each, 2 M dense: 10 M parameters, 40 MB a pass;
    2 passes reaching 5 experts in all: the routed floor is 2 x 8 MB + 5 x 4 MB = 36 MB."""
    shape = dict(layers=2, experts=4)
    args = SimpleNamespace(moe_shape=shape)
    rows = {
        (1, "plain"): dict(tokens=2, router_calls=4, reached=5),
        (1, "tiertrain"): dict(tokens=2, tier_gb=0.027, tier_reached=4),
    }
    text = bench.render_routed(rows, args, n_params=10_000_000, expert_params=1_000_000)
    assert "| 1 | 2 | 5 / 4 | 40.0 | 18.0 | 13.5 | 0.75x (goal <= 1.2x) |" in text
