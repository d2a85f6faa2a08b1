"""Mixtures of experts (``models/families.py``): Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE (a
dense layer), OLMoE, gpt-oss (attention sinks, biased experts, sliding windows, eager attention),
DeepSeek-V3 and V2 (multi-head latent attention, shared experts, a dense first layer, grouped
routing), GLM-4.5 and dots.llm1 (DeepSeek's routing, full attention), FlexOlmo, Phi-MoE, Granite-MoE
(Granite's multipliers) and Llama 4's text model (chunked attention, a layer without rotary), each
a tiny random model written by transformers' own ``save_pretrained`` (one
matrix per expert on disk, converted to the 3-D expert parameters as ``from_pretrained``
converts them: ``models/convert.py``).

Where the config asks for it (``output_router_logits``, on here with a large coefficient) the
routers' auxiliary load-balancing loss couples every layer of a micro-batch
(``models/routers.py``): training stays bit-identical to plain PyTorch + AdamW in fp32 with the
block graphs recomputed, kept or offloaded to the storage tier, on every update path; the
evaluation loss is transformers' forward loss with it; greedy generation is token for token
transformers' ``generate``; LoRA on the attention projections is peft's bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from reference import small_config
from test_families import COMMON
from test_generate import _hf_generate
from test_lora import assert_lora_parity
from test_parity import assert_parity

from tiertrain.inference.generate import Sampling, generate

AUX = dict(output_router_logits=True, router_aux_loss_coef=0.3)


def _config(family: str):
    import transformers as t

    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    # DeepSeek's routing (groups, shared experts, a dense first layer), and its latent attention
    ds = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
              first_k_dense_replace=1, n_group=2, topk_group=1)  # fmt: skip
    mla = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
    return {
        "mixtral": lambda: t.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, **AUX),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**COMMON, **experts, shared_expert_intermediate_size=48, **AUX),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, **experts, head_dim=16, mlp_only_layers=[0], **AUX),
        "olmoe": lambda: t.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, **AUX),
        "gpt_oss": lambda: t.GptOssConfig(
            **COMMON, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8, **AUX
        ),
        # transformers' own generate needs as many key/value heads as heads for latent attention
        "deepseek_v3": lambda: t.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, **ds, **mla),
        "deepseek_v2": lambda: t.DeepseekV2Config(**{**COMMON, "num_key_value_heads": 4}, **ds, **mla),
        "glm4_moe": lambda: t.Glm4MoeConfig(**COMMON, **ds, head_dim=16),
        # DeepSeek's latent attention and routing, its dense layers by mlp_layer_types
        "glm4_moe_lite": lambda: t.Glm4MoeLiteConfig(
            **{**COMMON, "num_key_value_heads": 4},
            **{k: v for k, v in ds.items() if k != "first_k_dense_replace"},
            mlp_layer_types=["dense", "sparse"],
            **mla,
        ),  # fmt: skip
        "dots1": lambda: t.Dots1Config(**COMMON, **ds, head_dim=16),
        "flex_olmo": lambda: t.FlexOlmoConfig(**COMMON, num_experts=4, num_experts_per_tok=2, **AUX),
        # no input jitter (random in training, as dropout); no router jitter: with the loss on it is refused
        "phimoe": lambda: t.PhimoeConfig(
            **COMMON, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, input_jitter_noise=0.0, **AUX
        ),
        "granitemoe": lambda: t.GraniteMoeConfig(
            **COMMON,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=6.0,
            logits_scaling=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            **AUX,
        ),  # fmt: skip
        # routers in its attention (mixture of attention heads) and its MLP: two a layer; aux_loss_coef
        "jetmoe": lambda: t.JetMoeConfig(
            **{
                k: v
                for k, v in COMMON.items()
                if k not in ("intermediate_size", "num_attention_heads", "num_key_value_heads")
            },
            num_local_experts=4,
            num_experts_per_tok=2,
            num_key_value_heads=2,
            kv_channels=16,
            intermediate_size=128,
            output_router_logits=True,
            aux_loss_coef=0.3,
        ),  # fmt: skip
        # four layers: three chunked (8-token chunks) with rotary, the fourth full without
        "llama4_text": lambda: t.Llama4TextConfig(
            **{**COMMON, "num_hidden_layers": 4},
            num_local_experts=4,
            num_experts_per_tok=1,
            head_dim=16,
            intermediate_size_mlp=128,
            attention_chunk_size=8,
            **AUX,
        ),  # fmt: skip
    }[family]()


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "deepseek_v2", "glm4_moe", "dots1",
            "flex_olmo", "phimoe", "granitemoe", "llama4_text", "jetmoe", "glm4_moe_lite"]  # fmt: skip


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory):
    """(family, directory, the model as transformers loads it from there)."""
    from transformers import AutoModelForCausalLM

    from tiertrain.models.families import FAMILIES as KNOWN

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(request.param))
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    loaded = AutoModelForCausalLM.from_pretrained(d, attn_implementation=KNOWN[request.param].attention)
    return request.param, str(d), loaded.eval()


def _moe_config(tmp_path, path, **kw):
    cfg = small_config(tmp_path, kind="llama", **kw)
    cfg.model.hf_dir = path
    return cfg


def test_the_checkpoint_is_read_as_from_pretrained_converts_it(tmp_path, moe_dir):
    """save_pretrained wrote one matrix per expert and projection: each unit reads the 3-D
    expert parameters made from them with transformers' own conversion, the values
    ``from_pretrained`` gives, bit for bit (and every parameter is there)."""
    from safetensors import safe_open

    from tiertrain.models import _hf_names, build_model, unit_param_names

    family, path, loaded = moe_dir
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        on_disk = set(f.keys())
    if family not in ("gpt_oss", "granitemoe", "llama4_text", "jetmoe"):  # those keep 3-D experts on disk too
        assert any(".experts.0." in k for k in on_disk) and not any(k.endswith("experts.gate_up_proj") for k in on_disk)
    model, source = build_model(_moe_config(tmp_path, path).model, param_dtype=torch.float32, seed=0)
    want, names = loaded.state_dict(), _hf_names(model)
    seen = 0
    for u, own in enumerate(unit_param_names(model)):
        got = source.load(u, [n for n, _ in own])
        for name, value in got.items():
            assert torch.equal(value, want[names[name]]), name
            seen += 1
    assert seen == len(dict(loaded.named_parameters()))


def test_training_with_the_auxiliary_loss_is_plain_pytorch_bit_for_bit(tmp_path, moe_dir):
    """Every block's graph recomputed in the backward."""
    family, path, _ = moe_dir
    tr, losses = assert_parity(_moe_config(tmp_path, path, micro_batches=2, steps=3, clip=0.5))
    assert tr.model.hf_config.model_type == family and len(losses) == 3
    # the DeepSeek routing (and Llama 4) has no auxiliary loss in transformers' forward
    no_aux = ("deepseek_v3", "deepseek_v2", "glm4_moe", "dots1", "llama4_text", "glm4_moe_lite")
    assert (tr.model.routers is not None) == (family not in no_aux)
    assert tr.executor.recomputed > 0


