"""Layer layouts read from each layer's own ``forward`` (``models/layouts.py``), and the layers
of every layout cut into sub-layer units bit for bit: post-norm (OLMo 2), four norms (Gemma 2
and 3, GLM-4), residual dropouts (Phi-3), residual multipliers (Granite, HyperCLOVA X), MLPs
returning tuples (gpt-oss), a MoE block under another name (Granite-MoE), attention and MLP
side by side (Cohere, Command R7B, Phi: the normed input carried to the MLP's unit), MLPs of
other forms cut before their down_proj (Phi-3's and GLM-4's fused gate and up, Nemotron's two
matrices, BitNet's norm inside)."""

from __future__ import annotations

import pytest
import torch
from reference import small_config
from test_families import _config, _saved
from test_generate import _hf_generate
from test_parity import assert_parity

from tiertrain.config import ConfigError
from tiertrain.inference.generate import Sampling, generate
from tiertrain.models import build_model
from tiertrain.models.layouts import Branch, layout_of


def _layer(family: str, moe: bool = False) -> torch.nn.Module:
    from test_moe import _config as moe_config
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config((moe_config if moe else _config)(family)).model.layers[0]


def test_layouts_are_read_from_each_layers_forward():
    """What each form's branches are, read from transformers' source, not from a class list."""
    attention = ("attention_mask", "position_ids", "cache", "use_cache", "position_embeddings")
    llama = layout_of(_layer("llama"))
    assert llama.attention == Branch("self_attn", "input_layernorm", None, 2, keywords=attention)
    assert llama.mlp == Branch("mlp", "post_attention_layernorm")
    olmo2 = layout_of(_layer("olmo2"))  # post-norm: the norms after each module
    assert olmo2.attention == Branch("self_attn", None, "post_attention_layernorm", 2, keywords=attention)
    assert olmo2.mlp == Branch("mlp", None, "post_feedforward_layernorm")
    gemma2 = layout_of(_layer("gemma2"))  # four norms; its attention is given no use_cache
    assert gemma2.attention.keywords == ("position_embeddings", "attention_mask", "position_ids", "cache")
    assert gemma2.mlp == Branch("mlp", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    assert layout_of(_layer("phi3")).mlp.dropout == "resid_mlp_dropout"
    assert layout_of(_layer("granite")).attention.multiplier == "residual_multiplier"
    assert layout_of(_layer("gpt_oss", moe=True)).mlp == Branch("mlp", "post_attention_layernorm", None, 2)
    assert layout_of(_layer("granitemoe", moe=True)).mlp.module == "block_sparse_moe"
    assert layout_of(_layer("jetmoe", moe=True)).attention.module == "self_attention"
    cohere, phi = layout_of(_layer("cohere")), layout_of(_layer("phi"))  # side by side on one normed input
    assert cohere.parallel == ("residual", "attention", "mlp") and phi.parallel == ("attention", "mlp", "residual")
    assert phi.attention.dropout == phi.mlp.dropout == "resid_dropout" and phi.mlp.pre is None
    assert "nor attention and MLP side by side" in layout_of(_layer("stablelm"))  # an if inside
    llama4 = layout_of(_layer("llama4_text", moe=True))  # a MoE layer's block gives a tuple; a view
    assert llama4.mlp == Branch("feed_forward", "post_attention_layernorm", tuple_if="is_moe_layer", view=True)


class _Forms(torch.nn.Module):
    """Forwards close to the forms read, each of which the units would replay wrongly."""

    def attention_output_overwrites_the_normed_input(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask)
        m = self.mlp(hidden_states)  # the MLP takes attention's output here, not the normed input
        hidden_states = residual + hidden_states + m
        return hidden_states

    def residual_not_the_input(self, hidden_states, attention_mask=None):
        residual = self.proj(hidden_states)
        hidden_states = self.input_layernorm(hidden_states)
        a, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask)
        m = self.mlp(hidden_states)
        hidden_states = residual + a + m
        return hidden_states

    def output_named_residual(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        residual, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask)
        hidden_states = residual + residual
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        return hidden_states

    def subtracted(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask)
        hidden_states = residual - hidden_states
        return hidden_states

    @torch.no_grad()
    def decorated(self, hidden_states, attention_mask=None):  # refused on its decorator, before its body is read
        return hidden_states


