"""LoRA on a frozen, streamed base (``[adapter]``): the same losses and adapter weights as peft's
LoRA on plain PyTorch + AdamW, bit for bit in fp32, from the same initial adapters; the base
never written; checkpoints resumed bit for bit; bad adapter configs named."""

from __future__ import annotations

import copy
import dataclasses
import os
import re

import pytest
import torch
from reference import reference_model, reference_train, small_config, weights_of
from test_parity import run_tiertrain

from tiertrain.adapters import LoRA
from tiertrain.config import ConfigError
from tiertrain.reference import HFWrapper

MIB = 1 << 20

peft = pytest.importorskip("peft")

TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt": ["qkv", "out"],
}


def lora_config(tmp_path, kind, *, rank=4, host_param_mib=0, **kw):
    kw.setdefault("micro_batches", 2)
    kw.setdefault("steps", 3)
    kw.setdefault("clip", 0.05)
    cfg = small_config(tmp_path, kind=kind, host_param_mib=host_param_mib, **kw)
    if kind == "llama":
        cfg.model.n_kv_heads = 2  # grouped-query attention: k_proj and v_proj narrower than q_proj
    cfg.adapter.kind, cfg.adapter.rank, cfg.adapter.alpha = "lora", rank, 2.0 * rank + 1
    cfg.adapter.target = TARGETS[kind]
    cfg.update.mode = "auto"  # resolved to 'frozen': nothing of the model is updated
    return cfg


def peft_reference(cfg, ref_model):
    """``ref_model`` with peft's LoRA injected (the config's rank, alpha, dropout, targets),
    its adapters set to the ones tiertrain starts from (its seeded initialisation). Returns
    the model and peft's name for each of our adapter names."""
    inner = ref_model.hf if isinstance(ref_model, HFWrapper) else ref_model
    layered = copy.deepcopy(ref_model) if inner is ref_model else _layered(cfg, inner)
    ours = LoRA(layered, cfg.adapter, seed=cfg.train.seed, device="cpu")
    a = cfg.adapter
    pc = peft.LoraConfig(
        r=a.rank, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=list(a.target),
        target_parameters=list(a.target_parameters) or None,
    )  # fmt: skip
    inner = peft.inject_adapter_in_model(pc, inner)
    if isinstance(ref_model, HFWrapper):
        ref_model.hf = inner
    names = _peft_names(layered, ours)
    state = dict(inner.named_parameters())
    with torch.no_grad():
        for name, p in ours.named():
            state[names[name]].copy_(p)
    return ref_model, names


def _layered(cfg, hf):
    """Our layered view of an HF model (its modules, so targets are found by identity)."""
    from tiertrain.models.hf import layer_hf

    return layer_hf(copy.deepcopy(hf))


def _peft_names(layered, ours):
    """Our adapter names -> peft's (``<module>.lora_A.default.weight``) in the reference model."""
    from tiertrain.adapters.peft_io import module_names

    paths = module_names(layered, ours)
    out = {}
    for name, _ in ours.named():
        module, ab, w = name.rsplit(".", 2)
        out[name] = f"{paths[module]}.{ab}.default.{w}"
    return out


def assert_lora_parity(cfg, device=None):
    ref_model = reference_model(cfg)
    init = weights_of(ref_model)
    ref_model, names = peft_reference(cfg, ref_model)
    ref_losses, ref_weights = reference_train(cfg, ref_model)
    losses, weights, tr = run_tiertrain(cfg, init, device)
    assert losses == ref_losses
    adapters = dict(tr.rt.adapters.named())
    assert len(adapters) == 2 * len(tr.rt.adapters.targets) > 0
    for name, p in adapters.items():
        assert torch.equal(p.detach(), ref_weights[names[name]]), name
    moved = [n for n, p in adapters.items() if "lora_B" in n and p.abs().sum() > 0]
    assert moved, "the adapters did not train"
    for name, w in weights.items():  # the base: never written
        assert torch.equal(w, _initial(tr, init, name)), f"{name} was written"
    return tr


def train_then_evaluate(cfg, tmp_path):
    """Train ``cfg`` with a validation loss at its end; ``tiertrain eval`` of its checkpoint gives
    that loss. Returns (the checkpoint, its adapters)."""
    from test_eval import _text

    from tiertrain.config import Config
    from tiertrain.inference.evaluate import evaluate
    from tiertrain.inference.weights import CheckpointWeights
    from tiertrain.training.trainer import Trainer

    cfg.data.eval_corpus, cfg.data.eval_micro_batches, cfg.train.eval_every = _text(tmp_path), 2, 2
    with Trainer(cfg) as tr:
        logged = tr.run()[-1].extra["eval_loss"]
    ck = tr.checkpoints.root
    with CheckpointWeights(ck) as w:
        ecfg = Config.from_dict(w.config, environment=False)
        ecfg.train.run_dir = str(tmp_path / "eval-run")
        assert evaluate(ecfg, weights=w.source).loss == logged
        return ck, w.source.adapters


