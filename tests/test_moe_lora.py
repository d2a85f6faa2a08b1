"""LoRA on a mixture of experts' 3-D expert parameters (``adapter.target_parameters``, peft's
``target_parameters``): the same losses and adapters as peft's ``ParamWrapper`` on plain
PyTorch + AdamW, bit for bit in fp32, with the experts' parameters bound to the parameter
store's slots as always (``adapters/lora.py``)."""

from __future__ import annotations

import pytest
import torch
from test_lora import assert_lora_parity, train_then_evaluate
from test_moe import _config, _moe_config

pytest.importorskip("peft")


def _saved(tmp_path, family: str) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path / "m")
    return str(tmp_path / "m")


def _lora(tmp_path, path, *, target=(), params=("gate_up_proj", "down_proj"), **kw):
    kw.setdefault("micro_batches", 2)
    kw.setdefault("steps", 3)
    kw.setdefault("clip", 0.05)
    cfg = _moe_config(tmp_path, path, **kw)
    cfg.adapter.kind, cfg.adapter.rank, cfg.adapter.alpha = "lora", 4, 9.0
    cfg.adapter.target, cfg.adapter.target_parameters = list(target), list(params)
    cfg.update.mode = "auto"
    return cfg


@pytest.mark.parametrize(
    "family,target,params",
    [
        ("mixtral", (), ("gate_up_proj", "down_proj")),  # both stacks of a module: peft's nested wrappers
        ("qwen3_moe", ("q_proj",), ("mlp.experts.down_proj",)),  # with attention; a dense first layer
        ("gpt_oss", (), ("gate_up_proj",)),  # experts stored [experts, in, out] (is_transposed)
        ("llama4_text", (), ("gate_up_proj", "down_proj")),  # every expert on every token, transposed too
        ("jetmoe", (), ("mlp.input_linear.weight",)),  # JetMoeParallelExperts' [experts, out, in] weight
    ],
)
def test_lora_on_the_experts_is_peft_bit_for_bit(tmp_path, family, target, params):
    tr = assert_lora_parity(_lora(tmp_path, _saved(tmp_path, family), target=target, params=params))
    stacks = [t for t in tr.rt.adapters.targets if t.param is not None]
    assert stacks and {t.param for t in stacks} == {p.rsplit(".", 1)[-1] for p in params}
    assert tr.executor.recomputed > 0  # the blocks' forward run again in the backward, with the same weights


@pytest.mark.parametrize("activations", ["keep", "offload", "device"])
def test_with_kept_or_offloaded_graphs_or_a_device_of_its_own(tmp_path, activations):
    """The experts' adapted weights saved in the kept graphs (fresh tensors, not slot memory), or
    written to the storage tier with the activations and read back; or the units uploaded to a
    device with memory of its own (simulated: copies complete later, memory poisoned when given
    back), some from host memory: peft's bits still."""
    from tiertrain.device.simulated import AsyncCpuDevice

    kw = {"keep": dict(keep_act_mib=64), "offload": dict(activations="offload"), "device": dict(host_param_mib=1)}
    device = AsyncCpuDevice(delay=0.001) if activations == "device" else None
    tr = assert_lora_parity(_lora(tmp_path, _saved(tmp_path, "mixtral"), **kw[activations]), device)
    if activations == "keep":
        assert tr.executor.kept_pairs > 0 and tr.executor.recomputed == 0
    elif activations == "offload":
        assert tr.offloaded is not None


def test_a_wrong_delta_is_not_peft(tmp_path, monkeypatch):
    """The test above can fail: B's columns read expert-major (a plausible slip: peft reads them
    rank-major, A's rows expert-major), the adapters still train and differ from peft's."""
    from tiertrain.adapters import lora

    def expert_major(t, a, b, dtype):
        a3 = a.reshape(t.experts, -1, a.shape[-1])
        b3 = b.reshape(b.shape[0], t.experts, -1).permute(1, 0, 2)
        return b3.to(dtype), a3.to(dtype)

    monkeypatch.setattr(lora, "expert_factors", expert_major)
    with pytest.raises(AssertionError):
        assert_lora_parity(_lora(tmp_path, _saved(tmp_path, "mixtral"), steps=2))


