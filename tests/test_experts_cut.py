"""A mixture of experts' layers cut into attention and ranges of whole experts
(``models/experts_cut.py``, ``model.layer_pieces`` > 2): bit-identical to plain PyTorch on the
whole model (transformers' grouped_mm experts, the routers' auxiliary loss on), read from a
checkpoint of one matrix per expert, generated from, exported whole, planned where the budget
needs it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import assert_resume_exact, reference_model, reference_train, small_config, weights_of
from test_generate import _hf_generate
from test_moe import _config as moe_config
from test_parity import assert_same_weights, ref_name_map, run_tiertrain

from tiertrain.config import ConfigError
from tiertrain.inference.generate import Sampling, generate
from tiertrain.training.trainer import Trainer


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A Qwen3-MoE (4 experts, 2 a token, a dense first layer, the auxiliary loss on) written by
    save_pretrained: one matrix per expert and projection on disk."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config("qwen3_moe")).save_pretrained(d)
    return str(d)


def _cfg(tmp_path, path, parts, **kw):
    kw.setdefault("micro_batches", 2)
    kw.setdefault("steps", 3)
    cfg = small_config(tmp_path, kind="llama", **kw)
    cfg.model.hf_dir, cfg.model.layer_pieces = path, parts
    return cfg


def _parity(cfg, *, exact=True):
    ref = reference_model(cfg)
    ref_losses, ref_weights = reference_train(cfg, ref)
    losses, weights, tr = run_tiertrain(cfg, weights_of(ref))
    names = ref_name_map(tr, weights)  # the ranges' names too: ours are the whole parameters'
    if exact:
        assert losses == ref_losses
    else:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    assert_same_weights(tr, weights, ref_weights, names={n: names[n] for n in weights}, exact=exact, atol=1e-6)
    return tr


@pytest.mark.parametrize(
    "parts,activations", [(3, "recompute"), (5, "recompute"), (3, "keep"), (5, "offload")], ids=lambda v: str(v)
)
def test_ranges_of_experts_are_plain_pytorch_bit_for_bit(tmp_path, moe_dir, parts, activations):
    """2 ranges of 2 experts, or 4 of one; the pairs' inputs and outputs carried between them;
    the router's logits in the auxiliary loss under the layer's number. No clipping: exact."""
    cfg = _cfg(tmp_path, moe_dir, parts, clip=0.0, activations=activations, keep_act_mib=64 * (activations == "keep"))
    tr = _parity(cfg)
    kinds = [b.kind for b in tr.model.blocks]
    ranges = [f"experts {lo}-{hi - 1}" for lo, hi in ({3: [(0, 2), (2, 4)], 5: [(i, i + 1) for i in range(4)]}[parts])]
    assert kinds == ["attention", "mlp", "attention", *ranges], kinds  # the dense first layer cut into 2
    d, k = 64, 2
    assert tr.model.block_widths == [d, d, d, d, *([(2 * k + 1) * d + 2 * k] * (parts - 2))]


@pytest.fixture(scope="module", params=["mixtral", "olmoe", "gpt_oss", "flex_olmo", "phimoe", "granitemoe", "jetmoe"])
def other_dir(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config(request.param)).save_pretrained(d)
    return request.param, str(d)


@pytest.mark.parametrize("parts,activations", [(3, "recompute"), (5, "offload")], ids=lambda v: str(v))
def test_mixtral_olmoe_and_gpt_oss_ranges_are_plain_pytorch_bit_for_bit(tmp_path, other_dir, parts, activations):
    """Mixtral (its own layer forward, computing Llama's; fp32 routing weights), OLMoE (Q/K
    norms) and gpt-oss (experts' biases gathered per pair, transposed weights, its own gate
    function, attention sinks) and FlexOlmo (OLMoE's block on the residual stream itself, its
    norm after it) with the auxiliary loss, cut as Qwen3-MoE."""
    family, path = other_dir
    tr = _parity(_cfg(tmp_path, path, parts, clip=0.0, activations=activations))
    assert tr.model.hf_config.model_type == family
    assert sum(b.kind.startswith("experts") for b in tr.model.blocks) == 2 * (parts - 1)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_ranges_of_a_top_1_router_are_plain_pytorch_bit_for_bit(tmp_path, family):
    """One expert a token: the pairs' inputs carried between ranges are rows 3d + 2 apart, which
    torch's grouped matrix product refused ("strides should be multiple of 16 bytes": a traceback
    in training, eval and generation wherever the planner cut such a block)."""
    from transformers import AutoModelForCausalLM

    config = moe_config(family)
    config.num_experts_per_tok = 1
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    tr = _parity(_cfg(tmp_path, str(tmp_path / "m"), 3, clip=0.0))
    assert tr.model.hf_config.num_experts_per_tok == 1 and any(b.kind.startswith("experts") for b in tr.model.blocks)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("parts,activations", [(3, "keep"), (5, "recompute")], ids=lambda v: str(v))
def test_shared_experts_ranges_are_plain_pytorch_bit_for_bit(tmp_path, family, parts, activations):
    """Qwen2-MoE (a shared expert before the router, gated by a sigmoid after the experts),
    DeepSeek-V3 (latent attention, grouped routing, shared experts after them) and GLM-4.5 (its
    block DeepSeek's): the shared experts in the first range, in the block's order, their output
    carried to the last; a dense first layer where the config has one."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config(family)).save_pretrained(tmp_path / "m")
    cfg = _cfg(tmp_path, str(tmp_path / "m"), parts, clip=0.0, activations=activations, keep_act_mib=64)
    tr = _parity(cfg)
    ranges = [b for b in tr.model.blocks if b.kind.startswith("experts")]
    assert len(ranges) >= parts - 1 and ranges[0].in_width == 64
    d, k = 64, tr.model.hf_config.num_experts_per_tok
    assert ranges[1].in_width == (2 * k + 1) * d + 2 * k + d  # the shared experts' output carried
    if parts == 5 and family == "deepseek_v3":
        # the compute probe times whole layers: its dense first layer is 2 units, its MoE layers 5
        # (a prefix of parts units once ended inside a layer and handed the head a carried tensor)
        from tiertrain.cost.probe import probe_compute

        with Trainer(cfg) as t:
            assert t.model.block_layers[:4] == [0, 0, 1, 1]
            out = probe_compute(t.cfg, t.model, t.layout, t.dev, t.dtype, t.rt.hidden_size)
            assert out["head_s"] > 0 and out["block_bwd_s"] > 0
    if parts == 3 and activations == "keep":  # generating too: latent attention's cache, shared experts
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
        hf.config.output_router_logits = False
        prompts = [list(range(10, 30)), list(range(40, 52))]
        cfg.data.micro_batch_size = 1
        assert generate(cfg, prompts, Sampling(max_new_tokens=8), eos=()) == _hf_generate(hf, prompts, 8)


def test_phi_moes_random_routing_in_ranges_is_plain_pytorch_at_one_micro_batch(tmp_path):
    """Phi-3.5-MoE's own jitters (0.01 each, the auxiliary loss off as in its config): in
    training its block multiplies the states by uniform noise in place and its sparsemixer samples
    the experts (Gumbel), both random. The first range draws them as the block does, once, and
    restores them for its recompute: bit-identical to plain PyTorch at one micro-batch (as dropout;
    with several, layer-major order draws them in another order, as for dropout)."""
    from transformers import AutoModelForCausalLM

    config = moe_config("phimoe")
    config.router_jitter_noise = config.input_jitter_noise = 0.01
    config.output_router_logits = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    for parts in (3, 5):
        cfg = _cfg(tmp_path / str(parts), str(tmp_path / "m"), parts, micro_batches=1, clip=0.0)
        tr = _parity(cfg)
        noisy = reference_train(cfg, reference_model(cfg))[0]
        assert sum(b.kind.startswith("experts") for b in tr.model.blocks) == 2 * (parts - 1)
    # the noise matters: the same run without it gives other losses
    config.router_jitter_noise = config.input_jitter_noise = 0.0
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "quiet")
    quiet = _cfg(tmp_path / "q", str(tmp_path / "quiet"), 3, micro_batches=1, clip=0.0)
    assert reference_train(quiet, reference_model(quiet))[0] != noisy