@pytest.mark.parametrize(
    "form,why",
    [
        ("attention_output_overwrites_the_normed_input", "no residual add"),
        ("residual_not_the_input", "does not start with residual = hidden_states"),
        ("output_named_residual", "a branch's output named residual"),
        ("subtracted", "a residual add of another form"),
        ("decorated", "its forward is decorated with no_grad"),
    ],
)
def test_a_forward_of_another_form_is_refused_with_what_differs(form, why):
    layer = type("Layer", (torch.nn.Module,), {"forward": getattr(_Forms, form)})()
    assert why in layout_of(layer)


@pytest.mark.parametrize(
    "family,parts",
    [("olmo2", 2), ("gemma2", 4), ("gemma3_text", 3), ("phi3", 3), ("granite", 4), ("glm4", 3), ("hyperclovax", 3)]
    + [("cohere", 2), ("cohere2", 2), ("phi", 2), ("nemotron", 3), ("bitnet", 3)],
)
def test_layers_of_every_layout_cut_are_plain_pytorch_bit_for_bit(tmp_path, family, parts):
    """Losses and weights after 3 steps with clipping, 2 micro-batches, the windows in play."""
    _saved(family, tmp_path / "m")
    cfg = small_config(tmp_path, kind="llama", micro_batches=2, steps=3, clip=0.5)
    cfg.model.hf_dir, cfg.model.layer_pieces = str(tmp_path / "m"), parts
    tr, _ = assert_parity(cfg)
    assert tr.model.hf_config.model_type == family and len(tr.model.blocks) == 2 * parts


@pytest.mark.parametrize("family", ["gpt_oss", "granitemoe", "llama4_text"])
def test_mixtures_of_experts_of_other_forms_cut_in_two_are_plain_pytorch(tmp_path, family):
    """gpt-oss's block returns (states, router scores); Granite-MoE's is ``block_sparse_moe``,
    its residual adds multiplied; Llama 4's ``feed_forward`` returns a tuple on its MoE layers
    alone, viewed as the residual: attention | the block whole, the auxiliary loss on."""
    from test_moe import _config as moe_config
    from test_moe import _moe_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = moe_config(family)
    if family == "llama4_text":
        config.moe_layers = [1, 3]  # dense and MoE layers alternating: a tuple on every second
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    cfg = _moe_config(tmp_path, str(tmp_path / "m"), micro_batches=2, steps=2)
    cfg.model.layer_pieces = 2
    tr, _ = assert_parity(cfg)
    assert tr.model.block_layers[:4] == [0, 0, 1, 1]
    if family == "llama4_text":
        assert [b.whole.is_moe_layer for b in tr.model.blocks[1::2]] == [False, True, False, True]


@pytest.mark.parametrize("family,parts", [("gemma3_text", 4), ("olmo2", 2), ("cohere2", 2)])
def test_greedy_generation_of_cut_layouts_is_transformers_generate(tmp_path, family, parts):
    """Gemma 3: a sliding layer and a full one, each with its rotary table, four norms; OLMo 2:
    the norms after attention and MLP. Prompts past the 8-token window."""
    hf = _saved(family, tmp_path / "m")
    prompts = [list(range(10, 30)), list(range(40, 52))]
    cfg = small_config(tmp_path, kind="llama")
    cfg.model.hf_dir, cfg.model.layer_pieces, cfg.data.micro_batch_size = str(tmp_path / "m"), parts, 1
    assert generate(cfg, prompts, Sampling(max_new_tokens=10), eos=()) == _hf_generate(hf, prompts, 10)


@pytest.mark.parametrize(
    "family,parts,why",
    [
        ("olmo2", 3, "Olmo2DecoderLayer's MLP takes the residual stream with no norm before it: cut it into 2"),
        ("glm4", 4, r"Glm4MLP is not the Llama MLP \(down\(act\(gate\(x\)\) \* up\(x\)\)\): cut it into 2 or 3"),
        ("starcoder2", 3, "Starcoder2MLP's forward does not end in its down_proj"),
        ("cohere", 3, "CohereDecoderLayer runs attention and MLP side by side: cut it into 2 pieces"),
        ("stablelm", 2, r"StableLmDecoderLayer: its forward is not two residual branches .*nor attention and MLP"),
    ],
)
def test_layers_that_cannot_be_cut_exactly_name_why(tmp_path, family, parts, why):
    _saved(family, tmp_path / "m")
    cfg = small_config(tmp_path, kind="llama")
    cfg.model.hf_dir, cfg.model.layer_pieces = str(tmp_path / "m"), parts
    with pytest.raises(ConfigError, match=why):
        build_model(cfg.model, param_dtype=torch.float32, seed=0)