def test_the_adapted_experts_change_the_loss_and_the_base_is_untouched(tmp_path):
    """Step 1 is the base model's loss (B starts at zero); after a step the experts' adapters
    have moved and the loss differs from the frozen base's on the same batch; the experts'
    Parameters are still the store's, bound to its memory, with the base's values."""
    from reference import reference_model, weights_of
    from test_parity import run_tiertrain

    path = _saved(tmp_path, "mixtral")
    cfg = _lora(tmp_path / "a", path, steps=2)
    cfg.optim.lr = 1e-2
    still = _lora(tmp_path / "b", path, steps=2)
    still.optim.lr = 0.0  # the adapters never move: the base's losses
    init = weights_of(reference_model(cfg))
    moved, _, tr = run_tiertrain(cfg, init)
    base, _, _ = run_tiertrain(still, init)
    assert moved[0] == base[0] and moved[1] != base[1]
    assert all(p.abs().sum() > 0 for n, p in tr.rt.adapters.named() if "lora_B" in n)
    for t in tr.rt.adapters.targets:
        assert isinstance(t.module._parameters[t.param], torch.nn.Parameter)  # put back after every forward


def test_bad_parameter_targets_are_named(tmp_path):
    from tiertrain.config import ConfigError, load_config
    from tiertrain.training.trainer import Trainer

    path = _saved(tmp_path, "gpt_oss")
    with pytest.raises(
        ConfigError, match=r"'gate_proj' matches no parameter.*3-D parameters are gate_up_proj, down_proj"
    ):
        Trainer(_lora(tmp_path, path, params=("gate_proj",)))
    with pytest.raises(
        ConfigError,
        match=r"'gate_up_proj_bias' matches blocks.0.layer.mlp.experts.gate_up_proj_bias of shape \(4, 256\), not an experts. 3-D",
    ):
        Trainer(_lora(tmp_path, path, params=("gate_up_proj_bias",)))
    with pytest.raises(ConfigError, match=r"'q_proj.weight' matches .* not an experts' 3-D parameter"):
        Trainer(_lora(tmp_path, path, params=("q_proj.weight",)))
    with pytest.raises(ConfigError, match=r"adapter.dropout = 0.1: must be 0 with adapter.target_parameters"):
        load_config(None, ["--adapter.kind=lora", "--adapter.target_parameters=down_proj", "--adapter.dropout=0.1"])
    with pytest.raises(ConfigError, match=r"adapter.target_parameters = \['down proj'\]"):
        load_config(None, ["--adapter.kind=lora", "--adapter.target_parameters=down proj"])
    # JetMoE's stacks are each a module's "weight": the names offered are those that then work
    (tmp_path / "jet").mkdir()
    jet = _saved(tmp_path / "jet", "jetmoe")
    with pytest.raises(ConfigError, match=r"3-D parameters are input_linear.weight, output_linear.weight$"):
        Trainer(_lora(tmp_path / "jet", jet, params=("gate_up_proj",)))
    with Trainer(_lora(tmp_path / "jet", jet, params=("input_linear.weight", "output_linear.weight"))) as tr:
        assert tr.rt.adapters.stacks == ["input_linear.weight", "output_linear.weight"]