def second_step_and_traffic(t):
    """Trainer ``t`` initialised, one step run, then the second step's record and the cost
    model's bytes for it (with the pairs that step kept)."""
    from tiertrain.cost import run_traffic

    t.initialize(progress=False)
    t.train_step()
    return t.train_step(), run_traffic(t, kept=len(t.model.blocks) * 2 - t.executor.recomputed)


def _initial(tr, init, name):
    from test_parity import ref_name_map

    return init[ref_name_map(tr, [name])[name]].float()


@pytest.mark.parametrize(
    "kind,host_param_mib",
    [
        ("llama", 0),  # GQA, every projection, the base on the tier
        ("llama", 64),  # the base in memory
        ("gpt2", 0),  # Conv1D layers, tied embeddings
        ("gpt", 0),
    ],
)
def test_lora_trains_as_peft_on_plain_pytorch(tmp_path, kind, host_param_mib):
    tr = assert_lora_parity(lora_config(tmp_path, kind, host_param_mib=host_param_mib))
    assert tr.update.name == "frozen" and [d.name for d in tr.update.states] == ["params"]  # no optimizer state


@pytest.mark.parametrize("activations", ["keep", "offload"])
def test_lora_with_kept_or_offloaded_activations(tmp_path, activations):
    """The blocks' autograd graphs kept from the forward (the adapters' saved tensors in them), or
    written to the storage tier and read back for the backward: peft's bits still."""
    kw = dict(keep_act_mib=64) if activations == "keep" else dict(activations="offload")
    cfg = lora_config(tmp_path, "llama", **kw)
    tr = assert_lora_parity(cfg)
    if activations == "keep":
        assert tr.executor.kept_pairs > 0 and tr.executor.recomputed == 0
    else:
        assert tr.offloaded is not None


