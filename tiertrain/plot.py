"""``tiertrain plot RUN_DIR...``: the curves of one or more runs from their ``metrics.jsonl``,
into one PNG: loss (train, and validation where taken), tokens/s and peak host memory per
step, one colour per run. Needs matplotlib (``pip install 'tiertrain[plot]'``)."""

from __future__ import annotations

import json
import os
from typing import Sequence

from .errors import UsageError

__all__ = ["read_metrics", "plot_runs"]


def read_metrics(run_dir: str) -> list[dict]:
    """The step records of ``run_dir`` (its ``metrics.jsonl``; a resumed run's repeated steps:
    the last course of each), refused with the file and line when bad."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"plot: {run_dir} has no metrics.jsonl; give a run directory (train.run_dir of a run)")
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                by_step[int(rec["step"])] = rec
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise UsageError(f"plot: {path}, line {n}: not a step record") from None
    if not by_step:
        raise UsageError(f"plot: {path} holds no step yet")
    return [by_step[s] for s in sorted(by_step)]


def plot_runs(run_dirs: Sequence[str], out: str) -> str:
    """Draw the runs' curves into ``out`` (a .png); its path returned."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plot needs matplotlib: pip install 'tiertrain[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(os.path.basename(os.path.normpath(d)) or d, read_metrics(d)) for d in run_dirs]
    fig, (ax_loss, ax_speed, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (name, recs) in enumerate(runs):
        colour = f"C{i % 10}"
        steps = [r["step"] for r in recs]
        ax_loss.plot(steps, [r["loss"] for r in recs], color=colour, label=f"{name} train")
        val = [(r["step"], r["extra"]["eval_loss"]) for r in recs if "eval_loss" in r.get("extra", {})]
        if val:
            ax_loss.plot(*zip(*val), color=colour, linestyle="--", marker="o", markersize=3, label=f"{name} validation")
        ax_speed.plot(steps, [r.get("tokens_per_s", 0.0) for r in recs], color=colour, label=name)
        ax_mem.plot(steps, [r["peak_host_bytes"] / 2**20 for r in recs], color=colour, label=f"{name} host")
        if any(r.get("peak_device_bytes") for r in recs):
            ax_mem.plot(
                steps,
                [r["peak_device_bytes"] / 2**20 for r in recs],
                color=colour,
                linestyle=":",
                label=f"{name} device",
            )
    for ax, title in ((ax_loss, "loss"), (ax_speed, "tokens/s"), (ax_mem, "peak memory, MiB")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