@pytest.mark.parametrize("family", ["granitemoe", "phimoe"])
def test_ranges_in_bf16_are_the_whole_blocks_bits(tmp_path, family):
    """Granite-MoE's router rounds its fp32 softmax back to the compute dtype (``type_as``), and
    Phi-MoE's sparsemixer computes in it: in bf16 the ranges carry its routing weights exactly,
    so the planner may cut them and a cut run is the uncut run's bits (losses and weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config(family)).save_pretrained(tmp_path / "m")
    runs = []
    for parts in (2, 3):
        cfg = _cfg(tmp_path / str(parts), str(tmp_path / "m"), parts, dtype="bfloat16", clip=0.0)
        with Trainer(cfg) as tr:
            tr.initialize(progress=False)
            losses = [tr.train_step().extra["losses"] for _ in range(cfg.train.steps)]
            runs.append((losses, tr.weights(), sum(b.kind.startswith("experts") for b in tr.model.blocks)))
    (whole, w_whole, n_whole), (cut, w_cut, n_cut) = runs
    assert (n_whole, n_cut) == (0, 4) and whole == cut
    assert w_whole.keys() == w_cut.keys()
    for name, w in w_whole.items():
        assert torch.equal(w, w_cut[name]), name


def test_mixtrals_fp32_routing_weights_refuse_ranges_in_bf16(tmp_path):
    """Mixtral's router gives fp32 weights whatever the compute dtype: ranges would carry them
    rounded. Refused when asked for, and never offered by the planner (attention | MoE block is)."""
    from transformers import AutoModelForCausalLM

    from tiertrain.models.sublayers import cut_options
    from tiertrain.runtime import Runtime

    torch.manual_seed(0)
    path = str(tmp_path / "mixtral")
    AutoModelForCausalLM.from_config(moe_config("mixtral")).save_pretrained(path)
    with pytest.raises(ConfigError, match="gives float32 routing weights while the model computes in torch.bfloat16"):
        Trainer(_cfg(tmp_path, path, 3, dtype="bfloat16", steps=1))
    short = _cfg(tmp_path, path, None, dtype="bfloat16", steps=1)
    short.memory.host_mib = 60  # below whole blocks' pools: the refusal says what would let it cut
    with pytest.raises(ConfigError, match=r"train in float32 \(train.param_dtype = 'float32'\) to let the planner"):
        Trainer(short)
    cfg = _cfg(tmp_path, path, None, dtype="bfloat16")
    rt = Runtime(cfg)
    try:
        assert cut_options(rt.model, dtype=torch.bfloat16) == [2]
        assert cut_options(rt.model, dtype=torch.float32)[:2] == [2, 3]
    finally:
        rt.close()


def test_with_clipping_the_global_norm_rounds_otherwise_and_the_plan_says_so(tmp_path, moe_dir):
    """Each range's share of an expert parameter is its own parameter: the clip's global norm
    is summed over the ranges' norms (within rounding of plain PyTorch's; at this size the
    losses agree to 1e-6 and the weights to 1e-6)."""
    _parity(_cfg(tmp_path, moe_dir, 3, clip=0.05), exact=False)


def test_generation_with_ranges_of_experts_is_transformers_generate(tmp_path, moe_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    hf.config.output_router_logits = False  # transformers' own generate fails with it on
    prompts = [list(range(10, 30)), list(range(40, 52))]
    cfg = _cfg(tmp_path, moe_dir, 5)
    cfg.data.micro_batch_size = 1
    assert generate(cfg, prompts, Sampling(max_new_tokens=8), eos=()) == _hf_generate(hf, prompts, 8)


def test_ranges_read_a_checkpoint_of_one_matrix_per_expert_and_export_it_whole(tmp_path, moe_dir):
    """Each range reads its experts' matrices alone from the checkpoint (stacked as transformers
    stacks them): the initial weights are those of the whole model; a cut run's export is the
    model transformers loads, one matrix per expert again."""
    from transformers import AutoModelForCausalLM

    from tiertrain.checkpoint.export import export_checkpoint

    initial = {}
    for parts in (None, 5):
        with Trainer(_cfg(tmp_path / str(parts), moe_dir, parts, steps=1)) as tr:
            tr.initialize(progress=False)
            initial[parts] = tr.weights()
            if parts:
                tr.train_step()
                trained, saved = tr.weights(), tr.save_checkpoint()
    assert set(initial[None]) == set(initial[5]) and all(
        torch.equal(initial[None][k], initial[5][k]) for k in initial[5]
    )
    out = export_checkpoint(saved.path, str(tmp_path / "export"))
    hf = AutoModelForCausalLM.from_pretrained(out)
    theirs = dict(hf.named_parameters())
    names = ref_name_map(tr, trained)
    for name, t in trained.items():
        assert torch.equal(theirs[names[name]].detach(), t), name


def test_a_cut_run_resumes_bit_for_bit(tmp_path, moe_dir):
    assert_resume_exact(_cfg(tmp_path / "a", moe_dir, 3, clip=0.0), _cfg(tmp_path / "b", moe_dir, 3, clip=0.0))


def test_the_planner_cuts_the_experts_only_where_a_moe_block_does_not_fit(tmp_path):
    """A Qwen3-235B-A22B shape (94 layers, width 4096, 128 experts of 1536, 8 a token) at a
    48 GiB budget: whole layers (2.4 B parameters) do not fit; attention | MoE block neither;
    ranges of experts do. Its smaller sibling, Qwen3-30B-A3B, at 16 GiB."""
    from transformers import Qwen3MoeConfig

    from tiertrain.cost.cuts import plan_budget
    from tiertrain.runtime import Runtime

    def plan(host_mib, **shape):
        d = tmp_path / f"m{host_mib}"
        d.mkdir()
        Qwen3MoeConfig(**shape, head_dim=128, vocab_size=151936, max_position_embeddings=4096).save_pretrained(d)
        cfg = small_config(tmp_path, kind="llama", activations="auto", micro_batches=8)
        cfg.model.hf_dir, cfg.model.from_scratch = str(d), True
        cfg.data.seq_len, cfg.data.micro_batch_size = 4096, 1
        cfg.memory.host_mib, cfg.memory.keep_act_mib = host_mib, 0
        rt = Runtime(cfg)
        try:
            return plan_budget(cfg, rt, None, lambda: (1500 << 20, 0))
        finally:
            rt.close()

    big = dict(num_hidden_layers=94, hidden_size=4096, num_attention_heads=64, num_key_value_heads=4)
    big.update(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, intermediate_size=12288)
    cfg, budget = plan(48000, **big)
    assert cfg.model.layer_pieces > 2, cfg.model.layer_pieces
    note = next(n for n in budget.notes if "decoder layers cut into" in n)
    assert f"attention | {cfg.model.layer_pieces - 1} ranges of whole experts" in note
    assert "with clipping on, the clip's global norm is summed over the experts' ranges' norms" in note
    small = dict(big, num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, moe_intermediate_size=768)
    cfg, _ = plan(16000, **small)
    assert cfg.model.layer_pieces > 2


def test_what_ranges_of_experts_cannot_do_is_refused_by_name(tmp_path, moe_dir):
    from tiertrain.models import build_model

    with pytest.raises(ConfigError, match="5 ranges of experts, more than its 4 experts"):
        build_model(_cfg(tmp_path, moe_dir, 6).model, param_dtype=torch.float32, seed=0)
    cfg = _cfg(tmp_path, moe_dir, 3)
    cfg.adapter = dataclasses.replace(cfg.adapter, kind="lora", rank=2, target_parameters=["gate_up_proj"])
    cfg.update.mode = "auto"
    with pytest.raises(ConfigError, match="adapters on the experts need them whole"):
        Trainer(cfg)


def test_the_clip_norm_deviation_said_is_the_one_measured():
    """The figure the plan states (``CLIP_NORM_DEVIATION``): the norm over ranges against torch's
    norm of the whole expert gradient, 16 x 1536 x 512 in fp32."""
    from tiertrain.models.experts_cut import CLIP_NORM_DEVIATION

    torch.manual_seed(0)
    g = torch.randn(16, 1536, 512) * 1e-3
    whole = torch.linalg.vector_norm(torch.stack(list(torch._foreach_norm([g], 2))))
    for ranges in (2, 16):
        cut = torch.linalg.vector_norm(torch.stack(list(torch._foreach_norm(list(g.chunk(ranges)), 2))))
        assert 0 < abs(cut - whole).item() / whole.item() < 6e-4, ranges  # machines reduce alike within it
    assert "3e-4 to 5e-4 relative" in CLIP_NORM_DEVIATION


def test_a_short_budget_trains_a_moe_cut_into_ranges(tmp_path):
    """A budget between what attention | MoE block and 2 ranges of experts need: the planner
    cuts into 2 ranges (the fewest that fit), says so, and the run trains; a checkpoint's config
    names the cut."""
    from test_sublayers import _needs
    from transformers import AutoModelForCausalLM

    config = moe_config("qwen3_moe")
    config.num_experts, config.moe_intermediate_size, config.hidden_size, config.head_dim = 16, 256, 128, 32
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    cfg = small_config(tmp_path, kind="llama", steps=1)
    cfg.model.hf_dir = str(tmp_path / "m")
    for f in ("host_param_mib", "grad_host_mib", "optim_host_mib", "stash_host_mib", "keep_act_mib"):
        setattr(cfg.memory, f, None)  # planned
    two, three = _needs(cfg, 2), _needs(cfg, 3)
    assert two - three > 4, (two, three)
    cfg.memory.host_mib = (two + three) // 2
    with Trainer(cfg) as tr:
        assert tr.model.layer_parts == 3 and tr.user_cfg.model.layer_pieces == 3
        note = next(n for n in tr.budget.notes if "decoder layers cut into 3" in n)
        assert "attention | 2 ranges of whole experts" in note
        tr.initialize(progress=False)
        assert torch.isfinite(torch.tensor(tr.train_step().extra["losses"])).all()


@pytest.mark.parametrize("parts,activations", [(3, "recompute"), (5, "keep")], ids=lambda v: str(v))
def test_llama4s_every_expert_block_in_ranges_is_plain_pytorch_bit_for_bit(tmp_path, parts, activations):
    """Llama 4's MoE block runs every expert on every token (a ``bmm`` over the experts of the
    tokens times their sigmoid scores): the first range makes every expert's input and runs the
    shared expert, each range a ``bmm`` of its experts, the last sums over the experts
    (``models/experts_dense.py``). Bit-identical to plain PyTorch; generation (parts 3) token for
    token transformers' ``generate`` past its 8-token attention chunks."""
    from transformers import AutoModelForCausalLM

    config = moe_config("llama4_text")
    config.num_experts_per_tok = 3  # Llama 4's own: 1; with 3 a token the sum over the experts rounds by its order
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    cfg = _cfg(tmp_path, str(tmp_path / "m"), parts, clip=0.0, activations=activations, keep_act_mib=64)
    tr = _parity(cfg)
    moe = len(tr.model.hf_config.moe_layers)
    assert moe and sum(b.kind.startswith("experts") for b in tr.model.blocks) == moe * (parts - 1)
    d, e = 64, tr.model.hf_config.num_local_experts
    assert {b.in_width for b in tr.model.blocks if b.kind.startswith("experts") and b.k} == {(2 * e + 2) * d}
    if parts == 3:
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
        hf.config.output_router_logits = False
        prompts = [list(range(10, 30)), list(range(40, 52))]
        cfg.data.micro_batch_size = 1
        assert generate(cfg, prompts, Sampling(max_new_tokens=8), eos=()) == _hf_generate(hf, prompts, 8)