def test_lora_through_the_python_api(tmp_path):
    """``tiertrain.train`` with an ``adapter`` section: trains, checkpoints the adapters."""
    import tiertrain

    recs = tiertrain.train(
        {
            "model": {"kind": "llama", "n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256},
            "data": {"seq_len": 32, "micro_batch_size": 2, "micro_batches": 2},
            "train": {"steps": 2, "run_dir": str(tmp_path / "run"), "predict": False, "progress": False},
            "io": {"paths": [str(tmp_path / "scratch")]},
            "adapter": {"kind": "lora", "rank": 4, "target": ["q_proj", "v_proj"]},
        }
    )
    assert len(recs) == 2 and recs[-1].ssd_write_bytes == 0
    ck = os.path.join(str(tmp_path / "run"), "checkpoints", "step-00000002")
    assert os.path.exists(os.path.join(ck, "adapter.safetensors"))


@pytest.mark.parametrize("base_dtype", [None, "bfloat16"])
def test_lora_on_a_device_with_memory_of_its_own(tmp_path, base_dtype):
    """As on CUDA (the simulated device: copies on streams that complete later, memory poisoned
    when given back): the base's units staged, upcast where kept narrower, and uploaded; the
    adapters on the device. peft's bits (a bf16 base: on the bf16-rounded model)."""
    from tiertrain.device.simulated import AsyncCpuDevice

    cfg = lora_config(tmp_path, "llama", host_param_mib=1)  # some units in host memory, the rest read
    cfg.model.base_dtype = base_dtype
    if base_dtype is None:
        assert_lora_parity(cfg, AsyncCpuDevice(delay=0.001))
        return
    ref_model = reference_model(cfg)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    init = weights_of(ref_model)
    ref_model, names = peft_reference(cfg, ref_model)
    ref_losses, ref_weights = reference_train(cfg, ref_model)
    losses, _, tr = run_tiertrain(cfg, init, AsyncCpuDevice(delay=0.001))
    assert losses == ref_losses
    for name, p in tr.rt.adapters.named():
        assert torch.equal(p.detach(), ref_weights[names[name]]), name


def test_lora_without_clipping_and_one_micro_batch(tmp_path):
    assert_lora_parity(lora_config(tmp_path, "llama", clip=0.0, micro_batches=1, rank=8))


def test_lora_starts_at_the_base_models_loss(tmp_path):
    """B starts at zero: step 1's loss is the base model's, whatever A is."""
    cfg = lora_config(tmp_path / "a", "llama", steps=1)
    base = small_config(tmp_path / "b", kind="llama", micro_batches=2, steps=1, clip=0.05)
    base.model.n_kv_heads = 2
    init = weights_of(reference_model(cfg))
    assert run_tiertrain(cfg, init)[0] == run_tiertrain(base, init)[0]


def test_the_frozen_base_is_never_written_and_read_twice_a_step(tmp_path):
    """The storage tier's counters of a step: nothing written; the base read in the forward and
    again in the backward (less the units still in a device slot from the forward's end), as the
    cost model's bytes say."""
    from tiertrain.cost import run_traffic
    from tiertrain.training.trainer import Trainer

    cfg = lora_config(tmp_path, "llama", layers=4, slots=2, micro_batches=2, stash_host_mib=64)  # hidden states in RAM
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        rec = tr.train_step()
        t = run_traffic(tr, kept=len(tr.model.blocks) * 2 - tr.executor.recomputed)
        base = tr.layout.total_numel * tr.dtype.itemsize
        resident = sum(sorted(u.numel for u in tr.layout.units)[-2:]) * tr.dtype.itemsize  # 2 slots at most
        n = sum(p.numel() for p in tr.rt.adapters.params())
        # memory: the adapters' weights, gradients and two moments in fp32, and no gradient buffer,
        # gradient file or optimizer state of the model
        assert tr.budget.fixed["adapters"] == 4 * 4 * n
        assert tr.grads.pool_bytes == 0 and "gradients" not in tr.budget.fixed
        assert tr.budget.demand["grad_host_mib"] == tr.budget.demand["optim_host_mib"] == 0
        assert sorted(f.name for d in tr.plan.states for f in d.files) == ["params.bin"]
    assert rec.ssd_write_bytes == 0 == t.write
    assert rec.ssd_read_bytes == t.read
    params_read = t.by_state["params"][0]
    assert rec.ssd_read_bytes == params_read  # the base alone: no optimizer state, no gradients
    assert 2 * base - resident <= params_read <= 2 * base


def test_bad_adapter_configs_are_named(tmp_path):
    from tiertrain.config import load_config
    from tiertrain.training.trainer import Trainer

    cfg = lora_config(tmp_path, "llama")
    cfg.adapter.target = ["q_proj", "qkv"]
    with pytest.raises(ConfigError, match=r"'qkv' matches no linear layer.*it has .*q_proj"):
        Trainer(cfg)
    cfg = lora_config(tmp_path, "gpt")
    cfg.adapter.rank = 65
    with pytest.raises(ConfigError, match=r"adapter.rank = 65 is above the width"):
        Trainer(cfg)
    with pytest.raises(ConfigError, match=r"adapter.kind"):
        load_config(None, ["--adapter.kind=qlora"])
    with pytest.raises(ConfigError, match=r"adapter.rank = 0"):
        load_config(None, ["--adapter.kind=lora", "--adapter.rank=0"])
    with pytest.raises(ConfigError, match=r"train.freeze .* adapters freeze the whole model"):
        load_config(None, ["--adapter.kind=lora", "--train.freeze=embed"])
    with pytest.raises(ConfigError, match=r"update.mode = 'engines' and adapter.kind = 'lora': the model is frozen"):
        load_config(None, ["--adapter.kind=lora", "--update.mode=engines"])
    with pytest.raises(ConfigError, match=r"update.mode = 'frozen' is chosen for adapter runs"):
        load_config(None, ["--update.mode=frozen"])
    # peft's 'all-linear' (it was "not module names"): every linear layer of the blocks, the empty target
    assert load_config(None, ["--adapter.kind=lora", "--adapter.target=all-linear"]).adapter.target == []
    with pytest.raises(ConfigError, match=r"'all-linear' stands alone"):
        load_config(None, ["--adapter.kind=lora", "--adapter.target=all-linear,q_proj"])


def _train(cfg, init, steps, *, resume=None):
    from test_parity import build_model, tensor_source

    from tiertrain.training.trainer import Trainer

    skeleton, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    with Trainer(cfg, weights=tensor_source(skeleton, init)) as tr:
        tr.initialize(progress=False)
        if resume is not None:
            tr.restore(resume)
        losses = [tr.train_step().extra["losses"] for _ in range(steps)]
        path = tr.save_checkpoint().path
        return losses, {n: p.detach().clone() for n, p in tr.rt.adapters.named()}, path


def test_a_resumed_lora_run_is_the_straight_run_bit_for_bit(tmp_path):
    cfg = lora_config(tmp_path / "a", "llama", steps=4)
    init = weights_of(reference_model(cfg))
    straight, w_straight, _ = _train(cfg, init, 4)
    cfg2 = lora_config(tmp_path / "b", "llama", steps=4)
    first, _, ckpt = _train(cfg2, init, 2)
    second, w_resumed, _ = _train(cfg2, init, 2, resume=ckpt)
    assert first + second == straight
    assert all(torch.equal(w_straight[n], w_resumed[n]) for n in w_straight)
    # another adapter config, or none, cannot continue it
    other = lora_config(tmp_path / "c", "llama", steps=4, rank=8)
    with pytest.raises(ConfigError, match=r"made with adapter rank 4.*this run has rank 8"):
        _train(other, init, 1, resume=ckpt)
    plain = small_config(tmp_path / "d", kind="llama", steps=4)
    plain.model.n_kv_heads = 2
    with pytest.raises(ConfigError, match=r"made with adapter kind 'lora'.*this run has kind 'none'"):
        _train(plain, init, 1, resume=ckpt)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_export_gives_a_peft_adapter_that_transformers_loads_with_the_same_logits(tmp_path, kind):
    """The exported directory, loaded by ``PeftModel.from_pretrained`` on the original base,
    computes the logits of the base with our trained adapters, bit for bit; ``--merge`` gives
    full weights that ``from_pretrained`` loads, within rounding of the merge."""
    from transformers import AutoModelForCausalLM

    from tiertrain.checkpoint.export import export_checkpoint

    cfg = lora_config(tmp_path / "run", kind, steps=2)
    ref = reference_model(cfg)
    init = weights_of(ref)
    _, trained, ckpt = _train(cfg, init, 2)
    out = export_checkpoint(ckpt, str(tmp_path / "adapter"))
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    base = copy.deepcopy(ref.hf).eval()
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), out).eval()
    ours_model = _layered(cfg, base)
    ours = LoRA(ours_model, cfg.adapter, seed=0, device="cpu")
    with torch.no_grad():
        for name, p in ours.named():
            p.copy_(trained[name])
        want = ours_model.hf_model(input_ids=x).logits
        got = loaded(input_ids=x).logits
        assert torch.equal(got, want)
        assert not torch.equal(want, base(input_ids=x).logits)  # the adapters change the model
    merged_dir = export_checkpoint(ckpt, str(tmp_path / "merged"), merge=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, want, rtol=1e-4, atol=1e-4)


