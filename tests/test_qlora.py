"""QLoRA on a streamed 4-bit base (``model.base_dtype = 'nf4' | 'fp4'``): the same losses and
adapter weights as peft's LoRA on transformers' bitsandbytes-quantized model
(``BitsAndBytesConfig(load_in_4bit=True)``, as users load it) on plain PyTorch + AdamW, bit for
bit in fp32 on CPU; the base stored quantized, read in its quantized bytes (the cost model's
too), never written; checkpoints resumed, exported and evaluated."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from reference import reference_model, reference_train, weights_of
from test_lora import _layered, _peft_names, _train, lora_config, second_step_and_traffic
from test_parity import run_tiertrain

from tiertrain.adapters import LoRA
from tiertrain.reference import HFWrapper

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


def quantized_reference(cfg, plain, tmp_path, kind="nf4", double=False):
    """transformers' model of ``plain``'s weights loaded as users load QLoRA's base, with peft's
    LoRA injected and set to the adapters tiertrain starts from; (model, peft's names)."""
    from transformers import AutoModelForCausalLM

    where = tmp_path / "hf-plain"
    plain.hf.save_pretrained(where)
    qc = bnb_config(kind, double)
    q = AutoModelForCausalLM.from_pretrained(where, quantization_config=qc, dtype=torch.float32, device_map="cpu")
    q.config.use_cache = False
    # trained as users train it (from_pretrained gives eval mode, where bitsandbytes repacks a
    # weight for its bf16 CPU kernel whenever the input needs no gradient: not the training path)
    q.train()
    layered = _layered(cfg, plain.hf)
    ours = LoRA(layered, cfg.adapter, seed=cfg.train.seed, device="cpu")
    a = cfg.adapter
    pc = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=list(a.target))
    inner = peft.inject_adapter_in_model(pc, q)
    names = _peft_names(layered, ours)
    state = dict(inner.named_parameters())
    with torch.no_grad():
        for name, p in ours.named():
            state[names[name]].copy_(p)
    return HFWrapper(inner), names


def bnb_config(kind: str, double: bool = False):
    """transformers' quantization config for ``kind`` as users write it (int8: LLM.int8())."""
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip


def qlora_config(tmp_path, kind="nf4", double=False, **kw):
    cfg = lora_config(tmp_path, "llama", **kw)
    cfg.model.base_dtype, cfg.model.base_double_quant = kind, double
    return cfg


def qwen2_base(tmp_path) -> str:
    """A saved Qwen2 (another family: biased q/k/v projections, which stay unquantized)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(7)
    c = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(c).save_pretrained(tmp_path / "qwen2")
    return str(tmp_path / "qwen2")


def _plain(cfg):
    """The unquantized model of ``cfg`` (its directory's, or built from its sizes)."""
    if cfg.model.hf_dir is None:
        return reference_model(cfg)
    from transformers import AutoModelForCausalLM

    return HFWrapper(AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, dtype=torch.float32).train())


@pytest.mark.parametrize(
    "kind,double,host_param_mib,family",
    [
        ("nf4", False, 0, "llama"),  # the base on the tier
        ("nf4", True, 64, "llama"),  # in memory, the scales quantized too
        ("fp4", False, 64, "llama"),
        ("fp4", True, 0, "llama"),
        ("nf4", True, 0, "qwen2"),
        ("nf4", False, 0, "phimoe"),  # a mixture of experts, the routers' auxiliary loss on
        ("int8", False, 0, "llama"),  # LLM.int8(): Linear8bitLt's training forward
        ("int8", False, 64, "qwen2"),
        ("int8", False, 0, "phimoe"),
    ],
)
def test_qlora_trains_as_peft_on_a_bitsandbytes_base(tmp_path, kind, double, host_param_mib, family):
    assert_qlora_parity(tmp_path, kind, double, host_param_mib, family)


