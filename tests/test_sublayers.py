"""Decoder layers cut into sub-layer units (``models/sublayers.py``, ``model.layer_pieces``):
bit-identical to plain PyTorch on the whole model, planned only where whole blocks do not
fit, refused by name where a layer's forward is not one the pieces replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import assert_resume_exact, small_config
from test_families import _saved
from test_generate import _hf_generate
from test_parity import assert_parity

from tiertrain.config import ConfigError, ModelConfig
from tiertrain.inference.generate import Sampling, generate
from tiertrain.models import build_model
from tiertrain.models.base import unit_param_names
from tiertrain.training.trainer import Trainer

SEVENTY_B = dict(kind="llama", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=128256)


def _cut(cfg, parts):
    cfg.model.layer_pieces = parts
    return cfg


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize(
    "micro_batches,activations,stash_mib",
    [(1, "recompute", 0), (2, "recompute", 1), (3, "keep", 0), (2, "offload", 0)],
    ids=["recomputed-spilled", "recomputed-partly-in-memory", "kept", "offloaded"],
)
def test_a_cut_llama_is_plain_pytorch_bit_for_bit(tmp_path, parts, micro_batches, activations, stash_mib):
    """Losses and weights after 3 steps (clipping on: the global norm sums in the whole model's
    parameter order, not the units') equal plain PyTorch's on the whole model, whichever way
    the pairs keep their activations; the stash holds each piece's input at its own width."""
    cfg = small_config(
        tmp_path,
        kind="llama",
        micro_batches=micro_batches,
        steps=3,
        activations=activations,
        stash_host_mib=stash_mib,
        keep_act_mib=64 if activations == "keep" else 0,
    )
    tr, _ = assert_parity(_cut(cfg, parts))
    L, M, d, ff = 3, micro_batches, cfg.model.d_model, tr.model.hf_config.intermediate_size
    assert len(tr.model.blocks) == L * parts and tr.model.block_layers == [i // parts for i in range(L * parts)]
    widths = {2: [d, d], 3: [d, d, d + ff], 4: [d, d, 2 * d + ff, d + ff]}[parts]
    assert tr.model.block_widths == widths * L
    if activations == "recompute":
        assert tr.executor.recomputed == L * parts * M
        rows = 2 * 32 * 4  # micro-batch rows x tokens x fp32
        assert tr.stash.spilled + tr.stash.host_slots == L * parts * M
        assert sum(tr.stash._sizes) == sum(-(-rows * w // 4096) * 4096 for w in widths * L for _ in range(M))
    if activations == "offload":
        assert tr.acts.offloaded == L * parts * M


@pytest.mark.parametrize("d_ff", [200, 65])
def test_four_pieces_of_an_mlp_of_odd_width_are_plain_pytorch_bit_for_bit(tmp_path, d_ff):
    """The gate's activation and the up projection took their inputs as column slices of the
    carried tensor: at a width no multiple of the vector length, SiLU computed the slice's last
    elements on another path than the whole layer's contiguous gate (15 of 12,800 values at
    200), and every weight differed after 3 steps."""
    cfg = small_config(tmp_path, kind="llama", micro_batches=2, steps=3)
    cfg.model.d_ff = d_ff
    tr, _ = assert_parity(_cut(cfg, 4))
    assert tr.model.hf_config.intermediate_size == d_ff


@pytest.mark.parametrize("mode", ["overlap", "engines"])
def test_every_update_path_on_a_cut_model_is_bit_for_bit(tmp_path, mode):
    """The overlapped update and the engines, speculating under a clip that acts every step
    (each step's update redone with the clip): the norm the clip judges is the whole model's."""
    cfg = small_config(tmp_path, kind="llama", micro_batches=2, steps=3, activations="recompute", clip=0.05)
    cfg.update.mode, cfg.update.speculate = mode, "on"
    tr, _ = assert_parity(_cut(cfg, 3))
    assert tr.update.redone == 3


@pytest.mark.parametrize("activations,stash_mib", [("recompute", 0), ("offload", 1)])
def test_through_a_separate_device_memory_bit_for_bit(tmp_path, activations, stash_mib):
    """As on CUDA (``AsyncCpuDevice``: copies on their own streams, late): the stash's entries
    of three widths go down to pinned slots or spill buffers and come back up, the offloaded
    records of each piece kind too."""
    from tiertrain.device import AsyncCpuDevice

    cfg = small_config(
        tmp_path, kind="llama", micro_batches=2, steps=2, activations=activations, stash_host_mib=stash_mib
    )
    tr, _ = assert_parity(_cut(cfg, 4), AsyncCpuDevice(delay=0.001))
    assert tr.model.layer_parts == 4 and len(set(tr.model.block_widths)) == 3


@pytest.fixture(scope="module", params=["qwen2", "mistral", "qwen3", "gemma", "starcoder2"])
def family_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, str(d), _saved(request.param, d)


@pytest.mark.parametrize("parts", [2, 4])
def test_other_families_cut_are_plain_pytorch_bit_for_bit(tmp_path, family_dir, parts):
    """Qwen2 (biases, a sliding layer), Mistral (every layer sliding), Qwen3 (Q/K norms), Gemma
    (scaled embeddings, its own norms and MLP), Starcoder 2 (a two-matrix MLP: cut into 2, and
    refused into 4): their layers are Llama's forward with their own modules, cut as Llama's."""
    family, path, _ = family_dir
    cfg = small_config(tmp_path, kind="llama", micro_batches=2, steps=3, clip=0.5)
    cfg.model.hf_dir = path
    if family == "starcoder2" and parts == 4:
        with pytest.raises(ConfigError, match="Starcoder2MLP's forward does not end in its down_proj"):
            build_model(_cut(cfg, parts).model, param_dtype=torch.float32, seed=0)
        return
    tr, _ = assert_parity(_cut(cfg, parts))
    assert tr.model.hf_config.model_type == family and len(tr.model.blocks) == 2 * parts


def test_greedy_generation_of_a_cut_model_is_transformers_generate(tmp_path, family_dir):
    """Each layer's key/value cache goes with its attention piece (a sliding layer's window
    alone, spilled to the storage tier here); the MLP's pieces hold none."""
    family, path, hf = family_dir
    prompts = [list(range(10, 30)), list(range(40, 52))]  # past the 8-token window
    cfg = _cut(small_config(tmp_path, kind="llama"), 2 if family == "starcoder2" else 4)
    cfg.model.hf_dir, cfg.data.micro_batch_size, cfg.memory.kv_host_mib = path, 1, 0
    assert generate(cfg, prompts, Sampling(max_new_tokens=10), eos=()) == _hf_generate(hf, prompts, 10)


@pytest.mark.parametrize("activations", ["recompute", "keep", "offload"])
def test_a_mixture_of_experts_cut_into_attention_and_its_moe_block_is_plain_pytorch(tmp_path, activations):
    """Qwen3-MoE (a dense first layer, the routers' auxiliary loss on): each layer cut into
    attention | MLP, the MoE block called whole; the router's logits reach the loss under the
    layer's number though it is the layer's second unit (more pieces: ranges of experts,
    ``test_experts_cut.py``)."""
    from test_moe import _config as moe_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config("qwen3_moe")).save_pretrained(tmp_path / "m")
    cfg = small_config(
        tmp_path,
        kind="llama",
        micro_batches=2,
        steps=3,
        activations=activations,
        keep_act_mib=64 * (activations == "keep"),
    )
    cfg.model.hf_dir = str(tmp_path / "m")
    tr, _ = assert_parity(_cut(cfg, 2))
    assert tr.model.routers is not None and tr.model.block_layers == [0, 0, 1, 1]


def test_freeze_names_layers_and_mfu_counts_layers_cut_or_not(tmp_path):
    """``train.freeze = ['blocks:0']`` freezes every unit of layer 0 (its four pieces), and the
    FLOPs a token counts layers, not units: the same as uncut."""
    from tiertrain.models.freeze import frozen_units
    from tiertrain.training.metrics import flops_per_token

    def built(parts):
        return build_model(_cut(small_config(tmp_path, kind="llama"), parts).model, param_dtype=torch.float32, seed=0)[
            0
        ]

    whole, cut = built(None), built(4)
    units = frozen_units(cut, ["blocks:0"])
    assert sorted(cut.plan[u].block for u in units) == [0, 1, 2, 3] and all(
        cut.layer_of(cut.plan[u].block) == 0 for u in units
    )
    assert frozen_units(cut, ["blocks:1-2"]) == {
        r.index for r in cut.plan if r.role == "block" and cut.layer_of(r.block) > 0
    }
    with pytest.raises(ConfigError, match="names block 3, but the model has 3 blocks"):
        frozen_units(cut, ["blocks:3"])
    assert flops_per_token(cut, 32, 64) == flops_per_token(whole, 32, 64)


def test_initial_weights_and_names_do_not_depend_on_the_cut(tmp_path):
    """The same seed gives the same weights under the same names cut or whole (each piece
    takes its values from the whole layer's initialisation; names are the layer's)."""

    def initial(parts):
        cfg = small_config(tmp_path, kind="llama", layers=2)
        cfg.model.layer_pieces = parts
        model, source = build_model(cfg.model, param_dtype=torch.float32, seed=3)
        return {
            k: v
            for u, own in enumerate(unit_param_names(model))
            for k, v in source.load(u, [n for n, _ in own]).items()
        }

    whole = initial(None)
    for parts in (2, 3, 4):
        cut = initial(parts)
        assert set(cut) == set(whole) and all(torch.equal(cut[k], whole[k]) for k in whole), parts


def test_a_cut_run_resumes_bit_for_bit(tmp_path):
    straight = _cut(small_config(tmp_path / "a", kind="llama", micro_batches=2), 3)
    split = _cut(small_config(tmp_path / "b", kind="llama", micro_batches=2), 3)
    assert_resume_exact(straight, split)


def _needs(cfg, parts):
    """The least host budget of ``cfg`` cut into ``parts`` (buffers shrunk to their floors), MiB."""
    from tiertrain.cost.budget import PoolsOverBudget, resolve_budget
    from tiertrain.runtime import Runtime

    c = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, layer_pieces=parts),
        memory=dataclasses.replace(cfg.memory, host_mib=1),
    )
    rt = Runtime(c)
    try:
        with pytest.raises(PoolsOverBudget) as exc:
            resolve_budget(c, rt, None, lambda: (1 << 20, 0))
    finally:
        rt.close()
    return exc.value.needed >> 20


def test_the_planner_cuts_layers_only_where_whole_blocks_do_not_fit(tmp_path):
    """A budget between what whole blocks and 2 pieces need: cut into 2 (the fewest that fit),
    said, the run trains, and a checkpoint's config names the cut; a budget that holds whole
    blocks keeps them."""
    cfg = small_config(tmp_path, kind="llama", layers=2, d=256, heads=4, steps=1)
    cfg.model.vocab_size = 256  # smaller than a block: the vocabulary is never what is cut
    for f in ("host_param_mib", "grad_host_mib", "optim_host_mib", "stash_host_mib", "keep_act_mib"):
        setattr(cfg.memory, f, None)  # planned
    whole, two = _needs(cfg, None), _needs(cfg, 2)
    assert whole - two > 4, (whole, two)
    cfg.memory.host_mib = (whole + two) // 2
    with Trainer(cfg) as tr:
        assert tr.model.layer_parts == 2 and tr.user_cfg.model.layer_pieces == 2 and not tr.model.embed_pieces
        note = next(n for n in tr.budget.notes if "decoder layers cut into 2 sub-layer units" in n)
        assert "exact" in note and "attention | mlp" in note
        assert any("as configured do not fit (memory.host_mib" in n for n in tr.budget.notes)
        tr.initialize(progress=False)
        assert torch.isfinite(torch.tensor(tr.train_step().extra["losses"])).all()
    cfg.memory.host_mib = whole + 8
    with Trainer(cfg) as tr:
        assert tr.model.layer_parts == 1 and tr.user_cfg.model.layer_pieces is None


def _plan_shape(tmp_path, host_mib, act_mib, **shape):
    """The budget plan of a large shape at seq 4096, 8 micro-batches of one row, with every
    state's place given (nothing to rank: no machine measured) and ``act_mib`` of activations a
    (piece, micro-batch) as the probe would measure them."""
    from tiertrain.config import ModelConfig

    cfg = small_config(tmp_path, activations="auto", micro_batches=8)
    cfg.model = ModelConfig(**shape, max_seq_len=4096)
    cfg.data.seq_len, cfg.data.micro_batch_size = 4096, 1
    cfg.memory.host_mib, cfg.memory.keep_act_mib = host_mib, 0
    return _planned(cfg, lambda rt: (act_mib << 20, 0))


def _planned(cfg, acts):
    """``plan_budget`` of ``cfg`` on a runtime of its own, ``acts(rt)`` one pair's activations."""
    from tiertrain.cost.cuts import plan_budget
    from tiertrain.runtime import Runtime

    rt = Runtime(cfg)
    try:
        return plan_budget(cfg, rt, None, lambda: acts(rt))
    finally:
        rt.close()


def test_a_70b_shape_plans_within_16_gib_and_a_405b_shape_plans(tmp_path):
    """Issue 50's shapes at seq 4096, 8 micro-batches: Llama-3-70B at a 16 GiB host budget
    (whole blocks' pools alone need 38 GiB: refused) plans cut into 4 pieces a layer, the
    vocabulary cut to their size, with 1.8 GiB of a piece's activations (about what the probe
    measures at 4096 tokens); a 405 B shape plans, cut into 4, at 40 GiB."""
    cfg, plan = _plan_shape(tmp_path, 16000, 1800, **SEVENTY_B)
    assert cfg.model.layer_pieces == 4 and cfg.model.vocab_pieces == 5
    assert 12000 << 20 < sum(plan.fixed.values()) <= 16000 << 20, plan.fixed
    big = dict(SEVENTY_B, n_layers=126, d_model=16384, n_heads=128, d_ff=53248)
    cfg, plan = _plan_shape(tmp_path, 40000, 3000, **big)
    assert cfg.model.layer_pieces == 4 and sum(plan.fixed.values()) <= 40000 << 20


def test_jetmoes_two_routers_in_two_units_keep_their_auxiliary_gradients(tmp_path):
    """JetMoE's layer has two routers (its attention's mixture of heads and its MLP's experts),
    both in the auxiliary loss; cut into attention | MLP they run in different units. Each
    router's share of the auxiliary loss's gradient goes back to that router (known by its
    module: counting the routers a unit calls gave both the first share, and the training was off
    from plain PyTorch from the second step)."""
    from test_moe import _config as moe_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config("jetmoe")).save_pretrained(tmp_path / "m")
    cfg = small_config(tmp_path, kind="llama", micro_batches=2, steps=3)
    cfg.model.hf_dir = str(tmp_path / "m")
    tr, _ = assert_parity(_cut(cfg, 2))
    assert tr.model.routers is not None and tr.model.routers.count == 2 * len(tr.model.routers.blocks)