def test_export_eval_and_generate_apply_the_experts_adapters(tmp_path):
    """A run's checkpoint: ``evaluate`` gives the run's logged validation loss; the exported peft
    directory (``target_parameters`` in its config, the nested wrappers' key names) loads with
    ``PeftModel.from_pretrained`` on the base and gives our logits bit for bit; ``generate`` from
    the checkpoint and from that directory (``adapter.init_from``) gives its greedy tokens, which
    the adapters changed; ``--merge`` folds peft's per-expert delta into the experts."""
    import copy
    import json

    import peft
    from test_generate import _hf_generate
    from test_lora import _layered
    from transformers import AutoModelForCausalLM

    from tiertrain.adapters import LoRA
    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.config import Config
    from tiertrain.inference.generate import Sampling, generate
    from tiertrain.inference.weights import CheckpointWeights

    path = _saved(tmp_path, "mixtral")
    cfg = _lora(tmp_path / "run", path, target=("q_proj",), steps=2)
    cfg.optim.lr = 5e-2  # adapters that move the tokens
    ck, trained = train_then_evaluate(cfg, tmp_path)
    out = export_checkpoint(ck, str(tmp_path / "adapter"))
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["target_parameters"] == ["down_proj", "gate_up_proj"] and conf["target_modules"] == ["q_proj"]
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    base.config.output_router_logits = False  # transformers' generate fails with it (tests/test_moe.py)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), out).eval()
    ours_model = _layered(cfg, base)
    ours = LoRA(ours_model, cfg.adapter, seed=0, device="cpu")
    ours.load_named(trained)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours_model.hf_model(input_ids=x).logits
        assert torch.equal(loaded(input_ids=x).logits, want)
        assert not torch.equal(want, base(input_ids=x).logits)
    prompts = [list(range(10, 30)), list(range(40, 52))]
    with torch.no_grad():
        tokens = _hf_generate(loaded, prompts, 8)
        assert tokens != _hf_generate(base, prompts, 8)  # the adapters change the tokens
    s = Sampling(max_new_tokens=8, stop_at_eos=False)
    with CheckpointWeights(ck) as w:
        gcfg = Config.from_dict(w.config, environment=False)
        gcfg.data.micro_batch_size = 2
        assert generate(gcfg, prompts, s, weights=w.source) == tokens
    pcfg = _lora(tmp_path / "gen", path, target=("q_proj",))
    pcfg.adapter.init_from, pcfg.data.micro_batch_size = out, 2
    assert generate(pcfg, prompts, s) == tokens
    # the experts read as the routing reaches them: before the adapters' weights are made of them
    pcfg.io.weights, pcfg.memory.host_param_mib = "tier", 0
    assert generate(pcfg, prompts, s) == tokens
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(ck, str(tmp_path / "merged"), merge=True)).eval()
    theirs = copy.deepcopy(loaded).merge_and_unload()
    for name in ("gate_up_proj", "down_proj"):  # the experts' deltas merged (as peft merges them)
        got, was, want_w = (getattr(m.model.layers[1].mlp.experts, name) for m in (merged, base, theirs))
        assert torch.equal(got, want_w) and (got - was).abs().max() > 1e-3
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, want, rtol=1e-4, atol=1e-4)


def test_the_least_budget_said_for_adapted_experts_is_near_what_they_take(tmp_path, capsys):
    """LoRA on 64 experts under a budget too small: the least budget said before any measurement
    (about 845 MiB) was refused in turn at 1,190 (each forward's adapted copy of the experts,
    W + scaling x A B, saved for the backward, left out of the estimate): now within 10% of it."""
    import re

    import transformers as t

    from tiertrain.cli import main

    torch.manual_seed(0)
    config = t.Qwen3MoeConfig(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, num_experts=64, num_experts_per_tok=4)  # fmt: skip
    t.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    flags = ["train", f"--model.hf_dir={tmp_path / 'm'}", "--adapter.kind=lora", "--train.steps=1",
             "--adapter.target_parameters=gate_up_proj,down_proj", f"--io.paths={tmp_path / 's'}",
             f"--train.run_dir={tmp_path / 'r'}", "--train.predict=false", "--train.progress=false"]  # fmt: skip
    assert main([*flags, "--memory.host_mib=200"]) == 2
    said = int(re.search(r"raise memory.host_mib to about ([\d,]+)", capsys.readouterr().err)[1].replace(",", ""))
    if main([*flags, f"--memory.host_mib={said}"]) != 0:
        need = re.search(r"sizes set explicitly \(([\d,]+) MiB, of which", capsys.readouterr().err)
        assert int(need[1].replace(",", "")) <= 1.1 * said, (need[0], said)


