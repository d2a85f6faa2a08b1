"""Every decoder-only family tiertrain runs (``models/families.py``), from a tiny random model
that transformers' own ``save_pretrained`` wrote, with sequences longer than any sliding window
(8 positions against 32): training bit-identical to plain PyTorch + AdamW in fp32 with clipping,
states on the storage tier (so the first step's loss is transformers' forward loss); greedy
generation token for token what transformers' ``generate`` gives, for prompts longer than the
window; LoRA bit-identical to peft's on plain PyTorch.

Each family's quirk is in its config here: sliding windows on every layer (Mistral, Phi-3) or on
some (Qwen2, Qwen3 with ``use_sliding_window``; Gemma 2 and 3 alternating), Gemma's scaled
embeddings, Gemma 2's attention and final-logit soft-capping (eager attention), Gemma 3's
rotary tables per layer type, Phi's final LayerNorm, partial rotary and biased head, Granite's
embedding, residual, attention and logit multipliers, OLMo 2's norms after the sublayers."""

from __future__ import annotations

import pytest
import torch
from reference import small_config
from test_generate import _hf_generate
from test_lora import assert_lora_parity
from test_parity import assert_parity

from tiertrain.inference.generate import Sampling, generate
from tiertrain.models.decoder import layer_types as decoder_layer_types

WINDOW = 8
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=True,  # as Gemma, Llama 3.2 1B/3B and the small Qwen2.5s: plain order of the tied sums (test_parity)
)


def _config(family: str):
    import transformers as t

    if family in MORE:
        config = t.AutoConfig.for_model(family, **{**COMMON, **MORE[family]})
        if "head_dim" in config.to_dict():
            config.head_dim = 16
        return config

    w = dict(sliding_window=WINDOW)
    return {
        "llama": lambda: t.LlamaConfig(**COMMON),
        "mistral": lambda: t.MistralConfig(**COMMON, **w),
        "qwen2": lambda: t.Qwen2Config(**COMMON, **w, use_sliding_window=True, max_window_layers=1),
        "qwen3": lambda: t.Qwen3Config(**COMMON, **w, head_dim=16, use_sliding_window=True, max_window_layers=1),
        "phi3": lambda: t.Phi3Config(**COMMON, **w),
        "olmo2": lambda: t.Olmo2Config(**COMMON),
        "gemma": lambda: t.GemmaConfig(**COMMON, head_dim=16),
        "gemma2": lambda: t.Gemma2Config(
            **COMMON, **w, head_dim=16, final_logit_softcapping=3.0, attn_logit_softcapping=5.0
        ),
        "gemma3_text": lambda: t.Gemma3TextConfig(
            **COMMON, **w, head_dim=16, final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"]
        ),
        "phi": lambda: t.PhiConfig(**COMMON, partial_rotary_factor=0.5),
        "granite": lambda: t.GraniteConfig(
            **COMMON, embedding_multiplier=6.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.2
        ),
    }[family]()


# the Llama layout with their own layers, each with what its config asks beyond the defaults
MORE = {"stablelm": {}, "olmo": {}, "exaone4": dict(sliding_window=WINDOW), "helium": {}, "smollm3": {}, "glm": {},
        "glm4": {}, "nemotron": {}, "hunyuan_v1_dense": {}, "ernie4_5": {}, "arcee": {}, "apertus": {},
        "starcoder2": dict(embedding_dropout=0.0, residual_dropout=0.0, sliding_window=WINDOW),
        "ministral": dict(sliding_window=WINDOW), "cohere": dict(logit_scale=0.5),
        "cohere2": dict(logit_scale=0.5, sliding_window=WINDOW), "seed_oss": dict(residual_dropout=0.0, attention_dropout=0.0),
        "olmo3": {}, "ministral3": dict(sliding_window=WINDOW), "apertus1p5_text": {}, "bitnet": {}, "cwm": {},
        "diffllama": {}, "exaone": {}, "internlm3": {}, "iquestcoder": {}, "jais2": {},
        "hyperclovax": dict(embedding_multiplier=2.0, logits_scaling=0.5, residual_multiplier=0.5, attention_multiplier=0.2),
        # latent attention (as many key/value heads as heads), embeddings and final hidden states scaled
        "minicpm3": dict(num_key_value_heads=4, scale_emb=2.0, dim_model_base=16, scale_depth=1.4)}  # fmt: skip
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text", "phi", "granite",
            *MORE]  # fmt: skip


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    """(family, directory, the model as transformers loads it from there)."""
    d = tmp_path_factory.mktemp(request.param)
    return request.param, str(d), _saved(request.param, d)