def test_layers_that_cannot_be_cut_exactly_are_refused_by_name(tmp_path):
    cfg = small_config(tmp_path, kind="gpt")
    with pytest.raises(ConfigError, match=r"model.layer_pieces = 2: this model's layers cannot be cut exactly"):
        build_model(_cut(cfg, 2).model, param_dtype=torch.float32, seed=0)
    # layers of other forms: tests/test_layouts.py
    from test_moe import _config as moe_config
    from transformers import AutoModelForCausalLM

    path = tmp_path / "mixtral"  # its router's jitter draws random numbers: not replayed in ranges
    jittery = moe_config("mixtral")
    jittery.router_jitter_noise = 0.1
    AutoModelForCausalLM.from_config(jittery).save_pretrained(path)
    cfg = small_config(tmp_path, kind="llama")
    cfg.model.hf_dir = str(path)
    build_model(_cut(cfg, 2).model, param_dtype=torch.float32, seed=0)  # attention | the MoE block: fine
    with pytest.raises(ConfigError, match=r"MixtralSparseMoeBlock's jitter_noise = 0.1 \(random in training"):
        build_model(_cut(cfg, 3).model, param_dtype=torch.float32, seed=0)
    with pytest.raises(
        ConfigError, match=r"model.layer_pieces = 5: .*\(5 pieces \(a dense layer cuts into 2, 3 or 4\)\)"
    ):
        build_model(_cut(small_config(tmp_path, kind="llama"), 5).model, param_dtype=torch.float32, seed=0)
    with pytest.raises(ConfigError, match=r"model.layer_pieces = 0: must be >= 1"):
        ModelConfig(kind="llama", layer_pieces=0)