@pytest.mark.parametrize("activations", ["keep", "offload"])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_kept_or_offloaded_graphs_are_plain_pytorch_bit_for_bit(tmp_path, family, activations):
    """The blocks' graphs kept in memory or written to the storage tier: one family with the
    auxiliary loss (its gradient hooks ride in the kept and offloaded graphs), one without
    (DeepSeek-V3: a dense first block beside expert blocks, records measured on each)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path / "m")
    kw = dict(keep_act_mib=64) if activations == "keep" else dict(activations="offload")
    tr, _ = assert_parity(_moe_config(tmp_path, str(tmp_path / "m"), micro_batches=2, steps=3, clip=0.5, **kw))
    if activations == "keep":
        assert tr.executor.kept_pairs > 0
    else:
        assert tr.offloaded is not None


def test_without_the_auxiliary_gradient_training_is_not_plain_pytorch(tmp_path, monkeypatch):
    """The test above can fail: the routers' gradient hook left out, the first step differs."""
    from transformers import AutoModelForCausalLM

    from tiertrain.models import routers

    monkeypatch.setattr(routers.RouterLoss, "_add", lambda self, key, g: g)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("mixtral")).save_pretrained(tmp_path / "m")
    with pytest.raises(AssertionError):
        assert_parity(_moe_config(tmp_path, str(tmp_path / "m"), micro_batches=2, steps=2))


