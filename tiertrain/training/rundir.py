"""The run directory: a run's config, metrics and (by default) checkpoints.

A run directory belongs to one run at a time (a ``DirLock``: a second run started into it
is refused, naming the holder). A new run into a directory that holds another run's work
is refused unless asked: ``--resume`` continues that run, ``train.overwrite`` deletes its
checkpoints and metrics first. After a resume, ``metrics.jsonl`` keeps the records up to
the checkpoint's step and continues from there, so no step appears twice.
"""

from __future__ import annotations

import json
import os
import shutil

from ..checkpoint import list_checkpoints
from ..io.scratch import DirInUseError, DirLock

__all__ = ["RunDir", "RunDirError", "METRICS", "CONFIG"]

METRICS = "metrics.jsonl"
CONFIG = "config.json"


class RunDirError(DirInUseError):
    """The run directory is in use, or holds another run's work."""


def _busy(path: str, who: str) -> RunDirError:
    return RunDirError(
        f"train.run_dir {path} is in use by another tiertrain run ({who}); wait for it to finish, stop it, "
        "or give this run another --train.run_dir"
    )


class RunDir:
    """Run directory ``path`` (checkpoints under ``checkpoint_root``), locked for this run."""

    def __init__(self, path: str, checkpoint_root: str) -> None:
        self.path, self.checkpoint_root = os.path.abspath(path), os.path.abspath(checkpoint_root)
        self.lock = DirLock(self.path, _busy)
        self.metrics_path = os.path.join(self.path, METRICS)
        self.config_path = os.path.join(self.path, CONFIG)

    def holds_a_run(self) -> list[str]:
        """What of an earlier run is here (empty: nothing)."""
        found = [os.path.basename(p) for p in list_checkpoints(self.checkpoint_root)]
        for name in (METRICS, CONFIG):
            if os.path.exists(os.path.join(self.path, name)):
                found.append(name)
        return found

    def start_fresh(self, overwrite: bool) -> None:
        """Before a new (not resumed) run: refuse a directory with another run's work unless
        ``overwrite``, which deletes it."""
        found = self.holds_a_run()
        if not found:
            return
        if not overwrite:
            shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
            raise RunDirError(
                f"train.run_dir {self.path} already holds a run ({shown}); continue it with "
                f"`tiertrain train --resume {self.path}`, start over with --train.overwrite=true "
                "(deletes its checkpoints and metrics), or give another --train.run_dir"
            )
        for ck in list_checkpoints(self.checkpoint_root):
            shutil.rmtree(ck)
        for name in (METRICS, CONFIG):
            p = os.path.join(self.path, name)
            if os.path.exists(p):
                os.remove(p)

    def continue_metrics(self, step: int) -> int:
        """Keep the metrics of steps up to ``step`` (a resumed checkpoint's) and drop the rest,
        including a line cut short by a crash; return how many records were kept."""
        if not os.path.exists(self.metrics_path):
            return 0
        kept = []
        with open(self.metrics_path, "rb") as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                    kept.append(raw.rstrip(b"\n") + b"\n")
        tmp = self.metrics_path + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.metrics_path)
        return len(kept)

    def write_config(self, tree: dict) -> None:
        tmp = self.config_path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(tree, f, indent=1)
        os.replace(tmp, self.config_path)

    def release(self, *, remove_if_empty: bool = False) -> None:
        """Give up the lock; ``remove_if_empty``: a run that stopped before writing anything
        leaves no directory behind (when it made it)."""
        empty = remove_if_empty and not self.holds_a_run()
        self.lock.release(remove=empty)