@pytest.mark.parametrize(
    "family,target",
    [
        # the usual recipe's names: peft (transformers 5) takes gate/up/down for the experts, gate_up_proj at 2r,
        # and leaves the dense first layer's MLP without adapters
        ("qwen3_moe", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        ("mixtral", ("q_proj", "w1", "w2", "w3")),  # Mixtral's old expert names: refused as matching nothing before
        ("qwen3_moe", ("q_proj", "down_proj")),  # down_proj alone: the experts' down_proj at the rank
    ],
)
def test_the_experts_old_names_in_the_target_are_read_as_peft_reads_them(tmp_path, family, target):
    """``adapter.target`` with gate_proj/up_proj/down_proj on Qwen3-MoE (w1/w2/w3 on Mixtral)
    adapted the dense layers' MLP by those names, where peft adapts the experts' fused
    parameters instead (gate_up_proj at twice the rank and alpha): trained not as peft trains,
    and the export loaded in peft with the experts' adapters missing (eval loss 5.3217 against
    peft's 5.3246). Now peft's bits, and the export gives our logits in peft."""
    import copy
    import json

    import peft
    from test_lora import _layered
    from transformers import AutoModelForCausalLM

    from tiertrain.adapters import LoRA
    from tiertrain.adapters.peft_io import export_peft

    path = _saved(tmp_path, family)
    cfg = _lora(tmp_path, path, target=target, params=())
    tr = assert_lora_parity(cfg)
    lora = tr.rt.adapters
    assert sorted(lora.kinds) == sorted(t for t in target if t in ("q_proj", "k_proj", "v_proj", "o_proj"))
    fused = {"gate_proj", "w1"} & set(target)
    stacks = {t.param: t for t in lora.targets if t.param is not None}
    assert set(stacks) == ({"gate_up_proj", "down_proj"} if fused else {"down_proj"})
    if fused:
        a = dict(lora.named())[f"{stacks['gate_up_proj'].name}.lora_A.weight"]
        assert a.shape[0] == 2 * cfg.adapter.rank * stacks["gate_up_proj"].experts
    trained = {n: p.detach().clone() for n, p in lora.named()}
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    ours_model = _layered(cfg, base)
    ours = LoRA(ours_model, cfg.adapter, seed=0, device="cpu")
    ours.load_named(trained)
    export_peft(ours_model, ours, str(tmp_path / "adapter"))
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert not {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"} & set(conf["target_modules"])
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, ours_model.hf_model(input_ids=x).logits)


def test_the_default_target_and_a_half_fused_pair_on_a_converted_family(tmp_path):
    """Every linear layer (the default) on Qwen3-MoE: not its dense MLP's gate/up/down (peft would
    take those names for the experts), said; one of a fused pair refused as peft refuses it."""
    from tiertrain.config import ConfigError
    from tiertrain.training.trainer import Trainer

    path = _saved(tmp_path, "qwen3_moe")
    with Trainer(_lora(tmp_path, path, params=())) as tr:
        assert sorted(tr.rt.adapters.kinds) == ["k_proj", "o_proj", "q_proj", "v_proj"]
        assert "not the linear layers named gate_proj, up_proj, down_proj" in tr.rt.adapters.describe()
    with pytest.raises(ConfigError, match=r"takes 'gate_proj' for the experts' fused gate_up_proj.*without 'up_proj'"):
        Trainer(_lora(tmp_path, path, target=("q_proj", "gate_proj"), params=()))
    with pytest.raises(ConfigError, match=r"peft takes 'gate' for the router's weight"):
        Trainer(_lora(tmp_path, path, target=("q_proj", "gate"), params=()))


def test_a_rank_above_some_layers_width_is_peft_and_a_fused_adapter_continues(tmp_path, caplog):
    """Qwen2-MoE's every-linear default was refused ("adapter.rank = 4 is above the width of
    ...shared_expert_gate (64 -> 1) ... lower it") where peft trains it: now peft's bits, said.
    An export with gate_up_proj at twice the rank continues (adapter.init_from) with the names
    it was made from, and is refused by name without them."""
    import logging

    from tiertrain.adapters.peft_io import export_peft
    from tiertrain.config import ConfigError
    from tiertrain.training.trainer import Trainer

    path = _saved(tmp_path, "qwen2_moe")
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        assert_lora_parity(_lora(tmp_path, path, target=("q_proj", "shared_expert_gate"), params=()))
    assert "adapter.rank = 4 is above the width of 2 adapted layer(s)" in caplog.text
    (tmp_path / "q3").mkdir()
    q3 = _saved(tmp_path / "q3", "qwen3_moe")
    names = ("q_proj", "gate_proj", "up_proj", "down_proj")
    with Trainer(_lora(tmp_path / "q3", q3, target=names, params=())) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        export_peft(tr.model, tr.rt.adapters, str(tmp_path / "fused"))
        want = {n: p.detach().clone() for n, p in tr.rt.adapters.named()}
    cfg = _lora(tmp_path / "q3" / "again", q3, target=names, params=())
    cfg.adapter.init_from = str(tmp_path / "fused")
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        assert all(torch.equal(p, want[n]) for n, p in tr.rt.adapters.named())
    cfg = _lora(tmp_path / "q3" / "other", q3, target=("q_proj",), params=("gate_up_proj", "down_proj"))
    cfg.adapter.init_from = str(tmp_path / "fused")
    with pytest.raises(ConfigError, match=r"has gate_up_proj adapters at twice the rank .* give adapter.target"):
        with Trainer(cfg) as tr:
            tr.initialize(progress=False)