@pytest.mark.parametrize("mode", ["engines", "overlap"])
def test_every_update_path_with_the_auxiliary_loss(tmp_path, mode):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("qwen3_moe")).save_pretrained(tmp_path / "m")
    cfg = _moe_config(tmp_path, str(tmp_path / "m"), micro_batches=2, steps=3, clip=0.5)
    cfg.update.mode = mode
    assert_parity(cfg)


def test_evaluation_is_transformers_forward_loss_with_the_auxiliary_loss(tmp_path, moe_dir):
    from tiertrain.data import EvalSet
    from tiertrain.inference.evaluate import evaluate

    family, path, loaded = moe_dir
    text = tmp_path / "held_out.txt"
    text.write_text("".join(f"{i} held-out words, {i * 7 % 5} of them.\n" for i in range(40)))
    cfg = _moe_config(tmp_path, path)
    cfg.data.eval_corpus, cfg.data.eval_micro_batches = str(text), 0
    res = evaluate(cfg)
    es = EvalSet(cfg.data)
    with torch.no_grad():
        want = [float(loaded(input_ids=x, labels=y, shift_labels=y).loss) for x, y in es.micro_batches()]
    assert res.loss == sum(want) / len(want)


def test_greedy_generation_is_transformers_generate(tmp_path, moe_dir):
    _, path, hf = moe_dir
    prompts = [list(range(10, 30)), list(range(40, 52))]  # past gpt-oss's 8-token window
    cfg = _moe_config(tmp_path, path)
    cfg.data.micro_batch_size = 2
    ours = generate(cfg, prompts, Sampling(max_new_tokens=10), eos=())
    # transformers' generate fails with output_router_logits (its auxiliary loss takes the new
    # tokens' logits against the whole attention mask); the loss is not part of generating
    asked, hf.config.output_router_logits = hf.config.output_router_logits, False
    try:
        # no stop token on either side (_hf_generate passes eos_token_id=None): a random model may emit one
        assert ours == _hf_generate(hf, prompts, 10)
    finally:
        hf.config.output_router_logits = asked


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_lora_on_the_attention_is_peft_bit_for_bit(tmp_path, family):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path / "m")
    cfg = _moe_config(tmp_path, str(tmp_path / "m"), micro_batches=2, steps=3, clip=0.05)
    targets = {"mixtral": ["q_proj", "v_proj"], "deepseek_v3": ["q_a_proj", "kv_b_proj", "o_proj"]}[family]
    cfg.adapter.kind, cfg.adapter.rank, cfg.adapter.alpha, cfg.adapter.target = "lora", 4, 9.0, targets
    cfg.update.mode = "auto"
    assert_lora_parity(cfg)