def test_a_peft_adapter_continues_training_from_its_weights(tmp_path):
    """``adapter.init_from``: the exported adapter read back as the starting point; a directory
    made with another rank is refused, naming it; left unset, its settings are the directory's."""
    from tiertrain.checkpoint.export import export_checkpoint

    cfg = lora_config(tmp_path / "a", "llama", steps=2)
    init = weights_of(reference_model(cfg))
    _, trained, ckpt = _train(cfg, init, 2)
    out = export_checkpoint(ckpt, str(tmp_path / "adapter"))
    cont = lora_config(tmp_path / "b", "llama", steps=1)
    cont.adapter.init_from = out
    from test_parity import build_model, tensor_source

    from tiertrain.training.trainer import Trainer

    skeleton, _ = build_model(cont.model, param_dtype=torch.float32, seed=0)
    with Trainer(cont, weights=tensor_source(skeleton, init)) as tr:
        assert all(torch.equal(p, trained[n]) for n, p in tr.rt.adapters.named())
    bad = lora_config(tmp_path / "c", "llama", steps=1, rank=8)
    bad.adapter.init_from = out
    with pytest.raises(ConfigError, match=r"was made with rank 4 \(here 8\)"):
        Trainer(bad)
    # what the flags leave unset is the directory's own: no need to restate its rank and targets
    from tiertrain.config import load_config

    own = load_config(None, ["--adapter.kind=lora", f"--adapter.init_from={out}"]).adapter
    assert (own.rank, own.alpha, own.target, own.target_parameters) == (4, 9.0, sorted(cfg.adapter.target), [])
    assert (
        load_config(None, ["--adapter.kind=lora", f"--adapter.init_from={out}", "--adapter.rank=8"]).adapter.rank == 8
    )
    # target_modules as module paths, as peft writes 'all-linear' out: the same adapters; some
    # layers' paths alone (peft would adapt those alone) refused, naming a module left out
    import json

    conf = os.path.join(out, "adapter_config.json")
    plain = json.load(open(conf))
    paths = [n for n, _ in reference_model(cfg).hf.named_modules() if n.rsplit(".", 1)[-1] in cfg.adapter.target]
    json.dump({**plain, "target_modules": paths}, open(conf, "w"))
    assert load_config(None, ["--adapter.kind=lora", f"--adapter.init_from={out}"]).adapter.target == own.target
    with Trainer(cont, weights=tensor_source(skeleton, init)) as tr:
        assert all(torch.equal(p, trained[n]) for n, p in tr.rt.adapters.named())
    json.dump({**plain, "target_modules": [p for p in paths if ".layers.0." in p]}, open(conf, "w"))
    with pytest.raises(ConfigError, match=r"leave out \d+ of the modules of those names \(first: model.layers.1."):
        Trainer(cont, weights=tensor_source(skeleton, init))


