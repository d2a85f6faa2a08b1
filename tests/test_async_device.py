"""The CUDA paths' ordering, checked on CPU: ``AsyncCpuDevice`` treats CPU memory as a
separate device whose copies complete later on worker threads, with real events, and
poisons memory that is given back. Parity under it means every upload is waited for, every
download's source outlives the copy and no buffer is reused before its copy ran."""

import threading

import pytest
import torch

from reference import small_config
from test_parity import assert_parity
from tiertrain.state.device import AsyncCpuDevice
from tiertrain.train import Trainer


@pytest.mark.parametrize("case", ["states on disk, recompute", "host params and grads, kept graphs",
                                  "stash spilled, tied embedding", "engines"])
def test_parity_under_asynchronous_copies(tmp_path, case):
    kw = {
        "states on disk, recompute": dict(micro_batches=2),
        "host params and grads, kept graphs": dict(micro_batches=2, host_param_mib=64, grad_host_mib=64, keep_act_mib=64),
        "stash spilled, tied embedding": dict(micro_batches=1, tie=True, stash_host_mib=0),
        "engines": dict(micro_batches=2),
    }[case]
    cfg = small_config(tmp_path, kind="llama" if case == "engines" else "gpt", steps=3, **kw)
    if case == "engines":
        cfg.update.mode = "engines"
    dev = AsyncCpuDevice(delay=0.001)
    assert_parity(cfg, dev)


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
    """Counted on the test device (a sync counts when the host had to wait): with hidden
    states spilling to the file and parameters uploaded from host memory, a step of 4 blocks
    x 4 micro-batches (16 stash entries, each a download then a write) waits at most once per
    unit; before, every spilled entry synchronised on its put and on its free."""
    counts = {}
    for M in (1, 4):
        cfg = small_config(tmp_path / f"m{M}", layers=4, micro_batches=M, steps=3, host_param_mib=64, stash_host_mib=0)
        dev = AsyncCpuDevice(delay=0.002)
        with Trainer(cfg, device=dev) as tr:
            tr.initialize(progress=False)
            tr.train_step()
            before = dev.syncs
            tr.train_step()
            counts[M] = dev.syncs - before
            units = len(tr.layout.units)
    assert max(counts.values()) <= units < 4 * 4, counts
