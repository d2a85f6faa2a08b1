"""On a CUDA device (skipped without one; the GPU window runs these: stage 1, and stage 5 for the
ranks): the same runs as on CPU, checked against CPU runs and against themselves."""

import pytest
import torch
from reference import small_config
from test_parity import _key_bias, run_tiertrain

from tiertrain.reference import reference_model, weights_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cfg_on(tmp_path, device, **kw):
    cfg = small_config(tmp_path, steps=3, micro_batches=2, **kw)
    cfg.train.device = device
    return cfg


def same_weights_across_devices(tr, ours, theirs, atol=1e-5, rare=1e-3):
    """Two tiertrain runs of one model on different devices: every weight within ``atol``, but
    for elements whose gradient is as small as the devices' rounding. AdamW's first steps are
    about lr x sign(gradient), so where the two devices' kernels round a near-zero gradient to
    opposite signs, the weight moves by lr one way and the other: such elements may differ by up
    to 2 x lr x steps, and must be rare (at most ``rare`` of a tensor; the key bias, whose
    gradient is zero in exact arithmetic, all of it, as the parity suite holds it). Seen on an
    H200: a Llama's gate projection after 3 fp32 steps."""
    bound = 2 * tr.cfg.optim.lr * tr.cfg.train.steps
    assert set(ours) == set(theirs)
    for name, a in ours.items():
        b = theirs[name]
        d = (a.float() - b.float()).abs()
        k = _key_bias(name, b)
        if k is not None:
            assert d[k].max().item() <= bound, f"{name} (key bias): max diff {d[k].max().item():.3g} > {bound:.3g}"
            d[k] = 0
        off = d > atol
        assert d.max().item() <= bound, f"{name}: max diff {d.max().item():.3g} > 2 x lr x steps = {bound:.3g}"
        assert off.sum().item() <= max(1, rare * d.numel()), (
            f"{name}: {off.sum().item()} of {d.numel()} elements differ by more than {atol:g} "
            f"(largest {d.max().item():.3g}): more than rounding of near-zero gradients"
        )


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_cuda_fp32_matches_the_cpu_run(tmp_path, kind):
    """fp32 with deterministic algorithms: the CUDA run's losses and weights against the same
    run on CPU (the update runs on the host either way; forward and backward kernels differ
    between devices, so within 1e-5, the key bias as the parity suite holds it)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        init = weights_of(reference_model(cfg_on(tmp_path / "r", "cpu", kind=kind)))
        l_cpu, w_cpu, _ = run_tiertrain(cfg_on(tmp_path / "c", "cpu", kind=kind, dtype="float32"), init)
        l_gpu, w_gpu, tr = run_tiertrain(cfg_on(tmp_path / "g", "cuda", kind=kind, dtype="float32"), init)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(torch.tensor(l_gpu), torch.tensor(l_cpu), rtol=1e-5, atol=1e-5)
    same_weights_across_devices(tr, w_gpu, w_cpu)


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
def test_cuda_frozen_units_match_the_cpu_run_and_stay_unwritten(tmp_path, mode):
    """``train.freeze`` on CUDA: a frozen unit is uploaded and read in the forward and backward
    but forms no gradient and is never updated: its weights stay bit for bit the initial ones,
    and the trained rest matches the same run on CPU as the unfrozen runs do."""
    from test_freeze import _initial, _owned

    def cfg(where, device):
        c = cfg_on(tmp_path / where, device, kind="llama", dtype="float32", clip=0.05)
        c.train.freeze, c.update.mode = ["embed", "blocks:0"], mode
        return c

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        init = weights_of(reference_model(cfg("r", "cpu")))
        l_cpu, w_cpu, _ = run_tiertrain(cfg("c", "cpu"), init)
        l_gpu, w_gpu, tr = run_tiertrain(cfg("g", "cuda"), init)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(torch.tensor(l_gpu), torch.tensor(l_cpu), rtol=1e-5, atol=1e-5)
    same_weights_across_devices(tr, w_gpu, w_cpu)
    frozen = {n for u in tr.rt.frozen for n, _ in _owned(tr)[u]}
    assert frozen and all(torch.equal(w_gpu[n], _initial(tr, init, n)) for n in frozen)


@pytest.mark.parametrize("base_dtype", [None, "bfloat16", "nf4"])
def test_cuda_lora_matches_the_cpu_run(tmp_path, base_dtype):
    """LoRA on CUDA (adapters on the device, the frozen base streamed and uploaded, upcast from
    bf16 where kept so, a 4-bit base uploaded in 4 bits and dequantized in the device's slots):
    the CPU run's losses and adapters within 1e-5 in fp32."""
    from test_lora import lora_config

    if base_dtype == "nf4":
        pytest.importorskip("bitsandbytes")

    def cfg(where, device):
        c = lora_config(tmp_path / where, "llama")
        c.train.device, c.train.param_dtype, c.model.base_dtype = device, "float32", base_dtype
        c.model.base_double_quant = base_dtype == "nf4"
        return c

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        init = weights_of(reference_model(cfg("r", "cpu")))
        l_cpu, _, t_cpu = run_tiertrain(cfg("c", "cpu"), init)
        a_cpu = {n: p.detach().cpu() for n, p in t_cpu.rt.adapters.named()}
        l_gpu, _, t_gpu = run_tiertrain(cfg("g", "cuda"), init)
        a_gpu = {n: p.detach().cpu() for n, p in t_gpu.rt.adapters.named()}
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(torch.tensor(l_gpu), torch.tensor(l_cpu), rtol=1e-5, atol=1e-5)
    assert t_gpu.update.name == "frozen" and set(a_gpu) == set(a_cpu)
    same_weights_across_devices(t_gpu, a_gpu, a_cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("double", [False, True])
def test_cuda_dequantizes_a_4bit_unit_as_the_cpu_does(tmp_path, dtype, double):
    """A unit's 4-bit record dequantized in a device slot (bitsandbytes' CUDA kernel, the record
    in the slot's back) equals the CPU's dequantization bit for bit."""
    pytest.importorskip("bitsandbytes")
    from tiertrain.models import build_model
    from tiertrain.state.layout import FlatLayout
    from tiertrain.state.quant import QuantLayout, QuantSpec

    cfg = small_config(tmp_path, kind="llama", layers=1, d=256)
    model, source = build_model(cfg.model, param_dtype=dtype, seed=0)
    layout = FlatLayout(model, unit_align=16384)
    quant = QuantLayout(layout, QuantSpec("nf4", double), dtype, 65536)
    unit = next(u for u in layout.units if not quant.units[u.index].plain)
    values = source.load(unit.index, [r.name for r in unit.params])
    flat = torch.zeros(unit.numel, dtype=dtype)
    for r in unit.params:
        flat[r.offset : r.offset + r.numel].copy_(values[r.name].reshape(-1))
    rec = quant.quantize(unit.index, flat)
    want = torch.empty_like(flat)
    quant.dequantize_into(unit.index, rec, want)
    slot = torch.full_like(flat, float("nan"), device="cuda")
    q = quant.units[unit.index].numel
    back = (flat.numel() * flat.element_size() - q) // 4096 * 4096
    slot.view(torch.uint8)[back : back + q].copy_(rec.cuda())
    quant.dequantize_into(unit.index, slot.view(torch.uint8)[back : back + q], slot)
    got = slot.cpu()
    for r in unit.params:
        assert torch.equal(r.view(got), r.view(want)), r.name


@pytest.mark.parametrize("tie,mode", [(False, "baseline"), (True, "overlap"), (False, "engines")])
def test_cuda_vocabulary_pieces_match_the_cpu_run(tmp_path, tie, mode):
    """The vocabulary cut into pieces (the planner cuts it where a budget is short: the engines
    at 1 GiB on the H200, where an untied piece's backward first failed, binding a CUDA gradient
    to a weight left on the host): the same cut run on CPU, fp32, as the uncut runs above."""
    runs = []
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        init = weights_of(reference_model(cfg_on(tmp_path / "r", "cpu", tie=tie)))
        for d in ("cpu", "cuda"):
            cfg = cfg_on(tmp_path / d, d, dtype="float32", tie=tie)
            cfg.model.vocab_pieces, cfg.update.mode = 3, mode
            runs.append(run_tiertrain(cfg, init))
    finally:
        torch.use_deterministic_algorithms(False)
    (l_cpu, w_cpu, _), (l_gpu, w_gpu, tr) = runs
    assert len(tr.model.head_pieces) == 3
    torch.testing.assert_close(torch.tensor(l_gpu), torch.tensor(l_cpu), rtol=1e-5, atol=1e-5)
    same_weights_across_devices(tr, w_gpu, w_cpu)


@pytest.mark.parametrize("parts,mode", [(2, "overlap"), (4, "engines")])
def test_cuda_layer_pieces_match_the_cpu_run(tmp_path, parts, mode):
    """Layers cut into sub-layer units (the planner cuts them where whole blocks do not fit: a
    70 B shape's at 16 GiB): the stash's entries of several widths cross the link; the same cut
    run on CPU, fp32."""
    runs = []
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        init = weights_of(reference_model(cfg_on(tmp_path / "r", "cpu", kind="llama")))
        for d in ("cpu", "cuda"):
            cfg = cfg_on(tmp_path / d, d, kind="llama", dtype="float32", activations="recompute")
            cfg.model.layer_pieces, cfg.update.mode = parts, mode
            runs.append(run_tiertrain(cfg, init))
    finally:
        torch.use_deterministic_algorithms(False)
    (l_cpu, w_cpu, _), (l_gpu, w_gpu, tr) = runs
    assert tr.model.layer_parts == parts and tr.executor.recomputed > 0
    torch.testing.assert_close(torch.tensor(l_gpu), torch.tensor(l_cpu), rtol=1e-5, atol=1e-5)
    same_weights_across_devices(tr, w_gpu, w_cpu)


def test_cuda_ranges_of_experts_match_the_cpu_run(tmp_path):
    """A Qwen3-MoE's experts cut into ranges (``experts_cut.py``): transformers' grouped_mm
    replayed range by range on the device (its CUDA kernel, or the per-group fallback), the
    pairs' inputs and outputs crossing the link in the stash; the same cut run on CPU, fp32."""
    from test_moe import _config as moe_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config("qwen3_moe")).save_pretrained(tmp_path / "m")
    runs = []
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        init = weights_of(reference_model(_moe_cfg(tmp_path / "r", "cpu", tmp_path / "m")))
        for d in ("cpu", "cuda"):
            runs.append(run_tiertrain(_moe_cfg(tmp_path / d, d, tmp_path / "m"), init))
    finally:
        torch.use_deterministic_algorithms(False)
    (l_cpu, w_cpu, _), (l_gpu, w_gpu, tr) = runs
    assert tr.model.layer_parts == 3 and tr.executor.recomputed > 0
    torch.testing.assert_close(torch.tensor(l_gpu), torch.tensor(l_cpu), rtol=1e-5, atol=1e-5)
    same_weights_across_devices(tr, w_gpu, w_cpu)


def _moe_cfg(tmp_path, device, path):
    cfg = cfg_on(tmp_path, device, kind="llama", dtype="float32", activations="recompute", clip=0.0)
    cfg.model.hf_dir, cfg.model.layer_pieces = str(path), 3
    return cfg


def test_cuda_bf16_engines_and_baseline_agree_exactly(tmp_path):
    """bf16 on CUDA: both update paths run the same fused kernels on the host: identical."""
    init = weights_of(reference_model(cfg_on(tmp_path / "r", "cpu")))
    l_b, w_b, _ = run_tiertrain(cfg_on(tmp_path / "b", "cuda", dtype="bfloat16"), init)
    eng = cfg_on(tmp_path / "e", "cuda", dtype="bfloat16")
    eng.update.mode = "engines"
    l_e, w_e, _ = run_tiertrain(eng, init)
    assert l_b == l_e and all(torch.equal(w_b[k], w_e[k]) for k in w_b)


@pytest.mark.parametrize("mode", ["overlap", "baseline", "engines"])
@pytest.mark.parametrize("clip", [1e-3, 1e3], ids=["clip-acts", "clip-never-acts"])
def test_cuda_speculation_matches_the_path_not_speculating_exactly(tmp_path, clip, mode):
    """bf16 on CUDA, the update speculating under the backward (its judgement a sync point on
    the device's norm), on the overlapped path, the baseline and the engines (gradients through
    page-locked shared slots): the same path's losses and
    weights not speculating, bit for bit, whether the step is kept or redone."""
    init = weights_of(reference_model(cfg_on(tmp_path / "r", "cpu")))
    out = {}
    for speculate in ("off", "on"):
        cfg = cfg_on(tmp_path / speculate, "cuda", dtype="bfloat16", clip=clip)
        cfg.update.mode, cfg.update.speculate = mode, speculate
        out[speculate] = run_tiertrain(cfg, init)
    (l_o, w_o, _), (l_s, w_s, tr) = out["off"], out["on"]
    assert l_o == l_s and all(torch.equal(w_o[k], w_s[k]) for k in w_o)
    assert tr.update.spec.summary() == f"speculation held in {3 if clip > 1 else 0} of 3 steps"


def test_cuda_syncs_per_step_are_bounded_by_units_and_memory_is_flat(tmp_path):
    from tiertrain.training.trainer import Trainer

    cfg = cfg_on(tmp_path, "cuda", layers=4, dtype="bfloat16", host_param_mib=64, stash_host_mib=0)
    cfg.train.steps = 8
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        peaks, syncs = [], []
        for _ in range(cfg.train.steps):
            before = tr.dev.syncs
            rec = tr.train_step()
            syncs.append(tr.dev.syncs - before)
            peaks.append(rec.peak_device_bytes)
        units = len(tr.layout.units)
    assert max(syncs[1:]) <= 2 * units, syncs
    assert max(peaks[2:]) <= peaks[1] * 1.05 + (8 << 20), peaks


def test_cuda_ranks_train_the_cpu_ranks_model(tmp_path):
    """2 ranks on CUDA (each on GPU LOCAL_RANK mod the GPUs there are; the collectives on host
    memory over Gloo, units gathered into pinned staging and uploaded): the same 2-rank run on
    CPU's losses and weights, within 1e-5 (forward and backward kernels differ by device)."""
    from test_dist_train import _Named, run_ranks

    def cfg_for(where, device):
        cfg = small_config(tmp_path / where, kind="llama", layers=2, d=64, micro_batches=2, steps=3, clip=0.0)
        cfg.train.device, cfg.train.param_dtype = device, "float32"
        return cfg

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _, cpu = run_ranks(tmp_path / "c", cfg_for("c", "cpu"), 2)
        _, gpu = run_ranks(tmp_path / "g", cfg_for("g", "cuda"), 2)
    finally:
        torch.use_deterministic_algorithms(False)
    assert gpu[0]["loss"] == gpu[1]["loss"]  # every rank's mean, the same on both
    torch.testing.assert_close(torch.tensor(gpu[0]["loss"]), torch.tensor(cpu[0]["loss"]), rtol=1e-5, atol=1e-5)
    same_weights_across_devices(_Named(cfg_for("n", "cpu")), gpu[0]["weights"], cpu[0]["weights"])


def _device_states_cfg(tmp_path, where: str, mode: str, mib: int, **kw):
    kw = {"host_param_mib": 64, "grad_host_mib": 64, "optim_host_mib": 64, **kw}
    c = cfg_on(tmp_path / where, "cuda", kind="llama", **kw)
    c.update.mode, c.memory.optim_device_mib = mode, mib
    return c


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
def test_cuda_states_in_device_memory_match_the_hosts_update(tmp_path, mode):
    """fp32, deterministic algorithms: the optimizer's states in device memory, updated there by
    torch's fused AdamW on a stream of its own (``memory.optim_device_mib``), against the same
    CUDA run updating them on the host: the two kernels round alike but where a gradient is as
    small as their rounding (``same_weights_across_devices``' bounds). A wrong order between the
    update's stream and the forward's loads shows as stale parameters: a loss off from step 2."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        init = weights_of(reference_model(cfg_on(tmp_path / "r", "cpu", kind="llama")))
        l_host, w_host, _ = run_tiertrain(_device_states_cfg(tmp_path, "h", mode, 0, dtype="float32"), init)
        l_dev, w_dev, tr = run_tiertrain(_device_states_cfg(tmp_path, "d", mode, 64, dtype="float32"), init)
    finally:
        torch.use_deterministic_algorithms(False)
    assert set(tr.optim.on_device.units) == {u.index for u in tr.optim.trainable}
    torch.testing.assert_close(torch.tensor(l_dev), torch.tensor(l_host), rtol=1e-5, atol=1e-5)
    same_weights_across_devices(tr, w_dev, w_host)


def test_cuda_bf16_states_partly_in_device_memory_resume_exactly(tmp_path):
    """bf16 with an fp32 master, some units' states in device memory and the rest on the host
    and the drive, the overlapped path: 4 steps straight against 2, a checkpoint (the device's
    states saved through host memory) and 2 more in a fresh trainer: the same bits."""
    from reference import assert_resume_exact

    def cfg(where):
        c = _device_states_cfg(tmp_path, where, "overlap", 1, dtype="bfloat16", optim_host_mib=2, update_kib=256)
        c.model.n_layers, c.model.d_model, c.train.steps = 4, 128, 4
        return c

    assert_resume_exact(cfg("straight"), cfg("split"))