def assert_qlora_parity(tmp_path, kind, double, host_param_mib, family, device=None):
    """A QLoRA run of ``family``'s model against peft + bitsandbytes: the same losses and adapters."""
    cfg = qlora_config(tmp_path, kind, double, host_param_mib=host_param_mib, steps=3)
    if family == "qwen2":
        cfg.model.hf_dir, cfg.model.kind = qwen2_base(tmp_path), "auto"
    elif family == "phimoe":  # its router subclasses nn.Linear: transformers leaves it unquantized
        from test_moe import _config
        from transformers import AutoModelForCausalLM

        torch.manual_seed(3)
        AutoModelForCausalLM.from_config(_config("phimoe")).save_pretrained(tmp_path / "phimoe")
        cfg.model.hf_dir, cfg.model.kind = str(tmp_path / "phimoe"), "auto"
        cfg.adapter.target = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if family != "llama":
        cfg = type(cfg).from_dict(cfg.to_dict())  # the model's sizes from its directory
    plain = _plain(cfg)
    init = weights_of(plain)
    ref, names = quantized_reference(cfg, plain, tmp_path, kind, double)
    ref_losses, ref_weights = reference_train(cfg, ref)
    losses, _, tr = run_tiertrain(cfg, init, device)
    assert losses == ref_losses
    adapters = dict(tr.rt.adapters.named())
    assert len(adapters) == 2 * len(tr.rt.adapters.targets) > 0
    for name, p in adapters.items():
        assert torch.equal(p.detach(), ref_weights[names[name]]), name
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in adapters.items()), "the adapters did not train"
    return tr


@pytest.mark.parametrize("direct,kind", [(False, "nf4"), (True, "nf4"), (False, "int8")])
def test_qlora_on_a_device_with_memory_of_its_own(tmp_path, direct, kind):
    """As on CUDA (the simulated device: copies that complete later, memory poisoned when given
    back): only the quantized bytes cross to the device (staged, or read straight into the slot
    as with GPUDirect), which dequantizes them in the slot when the unit is first bound; some
    units kept in host memory; peft's bits still, and fewer bytes uploaded than the fp32 base's
    (the cost model's count)."""
    from test_moe_routed import _Counted

    dev = _Counted(delay=0.001, direct=direct)
    tr = assert_qlora_parity(tmp_path / "q", kind, kind != "int8", 1, "llama", dev)
    full_dev = _Counted(delay=0.001, direct=direct)
    full_cfg = lora_config(tmp_path / "f", "llama", host_param_mib=1, steps=3)
    _, _, full = run_tiertrain(full_cfg, weights_of(reference_model(full_cfg)), full_dev)
    if not direct:  # direct reads land in the slots: nothing staged is uploaded
        assert 0 < dev.uploaded < 0.6 * full_dev.uploaded
    assert _up(tr) < 0.6 * _up(full)  # the cost model counts what crosses quantized


def _up(t) -> int:
    """The cost model's bytes uploaded a step by run ``t`` where device memory is separate."""
    from tiertrain.cost.traffic import step_traffic

    return step_traffic(
        t.cfg, t.model, t.layout, t.dtype, t.rt.align, hidden=t.rt.hidden_size, kept=0, separate=True
    ).up


@pytest.mark.parametrize("host_param_mib,kind", [(0, "nf4"), (64, "nf4"), (0, "int8")])
def test_a_quantized_base_reads_its_quantized_bytes_as_the_cost_model_says(tmp_path, host_param_mib, kind):
    """The storage tier reads the base's quantized bytes (under a third of the fp32 base's in 4
    bits, under 0.4x in int8, on a model whose blocks are most of it), equal to the cost model's;
    its pools are the fp32 run's (dequantized inside the slots); the plan line names the format."""
    from tiertrain.cost.report import _base_line
    from tiertrain.training.trainer import Trainer

    kw = dict(steps=2, stash_host_mib=64, host_param_mib=host_param_mib, layers=4, d=128)
    cfg = qlora_config(tmp_path / "q", kind, **kw)
    full = lora_config(tmp_path / "f", "llama", **kw)
    with Trainer(cfg) as tq, Trainer(full) as tf:
        recs = [second_step_and_traffic(t) for t in (tq, tf)]
        assert tq.update.states[0].dtype == torch.uint8
        assert tq.budget.fixed == tf.budget.fixed
        assert f"base in {kind}" in _base_line(tq.cfg, tq.rt)[0]
    (q, t_q), (f, t_f) = recs
    assert q.ssd_read_bytes == t_q.read and f.ssd_read_bytes == t_f.read
    if host_param_mib == 0:
        assert 0 < q.ssd_read_bytes / f.ssd_read_bytes < (0.34 if kind == "nf4" else 0.4)
        # the store counts the bytes its loads read (generation's "GB read"), not the slots' fp32 bytes
        fetched = tq.params.stats.fetch_bytes / tf.params.stats.fetch_bytes
        assert fetched == pytest.approx(q.ssd_read_bytes / f.ssd_read_bytes, rel=0.05)
    else:
        assert q.ssd_read_bytes == f.ssd_read_bytes == 0