def _saved(family, directory):
    """A random model of ``family`` written to ``directory`` by save_pretrained, and loaded back."""
    from transformers import AutoModelForCausalLM

    from tiertrain.models.families import FAMILIES as KNOWN

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(family)).save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation=KNOWN[family].attention).eval()


def _family_config(tmp_path, path, **kw):
    cfg = small_config(tmp_path, kind="llama", **kw)
    cfg.model.hf_dir = path  # the kind every family but GPT-2 has (config.json's model_type says which)
    return cfg


def test_training_is_plain_pytorch_bit_for_bit(tmp_path, family_dir):
    family, path, _ = family_dir
    tr, losses = assert_parity(_family_config(tmp_path, path, micro_batches=2, steps=3, clip=0.5))
    assert tr.model.hf_config.model_type == family and len(losses) == 3
    if family in ("mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"):  # the window is in play
        assert "sliding_attention" in [b.kind for b in tr.model.blocks]


def test_greedy_generation_past_the_window_is_transformers_generate(tmp_path, family_dir):
    _, path, hf = family_dir
    prompts = [list(range(10, 30)), list(range(40, 52))]  # 20 and 12 tokens: past the 8-token window
    cfg = _family_config(tmp_path, path)
    cfg.data.micro_batch_size = 2
    # no stop token on either side (_hf_generate passes eos_token_id=None): a random model may emit one
    assert generate(cfg, prompts, Sampling(max_new_tokens=10), eos=()) == _hf_generate(hf, prompts, 10)


def test_lora_is_peft_bit_for_bit(tmp_path, family_dir):
    _, path, hf = family_dir
    cfg = _family_config(tmp_path, path, micro_batches=2, steps=3, clip=0.05)
    linear = {n.rsplit(".", 1)[-1] for n, m in hf.model.layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    cfg.adapter.kind, cfg.adapter.rank, cfg.adapter.alpha, cfg.adapter.target = "lora", 4, 9.0, sorted(linear)
    cfg.update.mode = "auto"
    assert_lora_parity(cfg)


@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_a_vocabulary_cut_into_pieces_keeps_the_familys_quirks(tmp_path, family):
    """The pieces replace the embedding module and the output projection: Gemma 2's embedding
    scale (applied by its module) and soft-capped logits, Granite's embedding multiplier and
    logit divisor, are applied around them. Within the pieces' stated rounding (test_pieces:
    SGD, losses within 1e-6 relative, weights within 1e-5 of how far they moved)."""
    from test_pieces import _rel, _train_cut
    from transformers import AutoModelForCausalLM

    from tiertrain.reference import reference_model, reference_train, weights_of

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path / "m")
    cfg = _family_config(tmp_path, str(tmp_path / "m"), micro_batches=2, lr=0.5)
    cfg.optim.name, cfg.optim.momentum = "sgd", 0.9
    ref = reference_model(cfg)
    init = weights_of(ref)
    ref_losses, ref_w = reference_train(cfg, ref)
    losses, w, names, tr = _train_cut(cfg, init, 3)
    assert len(tr.model.head_pieces) == 3 and _rel(losses, ref_losses) < 1e-6, (losses, ref_losses)
    for n, t in w.items():
        moved = (ref_w[names[n]] - init[names[n]]).norm()
        assert (t - ref_w[names[n]]).norm() <= 1e-5 * moved + 1e-12, n