@pytest.mark.parametrize(
    "setting",
    [{"alpha_pattern": {"q_proj": 64}}, {"modules_to_save": ["lm_head"]}, {"lora_bias": True}, {"bias": "all"},
     {"rank_pattern": {"q_proj": 2}}, {"use_dora": True}, {"layers_to_transform": [0]}],
)  # fmt: skip
def test_a_peft_adapter_with_settings_lora_here_does_not_compute_is_refused_by_name(tmp_path, setting):
    """adapter.init_from read a peft adapter with alpha_pattern, modules_to_save (a trained head),
    lora_bias or bias = 'all' as plain LoRA: its loss was another model's, without a word. Each is
    refused by name, as is a weights file holding tensors the run's LoRA does not take."""
    import json

    from safetensors.torch import load_file, save_file

    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.config import load_config

    cfg = lora_config(tmp_path / "a", "llama", steps=1)
    _, _, ckpt = _train(cfg, weights_of(reference_model(cfg)), 1)
    out = export_checkpoint(ckpt, str(tmp_path / "adapter"))
    conf = os.path.join(out, "adapter_config.json")
    plain = json.load(open(conf))
    json.dump({**plain, **setting}, open(conf, "w"))
    ((key, value),) = setting.items()
    with pytest.raises(ConfigError, match=rf"adapter_config.json sets {key} = {re.escape(repr(value))}, which"):
        load_config(None, ["--adapter.kind=lora", f"--adapter.init_from={out}"])
    json.dump(plain, open(conf, "w"))
    weights = os.path.join(out, "adapter_model.safetensors")
    save_file({**load_file(weights), "base_model.model.lm_head.weight": torch.zeros(2, 2)}, weights)
    cont = lora_config(tmp_path / "b", "llama", steps=1)
    cont.adapter.init_from = out
    from tiertrain.training.trainer import Trainer

    with pytest.raises(ConfigError, match=r"holds 1 tensor\(s\) this run's LoRA does not take \(first: base_model"):
        Trainer(cont)


def _hf_base(tmp_path, kind):
    """A saved transformers model (random weights): the base an adapter is trained on."""
    from transformers import AutoModelForCausalLM

    from tiertrain.config import ModelConfig
    from tiertrain.models import hf_config_from

    torch.manual_seed(5)
    mc = ModelConfig(kind=kind, n_layers=2, d_model=64, n_heads=4, vocab_size=256, max_seq_len=64)
    if kind == "llama":
        mc.n_kv_heads = 2
    hf = AutoModelForCausalLM.from_config(hf_config_from(mc))
    hf.save_pretrained(tmp_path / "base")
    return str(tmp_path / "base"), hf.eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_eval_and_generate_apply_the_adapters_of_a_checkpoint_or_a_peft_directory(tmp_path, kind):
    """A LoRA run on a transformers directory, then: ``evaluate`` of its checkpoint is the run's
    logged validation loss (the adapters applied, not merged); ``generate`` from the checkpoint
    and from the exported peft directory on the base both give transformers' greedy tokens of
    ``PeftModel.from_pretrained`` on that base."""

    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.config import Config, ModelConfig
    from tiertrain.inference.generate import Sampling, generate
    from tiertrain.inference.weights import CheckpointWeights

    base_dir, base = _hf_base(tmp_path, kind)
    cfg = lora_config(tmp_path / "run", kind, steps=2)
    cfg.model = ModelConfig(hf_dir=base_dir)
    cfg.optim.lr = 2e-2  # adapters that move the tokens
    ck, _ = train_then_evaluate(cfg, tmp_path)
    out = export_checkpoint(ck, str(tmp_path / "adapter"))
    prompts = [[3, 17, 42, 9], [5, 8]]
    want = []
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), out).eval()
    plain = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            want.append(loaded.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[0, len(p) :].tolist())
            plain.append(base.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[0, len(p) :].tolist())
    assert want != plain  # the adapters change the tokens
    s = Sampling(max_new_tokens=8, stop_at_eos=False)
    with CheckpointWeights(ck) as w:
        gcfg = Config.from_dict(w.config, environment=False)
        assert generate(gcfg, prompts, s, weights=w.source) == want
    pcfg = lora_config(tmp_path / "gen", kind)
    pcfg.model = ModelConfig(hf_dir=base_dir)
    pcfg.adapter.init_from = out
    assert generate(pcfg, prompts, s) == want