def test_an_export_is_in_the_checkpoints_layout_and_loads_in_transformers(tmp_path):
    """Trained experts go out one matrix per expert and projection, as save_pretrained writes
    them (what other tools read), and from_pretrained converts them back to the trained values."""
    import json

    from transformers import AutoModelForCausalLM

    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.models import _hf_names
    from tiertrain.training.trainer import Trainer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("qwen2_moe")).save_pretrained(tmp_path / "m")
    cfg = _moe_config(tmp_path, str(tmp_path / "m"), steps=1)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        res = tr.save_checkpoint()
        want, names = tr.weights(), _hf_names(tr.model)
    out = export_checkpoint(res.path, str(tmp_path / "export"))
    keys = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys and not any(
        k.endswith("experts.down_proj") for k in keys
    )
    sd = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(want[k], sd[names[k]]) for k in want)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_routers_correction_bias_is_the_directorys_in_training_eval_generation_and_export(tmp_path, family):
    """DeepSeek-V3's routing (GLM-4.5's too) picks experts with a correction bias, a buffer that
    save_pretrained writes and from_pretrained loads (never zero in a real checkpoint): it was
    left at its initial zeros (another routing: other losses, weights and tokens than
    transformers', without a word) and left out of exports. Nonzero here: training bit for bit
    against plain PyTorch on the model from_pretrained loads, its eval loss and greedy tokens,
    and the export carries it."""
    import copy

    from reference import reference_train, weights_of
    from test_parity import assert_same_weights, run_tiertrain
    from transformers import AutoModelForCausalLM

    from tiertrain.checkpoint.export import export_checkpoint
    from tiertrain.data import EvalSet
    from tiertrain.inference.evaluate import evaluate
    from tiertrain.reference import HFWrapper

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(family))
    biases = [b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases
    g = torch.Generator().manual_seed(7)
    for b in biases:
        b.copy_(torch.randn(b.shape, generator=g))
    hf.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert all(torch.equal(a, b) for a, b in zip(biases, [b for n, b in loaded.named_buffers() if "correction" in n]))
    cfg = _moe_config(tmp_path, str(tmp_path / "m"), micro_batches=2, steps=3, clip=0.5)
    init = weights_of(HFWrapper(loaded))
    ref_losses, ref_weights = reference_train(cfg, HFWrapper(copy.deepcopy(loaded)))
    losses, weights, tr = run_tiertrain(cfg, init)
    assert losses == ref_losses
    assert_same_weights(tr, weights, ref_weights)
    text = tmp_path / "held_out.txt"
    text.write_text("".join(f"{i} held-out words, {i * 7 % 5} of them.\n" for i in range(40)))
    cfg.data.eval_corpus, cfg.data.eval_micro_batches = str(text), 0
    with torch.no_grad():
        want = [float(loaded(input_ids=x, labels=y, shift_labels=y).loss) for x, y in EvalSet(cfg.data).micro_batches()]
    assert evaluate(cfg).loss == sum(want) / len(want)
    prompts = [list(range(10, 30)), list(range(40, 52))]
    cfg.data.micro_batch_size = 2
    assert generate(cfg, prompts, Sampling(max_new_tokens=10), eos=()) == _hf_generate(loaded, prompts, 10)
    cfg.train.steps, cfg.train.run_dir = 1, str(tmp_path / "run2")
    from tiertrain.training.trainer import Trainer

    with Trainer(cfg) as t:
        t.run()
        ckpt = t.save_checkpoint().path
    out = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, str(tmp_path / "export")))
    assert all(torch.equal(a, b) for a, b in zip(biases, [b for n, b in out.named_buffers() if "correction" in n]))


