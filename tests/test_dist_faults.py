"""Rank faults end within the promised time, with the rank named and no process left:
`tiertrain train --nproc 2` with rank 0 stopped (it holds the run's store), a signal to one
rank alone, the launcher killed, a hung rank, a stopped engine, rank 0 killed."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from test_dist_train import _final, _rank_pid, _start_ranks, _steps_done
from test_signals import engine_pids, start, wait_for


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ranks_of(proc) -> list[int]:
    def found() -> list[int] | None:
        try:  # (a child between its fork and its exec has the launcher's environment: no RANK yet)
            return [_rank_pid(proc, r) for r in (0, 1)]
        except (AssertionError, psutil.Error):
            return None

    wait_for(lambda: found() is not None)
    return found()


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


def _stopped_by(proc, pids: list[int], target: int, sig: int, timeout: float) -> tuple[str, float]:
    """Send ``sig`` to process ``target``; the run's stderr once it has ended (``_end``) and the
    seconds it took from the signal."""
    t0 = time.monotonic()
    os.kill(target, sig)
    err = _end(proc, pids, timeout)
    took = time.monotonic() - t0
    print(f"ended in {took:.1f} s")
    return err, took


@pytest.mark.serial  # a bound in seconds: measured alone
def test_a_stopped_rank_0_is_named_and_the_run_ends_within_the_timeout(tmp_path):
    """Rank 0, which holds the run's store, stopped with SIGSTOP: rank 1's collective times out
    (ranks.timeout_s = 6), its lookup of the culprit is bounded (it read the store rank 0 holds,
    which never answers: the run hung for ever, with no message), it names rank 0 as stopped,
    and the launcher kills rank 0."""
    proc = _start_ranks(tmp_path, "--train.steps=100000", "--ranks.timeout_s=6")
    wait_for(lambda: _steps_done(tmp_path) >= 2)
    pids = _ranks_of(proc)
    err, took = _stopped_by(proc, pids, pids[0], signal.SIGSTOP, 60)
    assert proc.returncode == 1, err[-3000:]
    assert f"rank 0 is not responding: its process {pids[0]} is stopped" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert took < 6 + 4 + 5, (took, err[-3000:])  # the timeout, 2 s (4 at most) to name it, exits
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
@pytest.mark.parametrize("sig,rank", [(signal.SIGINT, 1), (signal.SIGTERM, 0)])
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, sig, rank):
    """Ctrl-C or SIGTERM to one rank alone (as torchrun users signal any process): every rank
    stops after the same step, which is saved once, and the run exits 130 with one resume command
    (the signalled rank saved alone while the other started the next step: both waited out the
    timeout, and the run failed "rank 1 died")."""
    import re

    proc = _start_ranks(
        tmp_path, "--train.steps=100000", "--ranks.timeout_s=30", env={"TIERTRAIN_SLOW_AT": "forward:0.1"}
    )
    wait_for(lambda: _steps_done(tmp_path) >= 2)
    pids = _ranks_of(proc)
    err, took = _stopped_by(proc, pids, pids[rank], sig, 25)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.count("tiertrain: interrupted") == 1, err[-3000:]
    assert re.findall(r"resume with: (.*)", err) == [f"tiertrain train --resume {tmp_path / 'run'} --nproc 2"]
    assert _final(tmp_path)[0] == _steps_done(tmp_path)  # the step every rank stopped after, saved
    assert took < 20, took  # a step and a save (measured about 1 s)
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
def test_ranks_end_with_their_launcher(tmp_path):
    """The launcher killed (SIGKILL) while the ranks are in a long step (30 s in a forward): every
    rank stops at once and cleans up (its scratch directory removed, its locks released); they
    finished the step and saved, as for a Ctrl-C, training on as orphans meanwhile."""
    env = {"TIERTRAIN_SLOW_AT": "forward:30:9"}  # step 3's first forward
    proc = _start_ranks(tmp_path, "--train.steps=100000", "--ranks.timeout_s=60", env=env)
    wait_for(lambda: _steps_done(tmp_path) >= 2)
    pids = _ranks_of(proc)
    time.sleep(1)  # into step 3's forward
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    try:
        wait_for(lambda: not any(_alive(p) for p in pids), timeout=60)
    finally:
        for p in filter(_alive, pids):
            os.kill(p, signal.SIGKILL)
        proc.communicate()
    took = time.monotonic() - t0
    print(f"ranks gone {took:.1f} s after the launcher")
    assert took < 10, took  # measured 0.2 s
    assert not any((tmp_path / "ssd" / f"rank{r}").exists() for r in (0, 1)), os.listdir(tmp_path / "ssd")


def test_a_rank_stuck_past_its_launcher_ends_itself(tmp_path):
    """Where the SIGTERM of the launcher's death cannot stop a rank (here ignored; a rank stuck
    where no signal handler runs), the rank ends itself a bounded time later."""
    code = (
        "import os, signal, time\n"
        "os.environ['TIERTRAIN_LAUNCHED'] = str(os.getppid() + 100000)\n"  # not its parent: the launcher is gone
        "import tiertrain.dist.launch as launch\n"
        "launch._ORPHAN_GRACE_S = 0.5\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "launch.end_with_launcher(period=0.1)\n"
        "print('watching', flush=True)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert r.stdout == "watching\n" and r.returncode == 1 and time.monotonic() - t0 < 30, r.stderr[-3000:]


@pytest.mark.serial  # a bound in seconds: measured alone
def test_a_hung_rank_ends_the_run_within_the_timeout_and_a_few_seconds(tmp_path):
    """Rank 1 hangs (sleeps 60 s) in step 3: rank 0 names it after ranks.timeout_s = 6 and the
    naming window, and the launcher kills it a second after rank 0 stopped (the run took about
    twice the timeout and more: closing the parameter store waited out a second gather, and the
    launcher gave the hung rank the timeout again and 5 s)."""
    proc = _start_ranks(
        tmp_path,
        "--train.steps=100000",
        "--ranks.timeout_s=6",
        env={"TIERTRAIN_SLOW_AT": "backward:60:9", "TIERTRAIN_SLOW_RANK": "1"},
    )
    pids = _ranks_of(proc)
    err = _end(proc, pids, 60)
    took = time.time() - (tmp_path / "run" / "metrics.jsonl").stat().st_mtime  # from step 2's record on
    print(f"ended {took:.1f} s after step 2's record")
    assert proc.returncode == 1, err[-3000:]
    assert "rank 1 is alive but has not reached this collective: it is at step 3" in err, err[-3000:]
    assert _final(tmp_path)[0] == 2
    assert took < 6 + 2 + 5, (took, err[-3000:])  # measured 9.4 s
    assert not any(_alive(p) for p in pids)


@pytest.mark.serial  # a bound in seconds: measured alone
def test_a_stopped_engine_ends_the_run_when_its_error_says(tmp_path):
    """An update engine stopped with SIGSTOP: the error says it has not answered for 3 s
    (update.engine_timeout_s), and the run ends then, not 10 s later (closing waited for the
    stopped engine to stop); the engine is killed."""
    proc = start(
        tmp_path, "--update.mode=engines", "--train.steps=100000", "--checkpoint.every=1", "--update.engine_timeout_s=3"
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
    pids = engine_pids(tmp_path)
    err, took = _stopped_by(proc, pids, pids[0], signal.SIGSTOP, 60)
    assert proc.returncode == 1, err[-3000:]
    assert "update engine 0 (" in err and "has not answered for 3 s" in err, err[-3000:]
    assert took < 3 + 4, (took, err[-3000:])  # measured 3.2 s
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
def test_a_dead_rank_0_is_one_line_naming_it(tmp_path):
    """Rank 0 killed (SIGKILL): rank 1's error is one line naming rank 0 as dead, without the C++
    trace of the store's failure or gloo's own text (a 12-frame TCPStore trace, and gloo's source
    location and advice inside the line); no rank is left."""
    proc = _start_ranks(tmp_path, "--train.steps=100000", "--ranks.timeout_s=30")
    wait_for(lambda: _steps_done(tmp_path) >= 2)
    pids = _ranks_of(proc)
    os.kill(pids[0], signal.SIGKILL)
    err = _end(proc, pids, 60)
    assert proc.returncode == 1, err[-3000:]
    said = [line for line in err.splitlines() if " INFO " not in line]
    assert len(said) == 2, said  # rank 1's error, the launcher's line
    assert said[0].startswith("tiertrain: rank 1 of 2: ") and "rank 0 died" in said[0], said
    assert said[1] == "tiertrain: rank 0 of 2 was ended by SIGKILL; the other ranks were stopped", said
    assert not any(_alive(p) for p in pids)


def test_gloo_text_is_cut_to_what_happened():
    from tiertrain.dist.group import _cause

    closed = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:8103. This is typically caused by a remote worker crashing. Check the logs of the remote "
        "worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
    )
    assert _cause(closed) == "Connection closed by peer [127.0.0.1]:8103"
    timed_out = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting "
        "10000ms for send operation to complete"
    )
    assert _cause(timed_out) == "Timed out waiting 10000ms for send operation to complete"
    assert _cause(RuntimeError("")) == "RuntimeError"


def test_a_signal_arriving_while_the_ranks_agree_waits_for_the_next_boundary():
    """The stop is agreed on the signal number each rank read before the all-reduce: one that
    lands during it is taken at the next boundary by every rank alike (it was read again after
    the all-reduce, and a 0 from the others was named as a signal: ValueError, a traceback)."""
    from tiertrain.training.interrupt import StopFlag

    stop = StopFlag(announce=False)

    class Group:  # the signal arrives while the collective runs; the other rank had none
        def max(self, value):
            stop._handler(signal.SIGINT, None)
            return value

    assert stop.agreed(Group()) == ""  # this boundary: no rank had a signal when it asked
    assert stop.agreed(type("G", (), {"max": lambda self, v: v})()) == "Ctrl-C"  # the next one stops

    other = StopFlag(announce=False)  # a signal that reached another rank only
    assert other.agreed(type("G", (), {"max": lambda self, v: max(v, int(signal.SIGTERM))})()) == (
        "SIGTERM to another rank"
    )


class _FailedRead:
    def done(self) -> bool:
        return True

    def get(self, timeout=None):
        raise OSError("EIO: unit 0's shard")


class _Inner:
    dtype = torch.float32

    def on_host(self, u):
        return False

    def load(self, u, out):
        return _FailedRead()


class _Halves:
    def shard(self, u, out):
        return out[: out.numel() // 2]


class _Group:
    def __init__(self):
        self.gathers = 0

    def start_all_gather(self, out, shard):
        self.gathers += 1
        return object()

    def wait(self, work, name):
        pass


def test_a_failed_shard_read_is_raised_again_when_asked_twice():
    """The collective is still issued (the other ranks wait on it), and a second ``get`` of the
    same unit raises the read's error again, never a bookkeeping error that hides it."""
    from tiertrain.dist.shard import ShardedParams

    group = _Group()
    params = ShardedParams(_Inner(), _Halves(), group)
    fut = params.load(0, torch.zeros(8))
    for _ in range(2):
        with pytest.raises(OSError, match="EIO: unit 0"):
            fut.get()
    assert group.gathers == 1


