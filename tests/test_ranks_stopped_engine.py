"""An engine of rank 1 stopped (SIGSTOP) where ranks.timeout_s < update.engine_timeout_s: the
engine is named (not its rank), and no engine is left behind; a stopped engine whose rank is
killed goes with it."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from reference import tiny_flags

pytestmark = pytest.mark.slow  # ranks and engines in processes of their own

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(tmp_path, *extra):
    flags = tiny_flags(
        tmp_path, "--update.mode=engines", "--checkpoint.every=0", "--checkpoint.at_end=false", *extra, steps=100000
    )
    # (stderr to a file: a stopped engine left behind holds a pipe open, and reading it never ends)
    with open(tmp_path / "err.log", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "tiertrain", "train", "--nproc", "2", *flags],
            stderr=err,
            env={**os.environ, "PYTHONPATH": ROOT},
            start_new_session=True,
        )


def _rank1_and_engine(proc, tmp_path):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = tmp_path / "run" / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 3:
            for rank in psutil.Process(proc.pid).children():
                try:  # (a process that exits meanwhile, or whose environment cannot be read: the next look)
                    if rank.environ().get("RANK") == "1":
                        engines = [c for c in rank.children() if any("engines.worker" in a for a in c.cmdline())]
                        if engines:
                            return rank, engines[0]
                except psutil.Error:
                    continue
        assert proc.poll() is None, (tmp_path / "err.log").read_text()[-3000:]  # the run ended: why
        time.sleep(0.2)
    raise AssertionError("no step or engine of rank 1")


def _gone(p: psutil.Process, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def _cleanup(*procs):
    for p in procs:
        if p.is_running():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()


def test_a_stopped_engine_is_named_before_its_rank_times_out(tmp_path):
    proc = _start(tmp_path, "--ranks.timeout_s=20", "--update.engine_timeout_s=60")  # (margins for a loaded machine)
    rank, engine = _rank1_and_engine(proc, tmp_path)
    try:
        engine.suspend()
        assert proc.wait(timeout=90) == 1
        err = (tmp_path / "err.log").read_text()
        assert "update engine 0 (" in err and "has not answered" in err, err[-3000:]
        assert _gone(engine, 5), "the stopped engine was left behind"
    finally:
        _cleanup(engine, rank)


def test_a_stopped_engine_goes_with_its_killed_rank(tmp_path):
    proc = _start(tmp_path)
    rank, engine = _rank1_and_engine(proc, tmp_path)
    try:
        engine.suspend()
        rank.kill()
        proc.wait(timeout=60)
        assert _gone(engine, 5), "the stopped engine outlived its rank"
    finally:
        _cleanup(engine, rank)