def test_a_cut_its_measured_activations_make_short_gives_way_to_a_deeper_one(tmp_path):
    """The planner picks the shallowest cut whose pools fit before any activation is measured
    (measuring a 70 B piece's takes minutes); where that cut's measured activations then do not
    fit, the next deeper cut is measured and taken (it refused before, after the probes). Where
    even the deepest cut is short by its activations, the refusal names them and the rows a
    micro-batch that make them."""
    from tiertrain.config import ModelConfig

    cfg = small_config(tmp_path, activations="auto", micro_batches=8)
    cfg.model = ModelConfig(**SEVENTY_B, max_seq_len=4096)
    cfg.data.seq_len, cfg.data.micro_batch_size = 4096, 2
    cfg.memory.keep_act_mib = 0
    measured = []

    def acts(rt):  # a piece's activations: smaller the finer the cut
        measured.append(rt.model.layer_parts)
        return (12000 // rt.model.layer_parts) << 20, 0

    cfg.memory.host_mib = 24000  # 3 pieces fit but for their activations (21,432 MiB before them)
    planned, plan = _planned(cfg, acts)
    assert planned.model.layer_pieces == 4 and measured == [3, 4], measured
    assert sum(plan.fixed.values()) <= 24000 << 20
    cfg.memory.host_mib = 16000
    with pytest.raises(ConfigError) as err:
        _planned(cfg, lambda rt: (6400 << 20, 0))
    msg = str(err.value)
    assert "of which 12,800 MiB are activations of a micro-batch of 2 x 4,096 tokens, as measured" in msg, msg
    assert "fewer rows a micro-batch (data.micro_batch_size" in msg
