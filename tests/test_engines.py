"""Update engines: exact math, overlap, faults, checkpoints."""

import os
import signal
import sys
import threading
import time

import pytest
import torch
from reference import reference_model, reference_train, small_config, weights_of
from test_parity import assert_parity, assert_same_weights, run_tiertrain

from tiertrain.training.trainer import Trainer
from tiertrain.update.engines import EngineError


def engine_config(tmp_path, **kw):
    cfg = small_config(tmp_path, **kw)
    cfg.update.mode = "engines"
    return cfg


@pytest.mark.parametrize(
    "paths,kind,micro_batches,ahead_mib",
    [(1, "gpt", 1, 1024), (1, "llama", 4, 0), (3, "gpt", 4, 1024), (3, "llama", 2, 0)],
)
@pytest.mark.slow
def test_engines_are_bit_identical_to_plain_pytorch(tmp_path, paths, kind, micro_batches, ahead_mib):
    """With the whole state read ahead during the backward (the default budget holds these
    models' state) and with no read-ahead."""
    cfg = engine_config(tmp_path, kind=kind, paths=paths, micro_batches=micro_batches)
    cfg.memory.engine_read_ahead_mib = ahead_mib
    ref_model = reference_model(cfg)
    ref_losses, ref_weights = reference_train(cfg, ref_model)
    losses, weights, tr = run_tiertrain(cfg, weights_of(ref_model))
    assert tr.engines is not None and tr.engines.n == paths
    assert tr.engines.stepped and all(r["ahead"] == (r["chunks"] if ahead_mib else 0) for r in tr.engines.stepped)
    assert losses == ref_losses
    assert_same_weights(tr, weights, ref_weights)


@pytest.mark.slow
def test_more_engines_than_paths_and_baseline_agree(tmp_path):
    cfg = engine_config(tmp_path / "e", micro_batches=2, steps=3)
    cfg.update.engines = 2  # two engines share the one path
    base = small_config(tmp_path / "b", micro_batches=2, steps=3)
    ref = weights_of(reference_model(base))
    l_e, w_e, _ = run_tiertrain(cfg, ref)
    l_b, w_b, _ = run_tiertrain(base, ref)
    assert l_e == l_b and all(torch.equal(w_e[k], w_b[k]) for k in w_b)


@pytest.mark.slow
def test_eager_engines_without_clipping(tmp_path):
    """With clipping off, engines update each unit as its gradient arrives: still exact."""
    cfg = engine_config(tmp_path, micro_batches=2, clip=0.0, steps=3)
    cfg.update.eager = True
    tr, losses = assert_parity(cfg)


@pytest.mark.slow
def test_bf16_engines_match_the_baseline_path_exactly(tmp_path):
    base = small_config(tmp_path / "b", micro_batches=2, steps=3, dtype="bfloat16")
    eng = engine_config(tmp_path / "e", micro_batches=2, steps=3, dtype="bfloat16", paths=2)
    ref = weights_of(reference_model(base))
    l_b, w_b, _ = run_tiertrain(base, ref)
    l_e, w_e, tr = run_tiertrain(eng, ref)
    assert l_e == l_b and all(torch.equal(w_e[k], w_b[k]) for k in w_b)


def test_eager_needs_clipping_off():
    from tiertrain.config import ConfigError, load_config

    with pytest.raises(
        ConfigError,
        match=r"update.eager = true needs update.mode = 'auto', 'overlap' or 'engines' and optim.grad_clip = 0",
    ):
        load_config(None, ["--update.mode=engines", "--update.eager=true"])


@pytest.mark.serial  # a bound in seconds: measured alone
def test_a_killed_engine_is_named_within_seconds_then_resume_works(tmp_path):
    cfg = engine_config(tmp_path, paths=2, steps=4, micro_batches=2)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        saved = tr.save_checkpoint()
        tr.train_step()  # its update now runs in the engines, under nothing
        victim = tr.engines.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.time()
        with pytest.raises(
            EngineError,
            match=rf"update engine 1 \({tmp_path}/ssd1\) died \(exit code -9\) while [^;]*$",
        ):
            tr.train_step()
        assert time.time() - t0 < 10
    with Trainer(cfg) as tr:  # new engines; the checkpoint brings the state back
        assert tr.restore(saved.path).step == 1
        tr.train_step()
        assert tr.step == 2


