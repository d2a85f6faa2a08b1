"""The CUDA paths' ordering, checked on CPU: ``AsyncCpuDevice`` treats CPU memory as a
separate device whose copies complete later on worker threads, with real events, and
poisons memory that is given back. Parity under it means every upload is waited for, every
download's source outlives the copy and no buffer is reused before its copy ran."""

import threading

import pytest
import torch
from reference import small_config
from test_parity import assert_parity

from tiertrain.device import AsyncCpuDevice, LagCpuDevice
from tiertrain.training.trainer import Trainer


@pytest.mark.parametrize(
    "make_dev", [lambda: AsyncCpuDevice(delay=0.001), lambda: LagCpuDevice(lag=16)], ids=["threads", "clock"]
)
@pytest.mark.parametrize(
    "case",
    ["states on disk, recompute", "host params and grads, kept graphs", "stash spilled, tied embedding", "engines"],
)
@pytest.mark.slow
def test_parity_under_asynchronous_copies(tmp_path, case, make_dev):
    kw = {
        "states on disk, recompute": dict(micro_batches=2),
        "host params and grads, kept graphs": dict(
            micro_batches=2, host_param_mib=64, grad_host_mib=64, keep_act_mib=64
        ),
        "stash spilled, tied embedding": dict(micro_batches=1, tie=True, stash_host_mib=0),
        "engines": dict(micro_batches=2),
    }[case]
    cfg = small_config(tmp_path, kind="llama" if case == "engines" else "gpt", steps=3, **kw)
    if case == "engines":
        cfg.update.mode = "engines"
    assert_parity(cfg, make_dev())


def test_the_test_device_catches_a_missing_wait(tmp_path, monkeypatch):
    """Without the compute stream's wait for a slot's upload, the slot still holds the poison
    of its last eviction (or a half-done copy): the losses are no longer those of PyTorch."""
    cfg = small_config(tmp_path, micro_batches=2, steps=2, slots=2)
    dev = AsyncCpuDevice(delay=0.01)
    monkeypatch.setattr(dev, "wait", lambda ev: None)
    with pytest.raises(AssertionError):
        assert_parity(cfg, dev)


def test_tied_embedding_with_spilled_gradients_does_not_hang(tmp_path):
    """Three gradient buffers are in flight with a tied embedding (head, block, embedding);
    with gradients spilling to the file, each needs a staging buffer: the backward must not
    wait on staging that only it could free."""
    cfg = small_config(tmp_path, tie=True, micro_batches=2, steps=2, grad_host_mib=0)
    done = []

    def run():
        with Trainer(cfg, device=AsyncCpuDevice(delay=0.001)) as tr:
            tr.initialize(progress=False)
            for _ in range(2):
                tr.train_step()
        done.append(True)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=120)
    assert done, "the backward hung"


def test_host_synchronisations_are_bounded_by_units_not_micro_batches(tmp_path):
    """Counted on the logical-clock device (a sync counts when its copy is not yet due, the
    same on every machine; copies take 16 of the host's device calls): with hidden states
    spilling to the file and parameters uploaded from host memory, a step of 4 blocks x 4
    micro-batches (16 stash entries, each a download then a write) waits at most once per
    unit; before, every spilled entry synchronised on its put and on its free. (Counted on
    ``AsyncCpuDevice``'s real delays instead, a slow CI machine waited at 14 sync points
    where this one waited at 6.)"""
    counts = {}
    for M in (1, 4):
        cfg = small_config(tmp_path / f"m{M}", layers=4, micro_batches=M, steps=3, host_param_mib=64, stash_host_mib=0)
        dev = LagCpuDevice(lag=16)
        with Trainer(cfg, device=dev) as tr:
            tr.initialize(progress=False)
            tr.train_step()
            before = dev.syncs
            tr.train_step()
            counts[M] = dev.syncs - before
            units = len(tr.layout.units)
    assert max(counts.values()) <= units < 4 * 4, counts


def test_the_logical_clock_device_catches_a_missing_wait(tmp_path, monkeypatch):
    cfg = small_config(tmp_path, micro_batches=2, steps=2, slots=2)
    dev = LagCpuDevice(lag=16)
    monkeypatch.setattr(dev, "wait", lambda ev: None)
    with pytest.raises(AssertionError):
        assert_parity(cfg, dev)


def test_the_logical_clock_device_counts_a_sync_right_after_its_copy():
    dev = LagCpuDevice(lag=3)
    src, dst = torch.ones(4), torch.zeros(4)
    ev = dev.upload(dst, src)
    assert not dev.done(ev) and torch.equal(dst, torch.zeros(4))  # not run yet: one tick later
    dev.sync(ev)
    assert dev.syncs == 1 and torch.equal(dst, src)
    ev = dev.upload(dst, src * 2)
    for _ in range(3):
        dev.done(None)  # three calls: the copy is due and has run by itself
    dev.sync(ev)
    assert dev.syncs == 1 and torch.equal(dst, src * 2)
    with pytest.raises(ValueError, match="lag=0"):
        LagCpuDevice(lag=0)