def test_a_bfloat16_bases_adapter_evaluates_on_the_model_directory_as_on_its_checkpoint(tmp_path):
    """An adapter trained on a bf16 base (fp32 compute) applied to the model directory with
    ``--model.base_dtype=bfloat16``: eval and generation compute on the base rounded as the run
    kept it, equal to the checkpoint's (the flag was ignored: the fp32 base, another loss)."""
    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.config import Config, ModelConfig
    from tiertrain.inference.evaluate import evaluate
    from tiertrain.inference.generate import Sampling, generate
    from tiertrain.inference.weights import CheckpointWeights

    base_dir, _ = _hf_base(tmp_path, "llama")
    cfg = lora_config(tmp_path / "run", "llama", steps=2)
    cfg.model = ModelConfig(hf_dir=base_dir, base_dtype="bfloat16")
    cfg.optim.lr = 2e-2
    ck, _ = train_then_evaluate(cfg, tmp_path)
    out = export_checkpoint(ck, str(tmp_path / "adapter"))
    prompts, s = [[3, 17, 42, 9], [5, 8]], Sampling(max_new_tokens=8, stop_at_eos=False)
    with CheckpointWeights(ck) as w:
        ecfg = Config.from_dict(w.config, environment=False)
        ecfg.train.run_dir = str(tmp_path / "eval-run")
        want, tokens = evaluate(ecfg, weights=w.source).loss, generate(ecfg, prompts, s, weights=w.source)
    for rounded in (True, False):
        pcfg = lora_config(tmp_path / "gen", "llama")
        pcfg.model = ModelConfig(hf_dir=base_dir, base_dtype="bfloat16" if rounded else None)
        pcfg.adapter.init_from = out
        pcfg.data = dataclasses.replace(ecfg.data)
        got = evaluate(pcfg).loss
        assert (got == want) == rounded, (got, want)
    pcfg.model.base_dtype = "bfloat16"
    assert generate(pcfg, prompts, s) == tokens
    # merged: written in float32, as config.json says (it was bf16 labelled float32, the deltas rounded)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    merged = export_checkpoint(ck, str(tmp_path / "merged"), merge=True)
    shards = [load_file(os.path.join(merged, n)) for n in os.listdir(merged) if n.endswith(".safetensors")]
    assert {t.dtype for sd in shards for t in sd.values()} == {torch.float32}
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        got = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
               for p in prompts]  # fmt: skip
    assert got == tokens


@pytest.mark.slow
@pytest.mark.parametrize("base_dtype", [None, "bfloat16"])
def test_lora_on_ranks_trains_the_grouped_peft_reference_bit_for_bit(tmp_path, base_dtype):
    """2 ranks, the frozen base sharded over their tiers and gathered per unit (a bf16 base
    gathered in bf16, widened after: the link carries half the bytes), each rank's adapter
    gradients summed in rank order: peft's LoRA trained on the same grouping of micro-batches in
    one process (on the bf16-rounded base), bit for bit; the same adapters on every rank."""
    from test_dist_train import run_ranks

    cfg = lora_config(tmp_path, "llama", layers=2, micro_batches=2, steps=3)
    cfg.model.base_dtype = base_dtype
    ref_model, out = run_ranks(tmp_path / "ranks", cfg, 2)
    if base_dtype:
        with torch.no_grad():
            for p in ref_model.parameters():
                p.copy_(p.to(torch.bfloat16).float())  # the base as the run keeps it
    ref_model, names = peft_reference(cfg, ref_model)
    ref_losses, ref_weights = reference_train(cfg, ref_model, ranks=2)
    for step, want in enumerate(ref_losses):
        assert [x for r in range(2) for x in out[r]["losses"][step]] == want
    assert [o["mode"] for o in out] == ["frozen", "frozen"]
    for name, p in out[0]["adapters"].items():
        assert torch.equal(p, ref_weights[names[name]]), name
        assert torch.equal(p, out[1]["adapters"][name])