def test_a_resumed_qlora_run_is_the_straight_run_and_a_corrupt_base_is_caught(tmp_path):
    from tiertrain.checkpoint import CheckpointError
    from tiertrain.config import ConfigError

    cfg = qlora_config(tmp_path / "a", "nf4", True, steps=4)
    init = weights_of(reference_model(cfg))
    straight, w_straight, _ = _train(cfg, init, 4)
    cfg2 = qlora_config(tmp_path / "b", "nf4", True, steps=4)
    first, _, ckpt = _train(cfg2, init, 2)
    second, w_resumed, _ = _train(cfg2, init, 2, resume=ckpt)
    assert first + second == straight
    assert all(torch.equal(w_straight[n], w_resumed[n]) for n in w_straight)
    path = f"{ckpt}/params.bin"
    with open(path, "r+b") as f:  # a flipped byte inside the first block's codes
        f.seek(70000)
        b = f.read(1)
        f.seek(70000)
        f.write(bytes([b[0] ^ 0xFF]))
    other = qlora_config(tmp_path / "c", "fp4", True, steps=4)  # another format: named before any state is read
    with pytest.raises(ConfigError, match=r"keeps its frozen base in nf4 with double quantization, made in "
                       r"torch.float32; this run would keep it in fp4 with double quantization"):  # fmt: skip
        _train(other, init, 1, resume=ckpt)
    int8 = qlora_config(tmp_path / "e", "int8", steps=4)
    with pytest.raises(ConfigError, match=r"this run would keep it in int8, made in torch.float32"):
        _train(int8, init, 1, resume=ckpt)
    plain = lora_config(tmp_path / "d", "llama", steps=4)
    with pytest.raises(ConfigError, match=r"this run would keep it in its float dtype"):
        _train(plain, init, 1, resume=ckpt)
    with pytest.raises(CheckpointError, match=r"params.bin is corrupt"):
        _train(cfg2, init, 1, resume=ckpt)


