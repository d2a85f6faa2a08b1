"""8-bit optimizer states (``optim.name = "adamw8bit"``, ``update/adamw8bit.py``): the streamed
update is bitsandbytes' ``AdamW8bit`` on plain PyTorch bit for bit on CPU (its blockwise 8-bit
moments for parameters of 4096 elements or more, fp32 ones below), on the trainer's update
paths, with the speculative update, clipping, states partly in host memory and resume; its
files hold one byte a moment; the cost model counts the bytes the storage tier moves; what it
does not run yet is refused by name. Update chunks of 16,384 elements (whole 16 KiB checksum
blocks of the 1-byte codes) cut through the 8-bit parameters, whose last blocks are partial."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import assert_resume_exact, reference_model, reference_train, small_config, weights_of
from test_parity import assert_parity, assert_same_weights, run_tiertrain

from tiertrain.config import ConfigError
from tiertrain.state.scales import BLOCK, MIN_8BIT, ScaleLayout
from tiertrain.training.trainer import Trainer

pytest.importorskip("bitsandbytes")


def _config(tmp_path, *, mode="baseline", **kw):
    kw.setdefault("micro_batches", 2)
    kw.setdefault("steps", 3)
    kw.setdefault("clip", 0.05)
    kw.setdefault("d", 104)  # 26-wide heads: matrices end in part of a block (10,816 = 42 x 256 + 64)
    cfg = small_config(tmp_path, kind="llama", **kw)
    cfg.io.checksum_block_kib = 16  # chunks of 16,384 one-byte codes: cuts inside the MLP's matrices
    cfg.optim.name = "adamw8bit"
    cfg.update.mode = mode
    return cfg


def _cut_and_mixed(tr) -> None:
    """The run cut 8-bit parameters between chunks and had small (fp32-moment) ones too."""
    big = [r for u in tr.layout.units for r in u.params if r.numel >= MIN_8BIT]
    small = [r for u in tr.layout.units for r in u.params if r.numel < MIN_8BIT]
    assert big and small and any(r.numel % BLOCK for r in big)
    chunk = tr.optim.chunk
    assert any(r.offset // chunk != (r.offset + r.numel - 1) // chunk for r in big), "no parameter cut by a chunk"
    assert all(r.offset % BLOCK == 0 for u in tr.layout.units for r in u.params)


def _file_bytes(records: list[int], block: int = 16 << 10) -> int:
    """A state file's size: each unit's record starts on a whole checksum block."""
    return sum(-(-n // block) * block for n in records[:-1]) + records[-1]


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_streamed_adamw8bit_is_bitsandbytes_on_plain_pytorch_bit_for_bit(tmp_path, mode, clip):
    tr, losses = assert_parity(_config(tmp_path, mode=mode, clip=clip))
    _cut_and_mixed(tr)
    assert losses[-1] != losses[0]
    files = dict(tr.plan.files)
    codes = [u.numel for u in tr.layout.units]  # one byte a moment
    assert files["exp_avg.bin"] == files["exp_avg_sq.bin"] == _file_bytes(codes)
    assert files["exp_avg_scales.bin"] == _file_bytes([4 * u.numel for u in ScaleLayout(tr.layout).units])
    assert files["exp_avg.bin"] < files["grads.bin"] / 3


def test_the_reference_is_not_torchs_adamw(tmp_path):
    """The same run with fp32 AdamW gives other weights: the parity above compares 8-bit states."""
    cfg = _config(tmp_path / "a", steps=2)
    ref = reference_model(cfg)
    _, eight = reference_train(cfg, ref)
    cfg32 = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="adamw"))
    _, full = reference_train(cfg32, ref)
    assert any(not torch.equal(eight[k], full[k]) for k in eight)


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
def test_speculation_and_states_partly_in_host_memory(tmp_path, mode):
    """The speculative update (each unit updated under the backward, redone where the clip acts;
    on the baseline path unit by unit in the trainer's thread) and moments, scales and parameters
    partly in host memory: bitsandbytes' bits still."""
    kw = dict(micro_batches=2, steps=4, host_param_mib=1, grad_host_mib=1, optim_host_mib=1, clip=1e3)
    cfg = _config(tmp_path, mode=mode, **kw)
    cfg.update.speculate = "on"
    tr, _ = assert_parity(cfg)
    assert tr.update.spec.summary() == "speculation held in 4 of 4 steps"
    cfg = _config(tmp_path / "clipped", mode=mode, **{**kw, "clip": 1e-3})
    cfg.update.speculate = "on"
    tr, _ = assert_parity(cfg)
    assert tr.update.spec.summary() == "speculation held in 0 of 4 steps"


def test_bf16_parameters_keep_an_fp32_master_updated_by_bitsandbytes(tmp_path):
    """bf16 parameters: the 8-bit update runs on the fp32 master (plain PyTorch's recipe: AdamW8bit
    over fp32 master weights); within the tolerance bf16 parameters give (``test_parity``: bf16
    kernels on views of flat buffers round otherwise). Measured on this shape: losses within
    5.5e-4, master weights within 2.4e-3 after 3 steps of lr 2e-3 (fp32 AdamW on the same shape:
    4.5e-4 and 3.3e-3); the test allows 2 x lr."""
    cfg = _config(tmp_path, dtype="bfloat16")
    ref = reference_model(cfg)
    ref_losses, ref_weights = reference_train(cfg, ref, mixed=True)
    losses, weights, tr = run_tiertrain(cfg, weights_of(ref))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=2e-3, rtol=0)
    assert_same_weights(tr, weights, ref_weights, exact=False, atol=2 * cfg.optim.lr)
    assert tr.optim.master is not None


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
def test_a_resumed_run_is_the_straight_run_bit_for_bit(tmp_path, mode):
    assert_resume_exact(*(_config(tmp_path / s, mode=mode, steps=4) for s in ("a", "b")))


