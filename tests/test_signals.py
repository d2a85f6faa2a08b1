"""Signals and crashes: Ctrl-C and SIGTERM finish the step and save; nothing is left behind
by a stop, a failed start or a SIGKILL, with or without update engines."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from reference import small_config, tiny_flags

from tiertrain.checkpoint import Manifest, latest_checkpoint
from tiertrain.training.trainer import Trainer
from tiertrain.update.engines import EngineError

ROOT = os.path.dirname(os.path.dirname(__file__))


def private_tmp(tmp_path):
    """A TMPDIR of the test's own, short enough for the engines' Unix socket (107 bytes) even where
    pytest's folders are deep (xdist workers): a link from /tmp to the test's folder."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    link = f"/tmp/tt-{hashlib.sha1(str(tmp_path).encode()).hexdigest()[:12]}"
    if not os.path.islink(link):
        os.symlink(tmp_path / "tmp", link)
    return link


def start(tmp_path, *flags, env=None, **kw):
    e = dict(os.environ, TMPDIR=private_tmp(tmp_path))
    e.pop("TIERTRAIN_KILL_AT", None)
    e.update(env or {})
    # Ctrl-C's default action in the child even where the suite runs as a background job (a
    # non-interactive shell starts those with SIGINT ignored, and Python keeps an inherited SIG_IGN)
    return subprocess.Popen(
        [sys.executable, "-m", "tiertrain.cli", "train", *tiny_flags(tmp_path, *flags)],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=e,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **kw,
    )


def wait_for(cond, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and not cond():
        time.sleep(0.1)
    assert cond()


def engine_pids(tmp_path):
    """Processes started with our private TMPDIR in their command line (the engines)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if "tiertrain" in cmd and private_tmp(tmp_path) in cmd:
            found.append(int(pid))
    return found


def shm_names():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C to the group, engines"])
def test_a_signal_finishes_the_step_saves_and_says_how_to_resume(tmp_path, how):
    engines = how.endswith("engines")
    flags = ["--train.steps=100000"] + (["--update.mode=engines"] if engines else [])
    proc = start(tmp_path, *flags, start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
    if engines:  # what a terminal does: SIGINT to every process of the foreground group
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-3000:]
    steps = len(metrics.read_text().splitlines())
    assert f"interrupted after step {steps} ({'Ctrl-C' if engines else 'SIGTERM'})" in err
    assert f"resume with: tiertrain train --resume {tmp_path / 'run'}" in err
    assert "Traceback" not in err and "EngineError" not in err, err[-3000:]
    ck = latest_checkpoint(str(tmp_path / "run" / "checkpoints"))
    assert ck is not None and Manifest.read(ck).step == steps
    assert not (tmp_path / "ssd").exists()  # scratch files and lock gone with the directory the run made
    assert engine_pids(tmp_path) == [] and not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("tiertrain")]


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_names_the_checkpoint_to_resume(tmp_path):
    """Found from outside: a second SIGTERM stopped the run at once with a bare "tiertrain:
    interrupted" (the first names the resume command); it names the last checkpoint and the command."""
    proc = start(tmp_path, "--train.steps=100000", "--checkpoint.every=1", env={"TIERTRAIN_SLOW_AT": "update:0.2"})
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("tiertrain:")][-1]
    assert line.startswith("tiertrain: interrupted (stopped at once; the last checkpoint is "), err[-3000:]
    assert f"`tiertrain train --resume {tmp_path / 'run'}`)" in line, line


@pytest.mark.serial  # /dev/shm is the machine's: another test's segments would come and go
def test_ctrl_c_during_start_up_leaves_nothing(tmp_path):
    before = shm_names()
    proc = start(tmp_path, "--update.mode=engines", env={"TIERTRAIN_SLOW_AT": "start:60"})
    # the engines have connected once their socket directory is gone
    wait_for(
        lambda: engine_pids(tmp_path) and not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("tiertrain")]
    )
    time.sleep(1.0)  # the trainer sleeps at the end of its start-up
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err[-3000:]
    assert err.splitlines()[-1] == "tiertrain: interrupted" and "Traceback" not in err, err[-3000:]
    wait_for(lambda: engine_pids(tmp_path) == [], timeout=20)
    assert sorted(os.listdir(tmp_path)) == ["tmp"] and not [
        n for n in os.listdir(tmp_path / "tmp") if n.startswith("tiertrain")
    ]
    assert shm_names() <= before


@pytest.mark.serial  # /dev/shm is the machine's: another test's segments would come and go
def test_sigkill_of_a_trainer_with_engines_leaves_nothing(tmp_path):
    """Its engines notice, exit without a traceback, and neither the socket directory nor a
    shared-memory segment is left."""
    before = shm_names()
    proc = start(tmp_path, "--update.mode=engines", "--train.steps=4", env={"TIERTRAIN_KILL_AT": "forward:10"})
    err = proc.communicate(timeout=120)[1]  # returns once the engines, which share the pipe, are gone too
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert "Traceback" not in err and "ConnectionResetError" not in err, err[-3000:]
    wait_for(lambda: engine_pids(tmp_path) == [], timeout=20)
    assert not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("tiertrain")]
    assert shm_names() <= before


@pytest.mark.slow
def test_an_engine_failing_on_a_checksum_is_one_error_and_cleanup_still_runs(tmp_path):
    cfg = small_config(tmp_path, steps=4, micro_batches=2)
    cfg.update.mode = "engines"
    with pytest.raises(
        EngineError,
        match=r"update engine 0 \(.*ssd0\) failed: ChecksumError: checksum mismatch in "
        r".*engine0\.exp_avg\.bin .*; the file is corrupt$",  # what to run next: the command line's, knowing the checkpoints
    ):
        with Trainer(cfg) as tr:
            tr.initialize(progress=False)
            tr.train_step()
            tr.engines.wait_all()
            f = tmp_path / "ssd0" / "engine0.exp_avg.bin"
            with open(f, "r+b") as fh:  # behind the engine's back: its next read of this block fails
                fh.seek(4096)
                b = fh.read(1)
                fh.seek(4096)
                fh.write(bytes([b[0] ^ 0xFF]))
            procs = list(tr.engines.procs)
            for _ in range(3):
                tr.train_step()
            tr.engines.wait_all()
    assert all(p.poll() is not None for p in procs)  # close() ran to the end: every engine stopped
    assert not (tmp_path / "ssd0").exists()


@pytest.mark.slow
def test_eager_engines_report_their_work_and_shut_down_quietly(tmp_path):
    proc = start(tmp_path, "--update.mode=engines", "--update.eager=true", "--optim.grad_clip=0", "--train.steps=3")
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, err[-3000:]
    assert "BufferError" not in err and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(r["extra"]["engine_read_bytes"] > 0 and r["extra"]["engine_update_s"] > 0 for r in recs[1:]), recs


@pytest.mark.slow
def test_a_dead_engine_is_one_line_naming_it_and_the_checkpoint(tmp_path):
    proc = start(tmp_path, "--update.mode=engines", "--train.steps=100000", "--checkpoint.every=1")
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
    pid = engine_pids(tmp_path)[0]
    os.kill(pid, signal.SIGKILL)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "\r" not in err, err[-3000:]  # no traceback; no progress bar in a pipe
    last = err.splitlines()[-1]
    assert last.startswith("tiertrain: update engine 0 (") and "died (exit code -9)" in last, last
    assert f"(the last checkpoint is {tmp_path / 'run' / 'checkpoints'}/step-" in last
    assert f"`tiertrain train --resume {tmp_path / 'run'}`" in last
