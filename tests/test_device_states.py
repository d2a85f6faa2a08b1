"""Optimizer states in device memory (``memory.optim_device_mib``, ``update/on_device.py``),
checked on CPU through the simulated device (``AsyncCpuDevice``: memory of its own whose copies
complete later on worker threads): the same math as plain PyTorch, bit for bit, on the update
paths that keep their states in the trainer; the host's update skips those units; checkpoints
carry them; the budget and the cost model count them where they are."""

import pytest
import torch
from reference import reference_model, reference_train, small_config, weights_of
from test_parity import assert_parity, assert_same_weights, run_tiertrain

from tiertrain.config import ConfigError, MemoryConfig
from tiertrain.device import AsyncCpuDevice
from tiertrain.models import build_model, tensor_source
from tiertrain.training.trainer import Trainer

MIB = 1 << 20


def _cfg(tmp_path, mode="baseline", device_mib=64, **kw):
    kw = dict(dict(micro_batches=2, steps=3, clip=0.05, host_param_mib=64, grad_host_mib=64, optim_host_mib=64), **kw)
    cfg = small_config(tmp_path, **kw)
    cfg.update.mode, cfg.memory.optim_device_mib = mode, device_mib
    return cfg


def _device_units(tr) -> set[int]:
    if tr.optim is None:  # a path whose states are not the trainer's (engines)
        return set()
    return set(tr.optim.on_device.units) if tr.optim.on_device is not None else set()


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_states_on_the_device_are_plain_pytorchs_math(tmp_path, mode, optim):
    """Every trained unit's states on the device, updated there: the losses and weights of
    plain PyTorch bit for bit (clipped), and the host's state regions hold none of them."""
    cfg = _cfg(tmp_path, mode, lr=0.05 if optim == "sgd" else 2e-3)
    cfg.optim.name = optim
    tr, _ = assert_parity(cfg, AsyncCpuDevice(delay=0.001))
    assert _device_units(tr) == {u.index for u in tr.optim.trainable}
    # gradients and parameters in host memory: each unit one chunk (one wait), not the buffers' chunks
    assert tr.optim._all_chunks == [(u.index, 0, u.numel) for u in tr.optim.trainable]
    assert any(u.numel > tr.optim.chunk for u in tr.optim.trainable)
    for r in tr.optim.state_files:
        assert r.host_bytes == 0 and r.device_bytes == sum(u.numel for u in tr.optim.trainable) * 4


def test_some_units_on_the_device_the_rest_on_the_host_and_the_drive(tmp_path):
    """A device budget for some units' states, a host budget for some others, the rest on the
    drive (parameters and gradients there too): every way at once, bit for bit."""
    cfg = _cfg(tmp_path, device_mib=1, optim_host_mib=2, host_param_mib=0, grad_host_mib=0, update_kib=256)
    cfg.model.n_layers, cfg.model.d_model = 4, 128
    tr, _ = assert_parity(cfg, AsyncCpuDevice(delay=0.001))
    on_dev = _device_units(tr)
    trained = {u.index for u in tr.optim.trainable}
    on_host = {u for u in trained - on_dev if tr.optim.m.on_host(u)}
    assert on_dev and on_host and trained - on_dev - on_host, (on_dev, on_host)
    assert max(b - a for _, a, b in tr.optim._all_chunks) <= tr.optim.chunk  # gradients on the drive: the buffers


def test_bf16_states_on_the_device_are_the_hosts(tmp_path):
    """bf16 parameters with an fp32 master on the device: the same bits as on the host."""
    runs = {}
    for mib in (64, 0):
        cfg = _cfg(tmp_path / str(mib), device_mib=mib, dtype="bfloat16")
        losses, weights, tr = run_tiertrain(cfg, weights_of(reference_model(cfg)), AsyncCpuDevice(delay=0.001))
        runs[mib] = losses, weights
        assert bool(_device_units(tr)) == bool(mib) and (tr.optim.master is not None)
    assert runs[64][0] == runs[0][0]
    assert all(torch.equal(runs[64][1][k], t) for k, t in runs[0][1].items())


def test_a_checkpoint_carries_the_device_states(tmp_path):
    """Saved from the device and restored into it: the run goes on bit for bit."""
    cfg = _cfg(tmp_path, mode="overlap", steps=4)
    ref = reference_model(cfg)
    ref_losses, ref_weights = reference_train(cfg, ref)
    skeleton, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    with Trainer(cfg, weights=tensor_source(skeleton, weights_of(ref)), device=AsyncCpuDevice(delay=0.001)) as tr:
        tr.initialize(progress=False)
        first = [tr.train_step().extra["losses"] for _ in range(2)]
        saved = tr.save_checkpoint()
    with Trainer(cfg, device=AsyncCpuDevice(delay=0.001)) as tr:
        tr.restore(saved.path)
        assert _device_units(tr)
        rest = [tr.train_step().extra["losses"] for _ in range(2)]
        weights = tr.weights()
    assert first + rest == ref_losses
    assert_same_weights(tr, weights, ref_weights)