@pytest.mark.parametrize("kind,double", [("nf4", True), ("int8", False)])
def test_a_qlora_checkpoint_evaluates_generates_and_exports_as_peft_on_the_quantized_base(tmp_path, kind, double):
    """A QLoRA run on a transformers directory (Qwen2), then: ``evaluate`` of its checkpoint is
    the run's logged validation loss; ``generate`` from the checkpoint, and from the base
    directory with the exported peft adapter and ``model.base_dtype``, give the greedy tokens of
    transformers' quantized model with ``PeftModel.from_pretrained`` (in training mode: int8's
    eval-mode kernel quantizes the activations too, module docstring of state/quant.py); ``--merge`` writes
    the adapters folded into the dequantized base, which transformers loads."""
    from test_lora import train_then_evaluate
    from transformers import AutoModelForCausalLM

    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.config import Config, ModelConfig
    from tiertrain.device.simulated import AsyncCpuDevice
    from tiertrain.inference.generate import Sampling, generate
    from tiertrain.inference.weights import CheckpointWeights

    base_dir = qwen2_base(tmp_path)
    cfg = qlora_config(tmp_path / "run", steps=2)
    cfg.model = ModelConfig(hf_dir=base_dir, base_dtype=kind, base_double_quant=double)
    cfg.optim.lr = 2e-2  # adapters that move the tokens
    ck, _ = train_then_evaluate(cfg, tmp_path)
    out = export_checkpoint(ck, str(tmp_path / "adapter"))
    qc = bnb_config(kind, double)
    base = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=qc, dtype=torch.float32, device_map="cpu")
    loaded = peft.PeftModel.from_pretrained(base, out).train()  # bitsandbytes' training kernels (no CPU repack)
    prompts = [[3, 17, 42, 9], [5, 8]]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            want.append(loaded.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[0, len(p) :].tolist())
        with loaded.disable_adapter():
            plain = [
                loaded.generate(input_ids=torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
                for p in prompts
            ]
    assert want != plain  # the adapters change the tokens
    s = Sampling(max_new_tokens=8, stop_at_eos=False)
    with CheckpointWeights(ck) as w:  # its quantized records read as stored, on CPU and a separate device
        assert w.source.dequantized and w.source.records is not None
        gcfg = Config.from_dict(w.config, environment=False)
        for dev in (None, AsyncCpuDevice(delay=0.001)):
            assert generate(gcfg, prompts, s, weights=w.source, device=dev) == want
        assert not glob.glob(f"{gcfg.io.paths[0]}/weights-*.bin")  # no converted copy
    for where in ("source", "tier"):  # the float base quantized as training does: in memory, or a quantized copy
        pcfg = qlora_config(tmp_path / f"gen-{where}")
        pcfg.model = ModelConfig(hf_dir=base_dir, base_dtype=kind, base_double_quant=double)
        pcfg.adapter.init_from, pcfg.io.weights = out, where
        assert generate(pcfg, prompts, s) == want
    copies = glob.glob(f"{pcfg.io.paths[0]}/weights-*.bin")
    assert len(copies) == 1
    from tiertrain.runtime import Runtime
    from tiertrain.state.quant import base_storage

    rt = Runtime(pcfg)
    quant, _ = base_storage(pcfg, rt.layout, rt.dtype, rt.align)
    assert os.path.getsize(copies[0]) == quant.total_numel < rt.layout.total_numel * 4  # the quantized records
    merged_dir = export_checkpoint(ck, str(tmp_path / "merged"), merge=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    x = torch.tensor([prompts[0]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, loaded(input_ids=x).logits, rtol=1e-4, atol=1e-4)


def test_bad_4bit_configs_are_named(tmp_path):
    from tiertrain.config import ConfigError, load_config
    from tiertrain.training.trainer import Trainer

    with pytest.raises(ConfigError, match=r"model.base_double_quant = True: quantizes a 4-bit base's scales"):
        load_config(None, ["--model.base_double_quant=true", "--adapter.kind=lora"])
    with pytest.raises(ConfigError, match=r"model.base_dtype = 'nf4' is for a frozen model under adapters"):
        load_config(None, ["--model.base_dtype=nf4"])
    with pytest.raises(ConfigError, match=r"model.base_dtype: must be one of|model.base_dtype = 'int4'"):
        load_config(None, ["--model.base_dtype=int4", "--adapter.kind=lora"])
    cfg = lora_config(tmp_path, "gpt2")
    cfg.model.base_dtype = "nf4"
    with pytest.raises(ConfigError, match=r"no nn.Linear layer to quantize \(GPT-2's are Conv1D\)"):
        Trainer(cfg)


def test_what_is_quantized_is_what_transformers_quantizes(tmp_path):
    """The blocks' exact ``nn.Linear`` weights: not a router that subclasses it (Phi-MoE), not the
    3-D experts, not the embedding or head; a unit too small for its record is refused by name."""
    from test_moe import _config
    from transformers import AutoModelForCausalLM

    from tiertrain.runtime import Runtime

    AutoModelForCausalLM.from_config(_config("phimoe")).save_pretrained(tmp_path / "m")
    cfg = qlora_config(tmp_path / "run")
    cfg.model.hf_dir, cfg.model.kind = str(tmp_path / "m"), "auto"
    cfg.adapter.target = ["q_proj"]
    rt = Runtime(type(cfg).from_dict(cfg.to_dict()))
    names = {id(p): n for n, p in rt.model.named_parameters()}
    got = sorted(names[i].split(".", 3)[-1] for i in rt.layout.quantizable)
    assert got == sorted(f"{x}.weight" for x in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                 "self_attn.o_proj") for _ in range(2)), got  # fmt: skip


def test_forward_only_sources_count_the_bytes_their_loads_read(tmp_path):
    """Generation's and evaluation's "GB read": the units kept in memory wrap the quantized
    records (their bytes, not the slots'), as routed reads wrap theirs."""
    from tiertrain.inference.weights import ResidentWeights
    from tiertrain.io import IOFuture
    from tiertrain.runtime import Runtime
    from tiertrain.state.quant import DequantSource, base_storage

    rt = Runtime(qlora_config(tmp_path, "int8", layers=2, d=128))
    quant, _ = base_storage(rt.cfg, rt.layout, rt.dtype, rt.align)
    inner = DequantSource(None, quant, rt.dtype)
    inner.load = lambda u, out, slot=None: IOFuture.completed(0)  # nothing read: the counting alone
    kept = ResidentWeights(inner, rt.layout, budget=0, pin=False, why="test", progress=False)
    for unit in rt.layout.units:
        want = quant.units[unit.index].numel
        assert kept.loaded_bytes(unit.index, unit.numel, 4) == inner.loaded_bytes(unit.index, unit.numel, 4) == want
    assert any(quant.units[u.index].numel < u.numel * 2 for u in rt.layout.units)  # quantized units: under half


@pytest.mark.slow
@pytest.mark.parametrize("kind,separate", [("nf4", False), ("int8", True)])
def test_qlora_on_ranks_is_the_grouped_peft_reference_bit_for_bit(tmp_path, kind, separate):
    """2 ranks: each keeps an equal share of every unit's quantized record (bytes; a rank quantizes
    the unit whole at start and keeps its share), gathers the bytes of a unit whole and then
    dequantizes it; adapter gradients summed in rank order. peft's QLoRA on bitsandbytes' model
    trained on the same grouping of micro-batches, bit for bit; each rank's base file is half the
    one-rank records; a checkpoint of the 2 ranks is the one-rank files (loads on one rank). On a
    device with memory of its own (``separate``) the gathered bytes are uploaded and dequantized
    there, some of each rank's share in host memory."""
    from test_dist_train import ckpt_run, run_ranks

    from tiertrain.training.trainer import Trainer

    cfg = qlora_config(tmp_path, kind, layers=2, micro_batches=2, steps=3, host_param_mib=int(separate))
    plain, out = run_ranks(tmp_path / "ranks", cfg, 2, separate=separate)
    ref, names = quantized_reference(cfg, plain, tmp_path, kind)
    ref_losses, ref_weights = reference_train(cfg, ref, ranks=2)
    for step, want in enumerate(ref_losses):
        assert [x for r in range(2) for x in out[r]["losses"][step]] == want
    assert [o["mode"] for o in out] == ["frozen", "frozen"]
    for name, p in out[0]["adapters"].items():
        assert torch.equal(p, ref_weights[names[name]]), name
        assert torch.equal(p, out[1]["adapters"][name])
    one = qlora_config(tmp_path / "one", kind, layers=2, micro_batches=4, steps=1)
    with Trainer(one) as tr:
        records = tr.update.quant.total_numel
    for o in out:
        assert o["files"].get("params.bin", 0) < records / 2 + (1 << 20)  # its share (less what host memory holds)
        assert separate or o["files"]["params.bin"] >= records / 2
    saved = ckpt_run(tmp_path, "save", cfg, 2, steps=1, save=True)
    loaded = ckpt_run(tmp_path, "load", one, 1, resume=saved["path"], save=False)
    assert os.path.getsize(f"{saved['path']}/params.bin") == records
    assert set(loaded["restored"]) == set(saved["weights"])
    for name, w in saved["weights"].items():
        assert torch.equal(loaded["restored"][name], w), name


@pytest.mark.slow
def test_a_killed_rank_of_a_qlora_run_resumes_to_the_straight_runs_files(tmp_path):
    """`tiertrain train --nproc 2` of QLoRA (an NF4 base shared as bytes) with bitsandbytes'
    AdamW8bit on the adapters, a checkpoint every step: rank 1 killed (SIGKILL) in the backward of
    step 3 stops the run, step 2's checkpoint is intact, and `--resume` on 2 ranks ends with the
    files of a run never stopped (the base's CRC32C, the adapters' bytes)."""
    from test_dist_train import _cli, _final

    extra = ("--adapter.kind=lora", "--model.base_dtype=nf4", "--optim.name=adamw8bit")
    straight = _cli(tmp_path / "a", *extra)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _cli(tmp_path / "b", *extra, env={"TIERTRAIN_KILL_AT": "backward:9", "TIERTRAIN_KILL_RANK": "1"})
    assert killed.returncode != 0 and "rank 1 of 2 was ended by SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert _final(tmp_path / "b")[0] == 2
    resumed = _cli(tmp_path / "b", *extra, "--resume", str(tmp_path / "b" / "run"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _final(tmp_path / "b") == _final(tmp_path / "a")
    adapters = [
        glob.glob(str(tmp_path / s / "run" / "checkpoints" / "step-00000004" / "adapter.safetensors")) for s in "ab"
    ]
    assert all(len(a) == 1 for a in adapters)
    with open(adapters[0][0], "rb") as a, open(adapters[1][0], "rb") as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_quantized_bases_size_is_its_parameters_not_its_aligned_units(tmp_path, kind):
    """A small model's start line read "4.0 MiB against 4.0 MiB unquantized": both sides were
    whole units padded to the tier's alignment. The sizes are the parameters' own bytes (codes
    and scales: about an eighth or a quarter of fp32's), the aligned total beside them."""
    import re

    from tiertrain.runtime import Runtime
    from tiertrain.state.quant import base_storage

    cfg = qlora_config(tmp_path, kind)
    rt = Runtime(cfg)
    try:
        stored, _ = base_storage(cfg, rt.state_layout, rt.dtype, rt.align)
        line, n = stored.describe(), rt.state_layout.n_params
    finally:
        rt.close()
    held, plain = (
        float(x) for x in re.search(r"quantized, ([\d.]+) MiB against ([\d.]+) MiB unquantized", line).groups()
    )
    assert plain == pytest.approx(n * 4 / 2**20, abs=0.06), line
    assert held < (0.6 if kind == "int8" else 0.45) * plain, line
    assert "MiB stored in aligned units" in line
