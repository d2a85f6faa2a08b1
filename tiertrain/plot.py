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
    with open(path, encoding="utf-8", errors="replace") as f:  # (a byte not UTF-8: that line refused below)
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                by_step[int(rec["step"])] = rec
                float(rec["loss"]), int(rec.get("peak_host_bytes", 0))  # what the curves draw
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
    out = _checked_out(out)  # before drawing: a read-only --out was a traceback from savefig
    fig, (ax_loss, ax_speed, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (name, recs) in enumerate(runs):
        colour = f"C{i % 10}"
        steps = [r["step"] for r in recs]
        ax_loss.plot(steps, [r["loss"] for r in recs], color=colour, label=f"{name} train")
        val = [(r["step"], r["extra"]["eval_loss"]) for r in recs if "eval_loss" in r.get("extra", {})]
        if val:
            ax_loss.plot(*zip(*val), color=colour, linestyle="--", marker="o", markersize=3, label=f"{name} validation")
        ax_speed.plot(steps, [r.get("tokens_per_s", 0.0) for r in recs], color=colour, label=name)
        ax_mem.plot(steps, [r.get("peak_host_bytes", 0) / 2**20 for r in recs], color=colour, label=f"{name} host")
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
    try:
        fig.savefig(out, dpi=100)
    except OSError as exc:  # checked above: a disk filled meanwhile
        raise UsageError(f"plot --out {out}: writing it failed ({exc.strerror}); choose another file") from None
    finally:
        plt.close(fig)
    return out


def _checked_out(out: str) -> str:
    """``out``, absolute, its directory made and writable, of a format matplotlib writes (it
    takes it from the name; no suffix: PNG)."""
    from matplotlib.backend_bases import FigureCanvasBase

    from .paths import prepare_output_file

    suffix = os.path.splitext(out)[1].lower().lstrip(".")
    if suffix and suffix not in FigureCanvasBase.get_supported_filetypes():
        raise UsageError(f"plot --out = {out!r}: matplotlib cannot write .{suffix} files; give a name ending in .png")
    return prepare_output_file("plot --out", out, ours=_a_plot)


def _a_plot(path: str) -> bool:
    """An earlier plot: a PNG matplotlib wrote (its Software text says so); another file of that
    name (a photo, a note named .png) is never replaced."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"Matplotlib" in head
