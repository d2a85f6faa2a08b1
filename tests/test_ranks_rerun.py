"""A 2-rank run that finished, started again: one line, from rank 0's view (it has checkpoints);
a mismatched checkpoint resumed on 2 ranks: its one line once."""

import os
import subprocess
import sys

import pytest
from reference import tiny_flags

from tiertrain.dist.launch import free_port

pytestmark = pytest.mark.slow  # ranks and engines in processes of their own

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_CK = "stopped before its first checkpoint"


def _tiertrain(*args, env=None):
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tiertrain", *args], capture_output=True, text=True, env=env, timeout=240
    )


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("tiertrain:")]


def test_a_finished_two_rank_run_started_again_is_refused_once_offering_resume(tmp_path):
    flags = tiny_flags(tmp_path)
    assert _tiertrain("train", "--nproc", "2", *flags).returncode == 0
    again = _tiertrain("train", "--nproc", "2", *flags)
    assert again.returncode == 1
    errors = _errors(again.stderr)
    assert len(errors) == 1, again.stderr[-3000:]
    assert NO_CK not in again.stderr and f"--resume {tmp_path / 'run'}`" in errors[0], errors
    # started as torchrun starts them (no launcher): rank 1 sees rank 0's checkpoints too
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tiertrain", "train", *flags],
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": ROOT,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in (0, 1)
    ]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert all(p.returncode == 1 for p in procs), errs
    for err in errs:
        assert NO_CK not in err and f"--resume {tmp_path / 'run'}`" in err, err[-3000:]
    # resumed at its last step: "nothing to train" once
    done = _tiertrain("train", "--nproc", "2", "--resume", str(tmp_path / "run"))
    assert done.returncode == 0 and done.stderr.count("nothing to train") == 1, done.stderr[-3000:]


def test_a_mismatched_checkpoint_on_two_ranks_is_said_once(tmp_path):
    assert _tiertrain("train", "--nproc", "2", *tiny_flags(tmp_path)).returncode == 0
    other = _tiertrain(
        "train",
        "--nproc",
        "2",
        "--resume",
        str(tmp_path / "run"),
        "--model.n_layers=3",
        f"--train.run_dir={tmp_path / 'other'}",
    )
    assert other.returncode == 1
    errors = _errors(other.stderr)
    assert len(errors) == 1 and "was written for another model" in errors[0], other.stderr[-3000:]