@pytest.mark.slow
def test_two_ranks_with_the_auxiliary_loss_train_the_grouped_reference_bit_for_bit(tmp_path):
    """Each rank's micro-batches make their own auxiliary losses (per forward, as transformers'):
    the ranks' sums in rank order are plain PyTorch's grouped run's, bit for bit."""
    from test_dist_train import _Named, run_ranks
    from test_parity import assert_same_weights
    from transformers import AutoModelForCausalLM

    from tiertrain.reference import reference_train

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("mixtral")).save_pretrained(tmp_path / "m")
    cfg = _moe_config(tmp_path, str(tmp_path / "m"), micro_batches=2, steps=2, clip=0.0)
    ref_model, out = run_ranks(tmp_path / "run", cfg, 2)
    ref_losses, ref_weights = reference_train(cfg, ref_model, ranks=2)
    for step, want in enumerate(ref_losses):
        assert [x for r in range(2) for x in out[r]["losses"][step]] == want
    assert_same_weights(_Named(cfg), out[0]["weights"], ref_weights)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_bf16_with_fp32_master_within_a_stated_tolerance(tmp_path, family):
    """bf16 parameters, fp32 master and moments, the auxiliary loss on, against the same recipe in
    plain PyTorch. Losses within tests/test_parity.py's bf16 tolerance (2e-3; measured 3e-4 to
    6e-4). The weights are held to how far they moved: routing is discrete, so a rounding that
    flips a token's top-k choice sends it to another expert (and AdamW turns near-zero gradients'
    noise into whole steps): after 3 steps measured at most 16% of each weight's movement
    (Mixtral; DeepSeek-V3 9%; a dense Llama 4%); the test allows 30%."""
    from test_parity import ref_name_map, run_tiertrain
    from transformers import AutoModelForCausalLM

    from tiertrain.reference import reference_model, reference_train, weights_of

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path / "m")
    cfg = _moe_config(tmp_path, str(tmp_path / "m"), micro_batches=2, steps=3, dtype="bfloat16")
    ref_model = reference_model(cfg)
    init = weights_of(ref_model)
    ref_losses, ref_weights = reference_train(cfg, ref_model, mixed=True)
    losses, weights, tr = run_tiertrain(cfg, init)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=2e-3, rtol=0)
    assert tr.params.dtype == torch.bfloat16
    names = ref_name_map(tr, list(weights))
    for name, w in weights.items():
        theirs, start = ref_weights[names[name]].float(), init[names[name]].float()
        assert (w.float() - theirs).norm() <= 0.3 * (theirs - start).norm(), name


def test_the_compute_probe_times_a_few_of_many_expert_blocks(tmp_path):
    """The cost model's probe runs 4 of a model's blocks and the head: with the auxiliary loss
    on, the head asked for the router logits of blocks the probe never ran (a RuntimeError in
    every plan that measured the machine, on a 6-layer Mixtral here as on the benchmark's 8);
    the probe leaves the auxiliary loss out and puts the model's back."""
    from transformers import AutoModelForCausalLM

    from tiertrain.cost.probe import probe_compute
    from tiertrain.training.trainer import Trainer

    torch.manual_seed(0)
    config = _config("mixtral")
    config.num_hidden_layers = 6
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    with Trainer(_moe_config(tmp_path, str(tmp_path / "m"))) as tr:
        routers = tr.model.routers
        assert routers is not None and len(routers.blocks) == 6
        out = probe_compute(tr.cfg, tr.model, tr.layout, tr.dev, tr.dtype, tr.rt.hidden_size)
        assert out["head_s"] > 0 and out["block_bwd_s"] > 0
        assert tr.model.routers is routers


def test_the_router_logits_kept_for_the_auxiliary_loss_are_in_the_budget(tmp_path):
    """Every routed block's logits for every micro-batch wait in memory from the forward to the
    head: blocks x M x tokens x experts x 4 bytes among the fixed pools (none without the loss)."""
    from transformers import AutoModelForCausalLM

    from tiertrain.cost.budget import fixed_pools
    from tiertrain.training.trainer import Trainer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("mixtral")).save_pretrained(tmp_path / "m")
    cfg = _moe_config(tmp_path, str(tmp_path / "m"), micro_batches=3)
    with Trainer(cfg) as tr:
        d = cfg.data
        want = 2 * 3 * d.micro_batch_size * d.seq_len * 4 * 4  # 2 blocks, M = 3, 4 experts, fp32
        assert fixed_pools(tr.cfg, tr.rt)["router logits"] == want
        tr.model.routers = None
        assert "router logits" not in fixed_pools(tr.cfg, tr.rt)


