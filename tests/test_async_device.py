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


def test_pinned_host_memory_is_registered_in_place_for_what_the_pool_reports(monkeypatch):
    """Pinned buffers are page-locked where they are (cudaHostRegister of the 4 KiB-rounded
    size), not taken from torch's pinned allocator, which rounds a request up to a power of
    two; they are unregistered when the last tensor over them goes. CUDA is faked here."""
    import gc

    from tiertrain.io import aligned_empty

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    t = aligned_empty(5 * 2**20 + 5, pin=True)  # a power-of-two allocator would pin 8 MiB
    assert t.numel() == 5 * 2**20 + 5
    assert calls == [("register", t.data_ptr(), 5 * 2**20 + 4096)]
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert calls[-1] == ("unregister", ptr)


def test_pools_do_not_pin_unless_asked(tmp_path):
    """A CPU run on a machine with a GPU must not create a CUDA context through its pools: a
    whole CPU step leaves CUDA uninitialised (meaningful on a GPU machine; on a CPU build the
    pools' own setting is what is checked)."""
    from tiertrain.io import BufferPool

    assert BufferPool(2, 4096).pinned is False
    cfg = small_config(tmp_path, steps=1, grad_host_mib=1, stash_host_mib=0)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        assert not tr.dev.pin and not tr.stash._spill.pinned
    assert not torch.cuda.is_initialized()


def test_mfu_figures_and_the_gpu_capacity_check(monkeypatch):
    from tiertrain.config import ConfigError, ModelConfig
    from tiertrain.metrics import flops_per_token, peak_flops
    from tiertrain.models import build_model
    from tiertrain.state.device import CudaDevice

    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA GeForce GTX 1080") is None
    model, _ = build_model(ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=256, max_seq_len=32),
                           param_dtype=torch.float32, seed=0)
    # by hand: a block's weights are 2 LayerNorms (2 x 128), qkv 64x192+192, proj 64x64+64, fc 64x256+256 and
    # out 256x64+64 = 49,984; the head's LayerNorm 128 and lm_head 256x64; no input embedding:
    # 6 x (2 x 49,984 + 16,512) + attention 12 x 2 layers x 64 x 32 = 698,880 + 49,152
    assert flops_per_token(model, 32, 64) == 748_032
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (2 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Fake GPU")
    fake = type("D", (), {"device": torch.device("cuda", 0)})()
    CudaDevice.check_capacity(fake, {"slots": 1 << 30})
    with pytest.raises(ConfigError, match=r"the GPU \(Fake GPU\) has 2.00 GiB free of 80.00 GiB; this run needs "
                                          r"3.00 GiB there before activations \(slots 3.00 GiB\): lower"):
        CudaDevice.check_capacity(fake, {"slots": 3 << 30})