@pytest.mark.parametrize("family", ["mistral", "gemma2", "mixtral"])
def test_packed_documents_within_a_sliding_window_are_plain_pytorch_bit_for_bit(tmp_path, family, monkeypatch):
    """Chat rows packed with attention within each document (positions restarting at each), a
    4-token window inside 12-token rows: transformers' mask is both block-diagonal and banded,
    as the model's forward builds it from the same position ids; Mixtral with its auxiliary loss."""
    from test_finetune_data import _finetune_cfg, _finetune_data
    from test_moe import _config as moe_config
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, _, chat = _finetune_data(tmp_path)
    config = moe_config(family) if family == "mixtral" else _config(family)
    config.sliding_window = 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    cfg = _finetune_cfg(tmp_path, chat, tok, kind="llama", clip=0.5)
    cfg.model.hf_dir = str(tmp_path / "m")
    cfg.data.packing, cfg.data.packed_attention = True, "document"
    tr, _ = assert_parity(cfg)
    assert "sliding_attention" in [b.kind for b in tr.model.blocks]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_offloaded_activations_of_a_sliding_layer_after_a_full_one_are_plain_pytorch(tmp_path, family):
    """Qwen2/3 with use_sliding_window (layer 0 full, layer 1 sliding): the offload record was
    sized on layer 0 alone (the same parameters), the sliding layer saves more, and the first
    step stopped. Blocks of each attention type are measured apart."""
    path = str(tmp_path / "m")
    _saved(family, tmp_path / "m")
    tr, _ = assert_parity(_family_config(tmp_path, path, micro_batches=2, steps=2, activations="offload"))
    assert [b.kind for b in tr.model.blocks] == ["full_attention", "sliding_attention"] and tr.acts.offloaded > 0


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_sliding_layers_cache_holds_its_window_alone_spilled_or_not(tmp_path, family, monkeypatch):
    """Prompts of 20 and 12 tokens and 10 new ones against an 8-token window: a sliding layer's
    cache holds 8 positions (a full layer's 30), in host memory and on the storage tier alike
    (a simulated separate-memory device there), rewritten whole each step once the window moved;
    the tokens are transformers' generate's either way."""
    import tiertrain.inference.generate as generate_mod
    from tiertrain.device import AsyncCpuDevice
    from tiertrain.inference.kvcache import TieredKV
    from tiertrain.models.hf import kv_bytes, kv_positions

    path, hf = str(tmp_path / "m"), _saved(family, tmp_path / "m")
    made = []

    class Recorded(TieredKV):
        def __init__(self, *a, **kw):
            made.append(self)
            super().__init__(*a, **kw)

    monkeypatch.setattr(generate_mod, "TieredKV", Recorded)
    prompts = [list(range(10, 30)), list(range(40, 52))]
    want = _hf_generate(hf, prompts, 10)
    cfg = _family_config(tmp_path, path)
    cfg.data.micro_batch_size = 2
    assert generate(cfg, prompts, Sampling(max_new_tokens=10), eos=()) == want
    sliding = [k == "sliding_attention" for k in decoder_layer_types(hf.config)]
    assert kv_positions(hf.config, 30) == [WINDOW if s else 30 for s in sliding] and any(sliding)
    held = made[-1]
    assert [held.pairs[layer, 0].shape[2] for layer in range(len(sliding))] == kv_positions(hf.config, 30)
    assert (
        held.host_bytes
        == kv_bytes(hf.config, 2, 30, torch.float32)
        < kv_bytes((len(sliding), 2, 16), 2, 30, torch.float32)
    )
    cfg.memory.kv_host_mib, cfg.memory.host_param_mib = 0, 0
    assert generate(cfg, prompts, Sampling(max_new_tokens=10), eos=(), device=AsyncCpuDevice()) == want
    spilled = made[-1]
    assert spilled.spilled_bytes == held.host_bytes and spilled.written_bytes > 0


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}  # fmt: skip


@pytest.mark.parametrize("family", ["phi3", "phimoe"])
def test_phi3s_cache_is_computed_again_where_longrope_switches_tables(tmp_path, family, monkeypatch):
    """Phi-3 and Phi-MoE with longrope: where the sequences first pass
    original_max_position_embeddings (16; prompts of 12 and 9 tokens, 12 new ones) the rotary
    tables switch to the long factors, and transformers' generate drops its cache and computes
    the whole sequences again (their prepare_inputs_for_generation). Token for token the same,
    the cache in host memory and on the storage tier (a simulated separate-memory device); the
    cache kept as it was gives other tokens from the sixth on."""
    import transformers as t

    import tiertrain.inference.generate as generate_mod
    from tiertrain.device import AsyncCpuDevice
    from tiertrain.inference.kvcache import TieredKV

    more = dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, input_jitter_noise=0.0)
    kw = {**COMMON, "tie_word_embeddings": False, "initializer_range": 0.1, **(more if family == "phimoe" else {})}
    if family == "phi3":
        config = t.Phi3Config(**kw, original_max_position_embeddings=16, rope_parameters=dict(LONGROPE))
    else:
        config = t.AutoConfig.for_model("phimoe", **kw, rope_parameters={**LONGROPE, "short_mscale": 1.1,
                                                                         "long_mscale": 1.2})  # fmt: skip
    path = tmp_path / "m"
    torch.manual_seed(0)
    t.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    hf = t.AutoModelForCausalLM.from_pretrained(path).eval()
    assert hf.config.original_max_position_embeddings == 16
    prompts = [list(range(10, 22)), list(range(40, 49))]
    want = _hf_generate(hf, prompts, 12)
    cfg = _family_config(tmp_path, str(path))
    cfg.data.micro_batch_size, cfg.data.seq_len = 2, 32
    assert generate(cfg, prompts, Sampling(max_new_tokens=12), eos=()) == want
    cfg.memory.kv_host_mib, cfg.memory.host_param_mib = 0, 0
    assert generate(cfg, prompts, Sampling(max_new_tokens=12), eos=(), device=AsyncCpuDevice()) == want
    monkeypatch.setattr(TieredKV, "restart", lambda self, m: None)
    monkeypatch.setattr(generate_mod._Decoding, "again", lambda self, length: False)
    kept = generate(cfg, prompts, Sampling(max_new_tokens=12), eos=())
    assert [row[:5] for row in kept] == [row[:5] for row in want] and kept != want