def test_planned_device_states_and_where_they_cannot_be(tmp_path, caplog):
    """Unset (None), the budget gives the states the device's room (the simulated device has no
    limit: all of them), said at start; on the CPU, with the speculative update or with 8-bit
    states a setting is not used, and the start says why."""
    cfg = _cfg(tmp_path / "planned", device_mib=None)
    with Trainer(cfg, device=AsyncCpuDevice(delay=0.001)) as tr:
        assert _device_units(tr) == {u.index for u in tr.optim.trainable}
        lines = "\n".join(tr.budget.lines())
        assert "optimizer states in device memory" in lines and "planned" in lines, lines
    for where, change, why in (
        ("cpu", lambda c: None, "the device's memory is the host's"),
        ("spec", lambda c: setattr(c.update, "speculate", "on"), "holds every state twice"),
        ("8bit", lambda c: setattr(c.optim, "name", "adamw8bit"), "8-bit states"),
        ("engines", lambda c: setattr(c.update, "mode", "engines"), "keeps the states in processes of its own"),
    ):
        cfg = _cfg(tmp_path / where, device_mib=64)
        change(cfg)
        dev = None if where == "cpu" else AsyncCpuDevice(delay=0.001)
        with Trainer(cfg, device=dev) as tr:
            assert not _device_units(tr)
            lines = "\n".join(tr.budget.lines())
            assert "memory.optim_device_mib = 64 is not used: " in lines and why in lines, lines


def test_the_host_update_the_cost_model_counts_leaves_the_device_units_out(tmp_path):
    """The prediction's update: the host's kernel over the units left on the host only; the
    link carries each device unit's gradient up and parameters down (fp32: 4 bytes each)."""
    preds = {}
    for mib in (0, 64):
        with Trainer(_cfg(tmp_path / str(mib), device_mib=mib), device=AsyncCpuDevice(delay=0.001)) as tr:
            tr.initialize(progress=False)
            preds[mib] = tr.predict()
            n = sum(u.numel for u in tr.optim.trainable)
    assert preds[0] is not None and preds[64] is not None
    assert preds[64].traffic.up == preds[0].traffic.up + 2 * 4 * n  # gradients and (no master) parameters
    assert preds[64].traffic.down == preds[0].traffic.down + 4 * n
    upd = lambda p: next(ph for ph in p.phases if ph.name.startswith("update")).compute_s  # noqa: E731
    assert upd(preds[64]) == 0 < upd(preds[0])


def test_a_negative_device_budget_is_refused():
    with pytest.raises(ConfigError, match="optim_device_mib"):
        MemoryConfig(optim_device_mib=-1)


def test_the_plan_never_counts_device_states_a_path_cannot_have(tmp_path):
    """Set for a run that then speculates (``auto``) or for a prediction of the update engines,
    the device states would not be there: the speculation is left off where the budget placed
    them (said), and a prediction of a path that keeps its states on the host counts the whole
    update on the host."""
    from tiertrain.cost import on_device_elements
    from tiertrain.cost.choose import resolve_speculation
    from tiertrain.runtime import Runtime

    cfg = _cfg(tmp_path, mode="overlap", device_mib=64)
    rt = Runtime(cfg, device=AsyncCpuDevice(delay=0.0))
    trained = sum(u.used for u in rt.state_layout.units if not u.frozen)
    assert on_device_elements(cfg, rt) == trained
    cfg.update.speculate = "auto"
    out, why = resolve_speculation(cfg, rt, rates_fn=lambda: pytest.fail("nothing to measure"))
    assert out.update.speculate == "off" and "in device memory" in why, why
    cfg.update.speculate = "off"
    cfg.update.mode = "engines"
    assert on_device_elements(cfg, rt) == 0
    cfg.update.mode, cfg.update.speculate = "overlap", "on"
    assert on_device_elements(cfg, rt) == 0


def test_planned_device_states_take_the_last_unit_too(tmp_path):
    """Planned with room for all of them, every unit's states are on the device, the last one
    too, whatever the total's remainder of a MiB (without checksums units are not whole MiB)."""
    cfg = _cfg(tmp_path, device_mib=None, checksum=False)
    with Trainer(cfg, device=AsyncCpuDevice(delay=0.001)) as tr:
        per = 8  # fp32: two moments
        total = sum(u.numel for u in tr.optim.trainable) * per
        assert total % MIB, total  # a remainder: rounded down it would leave a unit out
        assert _device_units(tr) == {u.index for u in tr.optim.trainable}