@pytest.mark.parametrize("host_param_mib", [0, 64])  # the base on the tier / in memory
def test_a_bfloat16_base_under_float32_compute_is_peft_on_the_rounded_base_and_reads_half(tmp_path, host_param_mib):
    """``model.base_dtype = 'bfloat16'`` with fp32 compute: the frozen model is kept in bf16 and
    upcast per unit as it is loaded, so a run is peft's on plain PyTorch with the base's weights
    rounded to bf16, bit for bit; the storage tier reads half the bytes (the cost model's too);
    the checkpoint holds the base in bf16 and resumes."""
    from tiertrain.training.trainer import Trainer

    cfg = lora_config(tmp_path / "a", "llama", steps=3, stash_host_mib=64, host_param_mib=host_param_mib)
    cfg.model.base_dtype = "bfloat16"
    ref_model = reference_model(cfg)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the base as the run keeps it
    init = weights_of(ref_model)
    ref_model, names = peft_reference(cfg, ref_model)
    ref_losses, ref_weights = reference_train(cfg, ref_model)
    losses, _, trained_path = _train(cfg, init, 3)
    full = lora_config(tmp_path / "b", "llama", steps=3, stash_host_mib=64, host_param_mib=host_param_mib)  # in fp32
    with Trainer(cfg) as tr, Trainer(full) as tf:
        recs = [second_step_and_traffic(t) for t in (tr, tf)]
        assert tr.update.states[0].dtype == torch.bfloat16
        # the pools: the bf16 base is widened inside the slots, no staging memory of its own
        assert tr.budget.fixed == tf.budget.fixed
    (half, t_half), (whole, t_whole) = recs
    assert half.ssd_read_bytes == t_half.read and whole.ssd_read_bytes == t_whole.read
    if host_param_mib == 0:
        assert 0.47 < half.ssd_read_bytes / whole.ssd_read_bytes < 0.53  # half, but for units' aligned ends
    else:
        assert half.ssd_read_bytes == whole.ssd_read_bytes == 0
    assert losses == ref_losses
    from safetensors.torch import load_file

    got = load_file(os.path.join(trained_path, "adapter.safetensors"))
    for name, ref_name in names.items():
        assert torch.equal(got[name], ref_weights[ref_name]), name
    from tiertrain.checkpoint.export import export_checkpoint

    merged = export_checkpoint(trained_path, str(tmp_path / "merged"), merge=True)  # the bf16 layout read back
    assert any(n.endswith(".safetensors") for n in os.listdir(merged))
    with pytest.raises(ConfigError, match=r"model.base_dtype = 'bfloat16' is for a frozen model under adapters"):
        from tiertrain.config import load_config

        load_config(None, ["--model.base_dtype=bfloat16"])


@pytest.mark.parametrize("n", [1, 7, 1000, 4097, (1 << 20) + 3, (5 << 20) + 12345])
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_a_unit_is_widened_inside_its_own_slot(n, narrow):
    """The narrow unit read into the back of its fp32 slot and widened in place is the plain
    conversion, bit for bit, at every size (tails, units smaller than one aligned block)."""
    from tiertrain.io.align import round_down
    from tiertrain.update.frozen import widen_in_place

    src = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(narrow)
    out = torch.full((n,), float("nan"))
    offset = round_down(n * 2)
    out.view(torch.uint8)[offset : offset + 2 * n].view(narrow).copy_(src)
    widen_in_place(out, offset, narrow)
    assert torch.equal(out, src.float())


_MEMORY_CHILD = r"""
import json, os, sys, torch
import transformers.models.llama.modeling_llama  # a library's code, not the run's memory
from transformers import AutoModelForCausalLM, LlamaConfig
from tiertrain.config import load_config
from tiertrain.device import host_rss, host_peak_rss, reset_peak_rss
import tiertrain.training.trainer as T
from tiertrain.training.trainer import Trainer
d, mib = sys.argv[1], int(sys.argv[2])
planner = {}
def plan_run(*a, _plan_run=T.plan_run, **k):  # the process's peak once the planner's probes are done
    r = _plan_run(*a, **k)
    planner.update(peak=host_peak_rss(), measured=r.rates is not None)
    return r
T.plan_run = plan_run
torch.manual_seed(0)
hf = LlamaConfig(num_hidden_layers=2, hidden_size=512, intermediate_size=1536, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False)
AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16).save_pretrained(f"{d}/base")
cfg = load_config(None, [f"--model.hf_dir={d}/base", f"--io.paths={d}/ssd", f"--train.run_dir={d}/run",
    "--data.seq_len=64", "--data.micro_batch_size=1", "--data.micro_batches=2", "--data.tokenizer=bytes",
    "--train.steps=2", "--train.progress=false", "--train.predict=false", "--checkpoint.at_end=false",
    f"--memory.host_mib={mib}", "--adapter.kind=lora", "--adapter.target=q_proj,v_proj,down_proj",
    "--model.base_dtype=bfloat16"])
os.makedirs(f"{d}/ssd")
if not reset_peak_rss():
    print(json.dumps({"unsupported": "cannot reset the peak RSS"})); sys.exit(0)
base = host_rss()
with Trainer(cfg) as tr:
    tr.initialize(progress=False)
    losses = [tr.train_step().loss for _ in range(2)]
    print(json.dumps(dict(growth=host_peak_rss() - base, plan_growth=planner["peak"] - base,
                          measured=planner["measured"], used=tr.budget.host_used, fixed=tr.budget.fixed,
                          unit=tr.layout.max_unit_numel * 4, slots=tr.cfg.memory.device_slots, losses=losses,
                          step_working=tr.budget.step_working, trim_room=tr.budget.host_bytes + tr._rss_at_start
                          - tr.heap_trim.limit,
                          lines=tr.budget.lines())))
"""