@pytest.mark.slow
def test_checkpoint_resume_with_engines_is_bit_identical(tmp_path):
    cfg = engine_config(tmp_path / "a", paths=2, steps=4, micro_batches=2)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        straight = [tr.train_step().loss for _ in range(4)]
        want = tr.weights()
    cfg = engine_config(tmp_path / "b", paths=2, steps=4, micro_batches=2)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        first = [tr.train_step().loss for _ in range(2)]
        saved = tr.save_checkpoint()
    base = small_config(tmp_path / "b", paths=2, steps=4, micro_batches=2)  # and across update paths
    with Trainer(base) as tr:
        tr.restore(saved.path)
        rest = [tr.train_step().loss for _ in range(2)]
        got = tr.weights()
    assert first + rest == straight
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_sgd_engines_bit_identical(tmp_path):
    cfg = engine_config(tmp_path, paths=2, micro_batches=2, steps=3, lr=0.05)
    cfg.optim.name = "sgd"
    tr, losses = assert_parity(cfg)


@pytest.mark.slow
def test_new_parameters_handed_straight_to_the_forward_with_read_ahead(tmp_path, monkeypatch):
    """Engines slower than the forward (a sleep per update chunk, in the engines only): the
    forward asks for units still being updated and the engines write them into its shared
    slots; the first chunks' state was read ahead during the backward; kept graphs (no
    recompute). Still bit-identical to plain PyTorch."""
    monkeypatch.setenv("TIERTRAIN_SLOW_AT", "update:0.01")  # read by the engine processes at start
    cfg = engine_config(tmp_path, kind="llama", micro_batches=2, steps=3, keep_act_mib=64, paths=2)
    cfg.memory.engine_read_ahead_mib = 1
    tr, _ = assert_parity(cfg)
    assert tr.engines.handoff_bytes > 0
    assert all(r["ahead"] > 0 for r in tr.engines.stepped)
    assert tr.executor.recomputed == 0


def test_a_pipe_broken_before_the_engines_exit_status_is_ready_is_named_not_raised_raw():
    """A killed engine's end of the pipe closes a moment before its exit status can be read:
    a command sent in that moment is one EngineError naming the engine and its exit (seen in
    the suite: a BrokenPipeError's traceback instead)."""
    import subprocess as sp
    import types

    from tiertrain.update.engines.client import EngineError, EngineUpdate

    class Conn:
        def send(self, msg):
            raise BrokenPipeError(32, "Broken pipe")

    class Proc:  # exits once waited for, as a killed process does
        returncode = None

        def poll(self):
            return self.returncode

        def wait(self, timeout=None):
            self.returncode = -9
            return -9

    fake = types.SimpleNamespace(conns=[Conn()], procs=[Proc()], paths=["/ssd0"], timeout=30.0, _seen=[time.time()])
    fake._check = lambda i, what: EngineUpdate._check(fake, i, what)
    with pytest.raises(EngineError, match=r"update engine 0 \(/ssd0\) died \(exit code -9\) while receiving a command"):
        EngineUpdate._send(fake, 0, "msg")

    class Stuck(Proc):  # never exits: the broken connection is named
        def wait(self, timeout=None):
            raise sp.TimeoutExpired("engine", timeout)

    fake.procs = [Stuck()]
    with pytest.raises(EngineError, match="closed its connection while receiving a command"):
        EngineUpdate._send(fake, 0, "msg")


def test_an_engine_that_exits_before_connecting_is_named_and_leaves_no_socket_directory(monkeypatch, tmp_path):
    """The start waits for every engine to connect, but not for one that has exited: it says
    how many connected and the exit codes, and removes its socket directory."""
    import tempfile

    from tiertrain.update.engines.sockets import PREFIX, launch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits 1 at once, never connects
    procs: list = []
    seen: list = []  # exceptions in threads (the accept thread's, once its listener closes, was printed)
    monkeypatch.setattr(threading, "excepthook", seen.append)
    with pytest.raises(EngineError, match=r"update engines did not start: 0 of 2 connected; exit codes \{[01]: 1"):
        launch([{}, {}], ["/ssd0", "/ssd1"], 60.0, procs)
    assert len(procs) == 2 and all(p.wait() == 1 for p in procs)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(PREFIX)]
    for _ in range(50):  # the accept thread returns once its listener is closed, quietly
        if not any(t.name == "tiertrain-engine-accept" for t in threading.enumerate()):
            break
        time.sleep(0.1)
    assert not any(t.name == "tiertrain-engine-accept" for t in threading.enumerate()) and not seen