@pytest.mark.slow
def test_cuda_asked_of_ranks_without_a_gpu_is_the_one_rank_error(tmp_path):
    """--nproc 2 --train.device=cuda on a CPU build: 55 lines of two ranks' tracebacks ending in
    ZeroDivisionError (the GPU of rank r taken modulo no devices), where one rank says one line."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    proc = _start_ranks(tmp_path, "--train.device=cuda")
    err = _end(proc, [], 120)
    assert proc.returncode != 0
    assert "Traceback" not in err and "ZeroDivisionError" not in err, err[-3000:]
    assert "train.device = 'cuda' but " in err and "use --train.device=cpu" in err, err[-3000:]


def _joined(pid: int) -> int:
    """How many ranks have joined the process group (the launcher's marks, ``mark_joined``)."""
    where = psutil.Process(pid).environ().get("TIERTRAIN_JOINED", "")
    return len(os.listdir(where)) if where and os.path.isdir(where) else 0


def _rank_0_waits_for_rank_1(proc):
    """Both ranks started, rank 1 held before it joins (``join`` slowed), rank 0 in the rendezvous
    (its store listening; C++, where no signal handler runs)."""
    pids = _ranks_of(proc)
    wait_for(lambda: any(c.status == psutil.CONN_LISTEN for c in psutil.Process(pids[0]).net_connections()))
    assert _joined(pids[1]) == 0
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("to", ["rank 1", "launcher"])
def test_a_signal_while_the_ranks_start_ends_the_run_at_once(tmp_path, to):
    """Ctrl-C to one rank, or to the launcher, while the ranks start (rank 1 not yet in the
    process group): every rank ends at once and the run exits 130, saying "interrupted" once.
    Rank 0 waited out ranks.timeout_s in the rendezvous (300 s by default), and Ctrl-C to the
    launcher could not stop it; a rank signalled while importing printed a traceback."""
    proc = _start_ranks(
        tmp_path, "--ranks.timeout_s=120", env={"TIERTRAIN_SLOW_AT": "join:60", "TIERTRAIN_SLOW_RANK": "1"}
    )
    pids = _rank_0_waits_for_rank_1(proc)
    err, took = _stopped_by(proc, pids, pids[1] if to == "rank 1" else proc.pid, signal.SIGINT, 30)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.count("tiertrain: interrupted") == 1, err[-3000:]
    if to == "rank 1":
        assert "tiertrain: interrupted (rank 1 of 2, before the ranks had started" in err, err[-3000:]
    assert took < 10, (took, err[-3000:])
    assert not any(_alive(p) for p in pids)
    assert _steps_done(tmp_path) == 0


@pytest.mark.slow
def test_a_signal_to_one_rank_while_the_trainer_starts_stops_every_rank_before_step_1(tmp_path):
    """Ctrl-C to rank 1 once the group has formed, while its trainer is being built: every rank
    stops at the first step boundary, exit 130, one "interrupted" (it ended rank 1 alone at once,
    and rank 0 failed on it: "rank 1 died", exit 1)."""
    proc = _start_ranks(
        tmp_path, "--ranks.timeout_s=60", env={"TIERTRAIN_SLOW_AT": "start:8", "TIERTRAIN_SLOW_RANK": "1"}
    )
    pids = _ranks_of(proc)
    wait_for(lambda: _joined(pids[1]) == 2, timeout=60)
    err, took = _stopped_by(proc, pids, pids[1], signal.SIGINT, 60)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "died" not in err, err[-3000:]
    assert err.count("tiertrain: interrupted") == 1, err[-3000:]
    assert "stopping once the ranks have started" not in err  # (rank 1 alone was signalled: rank 0 speaks)
    assert "interrupted after step 0 (Ctrl-C to another rank)" in err, err[-3000:]
    assert _steps_done(tmp_path) == 0
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
@pytest.mark.parametrize("held", ["slowed", "stopped"])
def test_a_second_ctrl_c_ends_ranks_waiting_in_a_collective(tmp_path, held):
    """Two Ctrl-C to the launcher while rank 1 is in a long forward (slowed), or stopped (SIGSTOP),
    and rank 0 waits for it in a collective, where no signal handler runs: the run ends within
    seconds of the second, exit 130 (rank 0 waited out ranks.timeout_s for a stopped rank 1; for a
    slowed one, which stopped at once, it failed "rank 1 died", exit 1)."""
    env = {"TIERTRAIN_SLOW_AT": "forward:0.1", "TIERTRAIN_SLOW_RANK": "1"}
    if held == "slowed":
        env["TIERTRAIN_SLOW_AT"] = "forward:100:9"  # step 3's first forward
    proc = _start_ranks(tmp_path, "--train.steps=100000", "--ranks.timeout_s=120", env=env)
    wait_for(lambda: _steps_done(tmp_path) >= 2, timeout=120)
    pids = _ranks_of(proc)
    if held == "stopped":
        os.kill(pids[1], signal.SIGSTOP)
    time.sleep(2)  # rank 0 waiting for rank 1 in a collective
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(1)
    err, took = _stopped_by(proc, pids, proc.pid, signal.SIGINT, 30)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.count("tiertrain: interrupted") == 1, err[-3000:]
    assert took < 3 + 4, (took, err[-3000:])
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
def test_a_config_error_of_every_rank_is_said_once_with_the_config_status(tmp_path):
    """A setting refused as the trainer builds its model (every rank finds it): each rank said it,
    and the run exited 1; rank 0 says it, once, and the run exits 2 as one process does (found from
    outside)."""
    proc = _start_ranks(tmp_path, "--model.kind=gpt", "--model.layer_pieces=3")
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 2, err[-3000:]
    assert err.count("tiertrain: config error: model.layer_pieces = 3") == 1 and "Traceback" not in err, err[-3000:]