def test_resume_with_the_auxiliary_loss_is_bit_identical(tmp_path):
    """4 steps straight against 2, a checkpoint, a fresh trainer resuming, 2 more: the routers keep
    nothing across steps (their logits are a step's), so the losses and weights are the same."""
    from transformers import AutoModelForCausalLM

    from tiertrain.training.trainer import Trainer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("olmoe")).save_pretrained(tmp_path / "m")
    cfg = _moe_config(tmp_path / "a", str(tmp_path / "m"), micro_batches=2, steps=4)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        straight = [tr.train_step().extra["losses"] for _ in range(4)]
        want = tr.weights()
    cfg = _moe_config(tmp_path / "b", str(tmp_path / "m"), micro_batches=2, steps=4)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        first = [tr.train_step().extra["losses"] for _ in range(2)]
        saved = tr.save_checkpoint()
    with Trainer(cfg) as tr:
        tr.restore(saved.path)
        rest = [tr.train_step().extra["losses"] for _ in range(2)]
        got = tr.weights()
    assert first + rest == straight
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_experts_tensors_missing_from_the_checkpoint_are_named_before_any_work(tmp_path):
    """A partial download: expert 2's down projection (w2) of layer 1 left out of the safetensors file.
    Refused when the model is built (the conversion run on the keys' shapes alone), naming the
    parameter, the number of tensors found and the shape expected, not at that unit's first read."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tiertrain.config import ConfigError
    from tiertrain.models import build_model

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("mixtral")).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w2.weight"]  # Mixtral's own layout: w2 is down
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError) as e:
        build_model(_moe_config(tmp_path, str(tmp_path / "m")).model, param_dtype=torch.float32, seed=0)
    msg = str(e.value)
    assert "weight 'model.layers.1.mlp.experts.down_proj' is made from 3 checkpoint tensors" in msg, msg
    assert "into shape (3, 64, 128), the model expects (4, 64, 128)" in msg and "missing" in msg, msg


def test_the_model_line_says_whether_the_auxiliary_loss_is_in_the_loss(tmp_path):
    from transformers import AutoModelForCausalLM

    from tiertrain.models import build_model, model_name

    def line(family, **change):
        config = _config(family)
        for k, v in change.items():
            setattr(config, k, v)
        d = tmp_path / f"{family}-{len(change)}"
        AutoModelForCausalLM.from_config(config).save_pretrained(d)
        cfg = _moe_config(tmp_path, str(d))
        return model_name(build_model(cfg.model, param_dtype=torch.float32, seed=0)[0], cfg.model)

    assert line("mixtral") == (
        "Mixtral (MixtralForCausalLM; 4 experts, 2 a token; the routers' auxiliary loss is in the loss "
        "(router_aux_loss_coef 0.3))"
    )
    assert "no auxiliary loss: config.json's output_router_logits is false" in line(
        "mixtral", output_router_logits=False
    )
    assert line("deepseek_v3").endswith("4 experts, 2 a token; this family's forward adds no auxiliary loss)")


def test_validation_on_masked_targets_adds_the_mean_auxiliary_loss(tmp_path, monkeypatch):
    """Chat examples (masked targets): the micro-batches' losses are summed (the mean over the
    scored tokens), so each adds its share of the auxiliary loss's mean, not the whole of it
    (which grew the figure with the evaluation set's size): transformers' cross-entropy over the
    scored tokens plus the coefficient times the mean auxiliary loss."""
    from test_finetune_data import _finetune_cfg, _finetune_data
    from transformers import AutoModelForCausalLM

    from tiertrain.data import EvalSet
    from tiertrain.inference.evaluate import evaluate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, _, chat = _finetune_data(tmp_path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("mixtral")).save_pretrained(tmp_path / "m")
    cfg = _finetune_cfg(tmp_path, chat, tok, kind="llama")
    cfg.model.hf_dir, cfg.data.packing, cfg.data.micro_batch_size = str(tmp_path / "m"), False, 1
    cfg.data.eval_corpus, cfg.data.eval_micro_batches = chat, 0
    res = evaluate(cfg)
    es = EvalSet(cfg.data)
    scored, coef = es.total_scored(), AUX["router_aux_loss_coef"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    ce, aux = 0.0, []
    with torch.no_grad():
        for x, y in es.micro_batches():
            out = hf(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=scored)
            ce, aux = ce + float(out.loss - coef * out.aux_loss), aux + [float(out.aux_loss)]
    assert len(aux) >= 2 and scored
    assert res.loss == pytest.approx(ce + coef * sum(aux) / len(aux), rel=1e-6, abs=0)
    # the perplexity is the cross-entropy's alone; the auxiliary part is shown apart
    assert res.aux == pytest.approx(coef * sum(aux) / len(aux), rel=1e-5) and res.aux > 0
    assert res.perplexity == pytest.approx(math.exp(ce), rel=1e-6)
    assert f"cross-entropy {ce:.4f} + routers' aux" in res.line()


def test_phi_moes_router_jitter_with_the_auxiliary_loss_is_refused_in_one_line(tmp_path):
    """Phi-MoE's sparsemixer uses the router logits beyond the routing when router_jitter_noise > 0:
    the auxiliary loss's gradient would be summed in another order than plain PyTorch's (2e-10
    seen). Refused when the model is built, naming the field and the two ways out."""
    from transformers import AutoModelForCausalLM

    from tiertrain.config import ConfigError
    from tiertrain.models import build_model

    config = _config("phimoe")
    config.router_jitter_noise = 0.01
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    with pytest.raises(ConfigError) as e:
        build_model(_moe_config(tmp_path, str(tmp_path / "m")).model, param_dtype=torch.float32, seed=0)
    assert "router_jitter_noise = 0.01 makes its auxiliary loss's gradient sum in another order" in str(e.value)
    assert "set router_jitter_noise to 0 or output_router_logits to false in config.json" in str(e.value)


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_padded_rows_leave_their_pads_out_of_the_auxiliary_loss_as_a_padding_collator(tmp_path, monkeypatch, family):
    """Padded rows (data.packing = false): the pads' router logits were in the auxiliary loss
    (transformers without an attention_mask); a padding collator gives the mask, and
    transformers' loss counts no pad. Training is plain PyTorch given that mask, bit for bit, and
    differs from the loss over every token."""
    from test_finetune_data import _finetune_cfg, _finetune_data
    from test_parity import assert_parity
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, _, chat = _finetune_data(tmp_path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path / "m")
    cfg = _finetune_cfg(tmp_path, chat, tok, kind="llama", micro_batches=2, micro_batch_size=2)
    cfg.model.hf_dir, cfg.data.packing, cfg.train.steps, cfg.data.seq_len = str(tmp_path / "m"), False, 2, 32
    from tiertrain.data import open_corpus

    own = open_corpus(cfg.data).attention(0)
    assert own is not None and not all(bool(m.all()) for m in own)  # some rows have pads
    tr, losses = assert_parity(cfg)
    assert tr.model.routers is not None
    # against transformers' forward given the collator's mask (its attention kernel masked: ~1e-8)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    (x, y), mask = open_corpus(cfg.data).batches(0)[0], own[0]
    scored = open_corpus(cfg.data).scored(0)
    with torch.no_grad():
        out = hf(input_ids=x, attention_mask=mask, labels=y, shift_labels=y, num_items_in_batch=scored)
        every = hf(input_ids=x).aux_loss
    assert losses[0][0] == pytest.approx(float(out.loss), rel=1e-6, abs=0)
    assert abs(float(out.aux_loss) - float(every)) > 1e-6  # the pads' logits moved it


def test_an_auxiliary_loss_asked_of_a_model_without_a_router_is_refused_in_one_line(tmp_path):
    """A Qwen2-MoE whose mlp_only_layers and decoder_sparse_step leave every layer dense, with
    output_router_logits on: an IndexError inside transformers' loss (its own forward's too)."""
    import transformers as t

    from tiertrain.config import ConfigError
    from tiertrain.models import build_model

    config = t.Qwen2MoeConfig(**{**COMMON, "num_hidden_layers": 3}, num_experts=6, num_experts_per_tok=2,
                              moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[1], **AUX)  # fmt: skip
    t.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    with pytest.raises(ConfigError, match=r"no layer of the model has a router .*: set output_router_logits to false"):
        build_model(_moe_config(tmp_path, str(tmp_path / "m")).model, param_dtype=torch.float32, seed=0)