def test_starcoder2s_embedding_dropout_is_its_forwards(tmp_path):
    """Starcoder 2's forward drops out the embeddings with a function, outside any module: the
    units apply it as that forward does (at one micro-batch plain PyTorch draws its masks in the
    layer-major order too: tests/test_offload.py), bit for bit; without it the losses differ."""
    from transformers import AutoModelForCausalLM

    from tiertrain.models import families

    config = _config("starcoder2")
    config.embedding_dropout = 0.3
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    cfg = _family_config(tmp_path / "a", str(tmp_path / "m"), micro_batches=1, steps=2)
    assert_parity(cfg)
    plain = families.Family("Starcoder 2")  # the quirk left out
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(families.FAMILIES, "starcoder2", plain)
        with pytest.raises(AssertionError):
            assert_parity(_family_config(tmp_path / "b", str(tmp_path / "m"), micro_batches=1, steps=2))


def test_a_sliding_window_key_a_familys_forward_ignores_is_ignored(tmp_path):
    """A Llama config carrying "sliding_window" (a conversion's leftover: its forward attends in
    full) was run with every layer sliding: 4.10342 against transformers' 4.10567 here."""
    import transformers as t

    torch.manual_seed(0)
    t.AutoModelForCausalLM.from_config(t.LlamaConfig(**COMMON, sliding_window=WINDOW)).save_pretrained(tmp_path / "m")
    tr, _ = assert_parity(_family_config(tmp_path, str(tmp_path / "m"), steps=2))
    assert {b.kind for b in tr.model.blocks} == {"full_attention"}


def test_the_padding_row_of_a_vocabulary_cut_into_pieces_gets_no_gradient(tmp_path):
    """nn.Embedding's padding_idx row gets no gradient; the pieces gave it the tokens' (row 32,
    the space, moved by 0.15 in a step where the whole embedding's did not move)."""
    import transformers as t
    from test_pieces import _train_cut

    from tiertrain.reference import reference_model, reference_train, weights_of

    torch.manual_seed(0)
    conf = t.LlamaConfig(**{**COMMON, "pad_token_id": 32, "tie_word_embeddings": False})
    t.AutoModelForCausalLM.from_config(conf).save_pretrained(tmp_path / "m")
    cfg = _family_config(tmp_path, str(tmp_path / "m"), micro_batches=2, lr=0.5, steps=1)
    cfg.optim.name, cfg.optim.momentum = "sgd", 0.9
    ref = reference_model(cfg)
    init = weights_of(ref)
    _, ref_w = reference_train(cfg, ref)
    _, w, names, tr = _train_cut(cfg, init, 3)
    emb = next(n for n in ref_w if "embed_tokens" in n)
    assert torch.equal(ref_w[emb][32], init[emb][32])  # the reference leaves it
    rows = {names[n]: t_ for n, t_ in w.items()}
    assert torch.equal(rows[emb][32], init[emb][32]), (rows[emb][32] - init[emb][32]).abs().max()


def test_heads_whose_vocabulary_cannot_be_cut_are_named_and_apertus_output_vocabulary(tmp_path):
    """Phi's output projection has a bias: model.vocab_pieces (or the planner, where the budget
    was short) failed with a ValueError traceback; the planner now offers no cut and a given
    one is refused by name. Apertus 1.5 with an output vocabulary smaller than its input one
    failed in the loss ("Expected input batch_size (24) to match target batch_size (32)")."""
    import transformers as t

    from tiertrain.config import ConfigError
    from tiertrain.models import auto_pieces, build_model

    torch.manual_seed(0)
    t.AutoModelForCausalLM.from_config(_config("phi")).save_pretrained(tmp_path / "phi")
    cfg = _family_config(tmp_path, str(tmp_path / "phi"))
    assert auto_pieces(build_model(cfg.model, param_dtype=torch.float32, seed=0)[0]) is None
    cfg.model.vocab_pieces = 2
    with pytest.raises(
        ConfigError,
        match=r"model.vocab_pieces = 2: this model's vocabulary cannot be cut into pieces \(its output projection has a bias",
    ):  # noqa: E501
        build_model(cfg.model, param_dtype=torch.float32, seed=0)
    conf = t.AutoConfig.for_model(
        "apertus1p5_text", **{**COMMON, "tie_word_embeddings": False}, output_vocab_size=COMMON["vocab_size"] - 16
    )  # noqa: E501
    t.AutoModelForCausalLM.from_config(conf).save_pretrained(tmp_path / "ap")
    tr, _ = assert_parity(_family_config(tmp_path / "b", str(tmp_path / "ap"), steps=2))