def test_a_corrupt_scales_file_in_a_checkpoint_is_caught(tmp_path):
    cfg = _config(tmp_path, steps=1)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        saved = tr.save_checkpoint().path
    path = f"{saved}/exp_avg_scales.bin"
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x7f\x7f\x7f\x7f")
    with Trainer(cfg) as tr, pytest.raises(Exception, match="exp_avg_scales"):
        tr.restore(saved)


def test_the_cost_model_counts_what_the_storage_tier_moves(tmp_path):
    """The bytes of a step (one-byte moments and their scales, read and written) are the counters'."""
    from tiertrain.cost import run_traffic

    cfg = _config(tmp_path)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        rec = tr.train_step()
        t = run_traffic(tr, kept=len(tr.model.blocks) * cfg.data.micro_batches - tr.executor.recomputed)
    assert (t.read, t.write) == (rec.ssd_read_bytes, rec.ssd_write_bytes)
    n = tr.layout.total_numel
    assert list(t.by_state["exp_avg"]) == list(t.by_state["exp_avg_sq"]) == [n, n]  # one byte a moment


def test_lora_adapters_step_with_bitsandbytes_as_peft_users_do(tmp_path):
    """Adapters (in memory) take bitsandbytes' AdamW8bit itself; rank 32 on a 128-wide model gives
    adapters of 4096 elements, so both of its state kinds are used; resumed bit for bit (its step
    count, a Python int, goes through the checkpoint)."""
    from test_lora import _train, assert_lora_parity, lora_config

    def cfg_of(sub, steps=3):
        cfg = lora_config(tmp_path / sub, "llama", rank=32, steps=steps, d=128)  # adapters of 4,096
        cfg.optim.name = "adamw8bit"
        return cfg

    tr = assert_lora_parity(cfg_of("parity"))
    assert type(tr.adapter_update.opt).__name__ == "AdamW8bit"
    init = weights_of(reference_model(cfg_of("a", 4)))
    straight, w_straight, _ = _train(cfg_of("a", 4), init, 4)
    first, _, ckpt = _train(cfg_of("b", 4), init, 2)
    second, w_resumed, _ = _train(cfg_of("b", 4), init, 2, resume=ckpt)
    assert first + second == straight
    assert all(torch.equal(w_straight[n], w_resumed[n]) for n in w_straight)


def test_what_it_does_not_run_yet_is_refused_by_name(tmp_path):
    from tiertrain.runtime import Runtime

    cfg = _config(tmp_path / "engines", mode="engines", paths=2)
    with pytest.raises(ConfigError, match=r"optim.name = 'adamw8bit' with update.mode = 'engines'.*'overlap'"):
        Trainer(cfg)
    with pytest.raises(ConfigError, match=r"optim.name = 'adamw8bit' with 2 ranks is not supported yet"):
        Runtime(_config(tmp_path / "ranks"), world=2)
    cut = _config(tmp_path / "pieces")
    cut.model.vocab_pieces = 2
    with pytest.raises(ConfigError, match=r"row pieces.*leave model.vocab_pieces unset"):
        Runtime(cut)


def test_an_old_bitsandbytes_is_named(tmp_path, monkeypatch):
    import bitsandbytes

    from tiertrain.runtime import Runtime

    monkeypatch.setattr(bitsandbytes, "__version__", "0.44.1")
    with pytest.raises(ConfigError, match=r"bitsandbytes >= 0.50.*0.44.1 is installed"):
        Runtime(_config(tmp_path))


@pytest.mark.parametrize("first,then", [("adamw", "adamw8bit"), ("adamw8bit", "adamw")])
def test_a_checkpoint_resumed_with_the_other_optimizer_is_refused_by_name(tmp_path, first, then):
    """Its states are in another form and its parameters on other offsets: named before any state
    is read, not found corrupt (nor read wrongly)."""
    cfg = _config(tmp_path, steps=1)
    cfg.optim.name = first
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        saved = tr.save_checkpoint().path
    cfg.optim.name = then
    with (
        Trainer(cfg) as tr,
        pytest.raises(ConfigError, match=rf"made with optim.name = '{first}'.*--optim.name={first}"),
    ):
        tr.restore(saved)
    with pytest.raises(ConfigError, match=r"optim.name.*'adamw8bit'"):
        _config(tmp_path / "bad").optim.__class__(name="adam8bit")
