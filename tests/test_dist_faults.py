"""Rank faults end within the promised time, with the rank named and no process left:
`tiertrain train --nproc 2` with rank 0 stopped (it holds the run's store), a signal to one
rank alone, the launcher killed, a hung rank, a stopped engine, rank 0 killed."""

import os
import signal
import subprocess
import time

import psutil
import pytest
from test_dist_train import _rank_pid, _start_ranks, _steps_done
from test_signals import wait_for


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ranks_of(proc) -> list[int]:
    wait_for(lambda: len(psutil.Process(proc.pid).children()) == 2)
    return [_rank_pid(proc, r) for r in (0, 1)]


def _end(proc, pids: list[int], timeout: float) -> str:
    """The run's stderr once it has ended, within ``timeout`` s (else every process is killed and
    the test fails: the run would have gone on for ever)."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *pids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        err = proc.communicate()[1]
        pytest.fail(f"the run had not ended after {timeout} s:\n{err[-3000:]}")


@pytest.mark.serial  # a bound in seconds: measured alone
def test_a_stopped_rank_0_is_named_and_the_run_ends_within_the_timeout(tmp_path):
    """Rank 0, which holds the run's store, stopped with SIGSTOP: rank 1's collective times out
    (ranks.timeout_s = 6), its lookup of the culprit is bounded (it read the store rank 0 holds,
    which never answers: the run hung for ever, with no message), it names rank 0 as stopped,
    and the launcher kills rank 0."""
    proc = _start_ranks(tmp_path, "--train.steps=100000", "--ranks.timeout_s=6")
    wait_for(lambda: _steps_done(tmp_path) >= 2)
    pids = _ranks_of(proc)
    t0 = time.monotonic()
    os.kill(pids[0], signal.SIGSTOP)
    err = _end(proc, pids, 60)
    took = time.monotonic() - t0
    print(f"ended in {took:.1f} s")
    assert proc.returncode == 1, err[-3000:]
    assert f"rank 0 is not responding: its process {pids[0]} is stopped" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert took < 6 + 4 + 5, (took, err[-3000:])  # the timeout, 2 s (4 at most) to name it, exits
    assert not any(_alive(p) for p in pids)