@pytest.mark.slow
def test_a_frozen_runs_fixed_memory_is_two_units_and_a_short_budget_takes_a_slot(tmp_path):
    """A LoRA run's working set is two units (initialisation holds a unit in the base's dtype and
    its source's tensor; no gradient of the model is ever formed), not training's four; a bf16
    base is widened inside its slots (no staging pool); a budget short of the default pools
    lowers the buffers, then the slots to two, and says so. Its steps hold none of those units, so
    the heap is trimmed only once the process nears its budget less their activations, and the kept
    activations may take initialisation's units' room. Measured:
    the process grows by less than the budget (from after the libraries' imports), and less in
    the planner's probes than in the steps, on a model whose largest unit is its 32000 x 512
    vocabulary matrix."""
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD, str(tmp_path), "420"], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "unsupported" in out:
        pytest.skip(out["unsupported"])
    unit, fixed = out["unit"], out["fixed"]
    assert unit >= 32000 * 512 * 4  # the vocabulary matrix, its end aligned
    assert fixed["parameter slots"] == 2 * unit and out["slots"] == 2
    from tiertrain.cost.budget import WORKING_SLACK

    assert 2 * unit < fixed["working set"] - WORKING_SLACK < 3 * unit  # two units and two micro-batches' activations
    # the steps hold no unit beyond the slots: the heap is trimmed only within their activations of the budget
    assert fixed["working set"] - out["step_working"] == 2 * unit == fixed["working set"] - out["trim_room"]
    assert "upcast staging" not in fixed and fixed["gradient buffers"] == 0
    assert any("memory.device_slots 3 -> 2 slots" in line for line in out["lines"])
    assert out["used"] <= 420 * MIB and out["growth"] <= 420 * MIB, out["growth"] / MIB
    # the kept activations take the room of initialisation's units too (no step holds them), and
    # the process still grows by less than its budget
    kept = next(line for line in out["lines"] if "kept activations:" in line).split()
    assert kept[2] == kept[4] != "0"  # all of them kept ("N of N MiB")
    assert any("kept activations in the working set's room that only initialisation holds" in x for x in out["lines"])
    # the steps set the peak, not the planner's probes (a budget to fill: the machine measured),
    # which hold no gradient buffer for a frozen unit and no unit-sized temporaries (they did:
    # 241 MiB here, the run's peak; now 162 against the steps' 214)
    assert out["measured"] and out["plan_growth"] < out["growth"] <= 420 * MIB, (out["plan_growth"], out["growth"])
    assert out["plan_growth"] <= sum(fixed.values())
    assert all(x == x for x in out["losses"])  # finite losses: none is NaN


def test_the_planners_probes_leave_nothing_in_the_adapters(tmp_path):
    """Where the machine is measured (the planner with a budget to fill, the step-time
    prediction before the first step), the unit timings run the blocks, and with them the
    adapters' hooks: the gradients they left were added to step 1's (such a run differed from
    peft's by about 1e-6, and from run to run). None stay."""
    from tiertrain.cost.budget import PLANNED
    from tiertrain.training.trainer import Trainer

    cfg = lora_config(tmp_path, "llama", steps=2)
    for f in PLANNED:
        setattr(cfg.memory, f, None)
    with Trainer(cfg) as tr:  # everything fits: nothing measured; the figures for a budget that does not
        fixed, demand = sum(tr.budget.fixed.values()), sum(tr.budget.demand.values())
    cfg.memory.host_mib = (fixed + demand // 2) // MIB
    with Trainer(cfg) as tr:
        assert tr._rates is not None  # measured
        assert all(p.grad is None for p in tr.rt.adapters.params())
    cfg.memory.host_mib = None  # nothing measured by the planner ...
    with Trainer(cfg) as tr:
        assert tr.predict() is not None  # ... but by the prediction the run starts with
        assert all(p.grad is None for p in tr.rt.adapters.params())
