"""The FLOPs a token the step line's MFU and the benchmarks' TFLOPS count
(``training/metrics.flops_per_token``), against what PyTorch's own FLOP counter counts for a
forward and backward of the same model in plain transformers (eager attention, so that the
attention's products are counted too): a dense Llama, a mixture of experts (a token multiplies
through its top-k experts only: counting every expert overstated a Qwen3-MoE's FLOPs by the
experts' E / k), LoRA on a frozen base (no weight gradients for the base), frozen leading layers
(no backward at all), and layers cut into units alike. A sliding layer's attention counts its
window."""

from __future__ import annotations

import pytest
import torch
from reference import small_config
from torch.utils.flop_counter import FlopCounterMode

from tiertrain.models import build_model
from tiertrain.models.freeze import apply_freeze, freeze_all
from tiertrain.training.metrics import AdapterFlops, flops_per_token

T, B = 32, 2
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
OTHER = dict(vocab_size=256, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2)


def _hf(kind: str):
    import transformers as t

    torch.manual_seed(0)
    config = {
        "llama": lambda: t.LlamaConfig(**COMMON, intermediate_size=128),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(
            **COMMON, intermediate_size=128, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            head_dim=16, decoder_sparse_step=1, mlp_only_layers=[],
        ),
        "mistral": lambda: t.MistralConfig(**COMMON, intermediate_size=128, sliding_window=8),
        # other shapes and families: heads of their own size (Gemma 2), latent attention and shared
        # experts (DeepSeek-V3), 6 experts (Mixtral)
        "mixtral": lambda: t.MixtralConfig(**OTHER, intermediate_size=160, num_local_experts=6, num_experts_per_tok=2),
        "gemma2": lambda: t.Gemma2Config(**OTHER, intermediate_size=160, head_dim=32, sliding_window=64),
        "deepseek_v3": lambda: t.DeepseekV3Config(
            **{**OTHER, "num_key_value_heads": 6}, intermediate_size=160, n_routed_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        ),
    }[kind]()  # fmt: skip
    config._attn_implementation = "eager"  # attention as products the counter sees
    config._experts_implementation = "eager"  # experts too (it counts no grouped_mm)
    return t.AutoModelForCausalLM.from_config(config)


def _counted(model, frozen=lambda name: False, lora: int = 0) -> float:
    """FLOPs a token PyTorch's counter counts for one forward and backward of ``model``."""
    for name, p in model.named_parameters():
        p.requires_grad_(not frozen(name))
    if lora:
        import peft

        model = peft.inject_adapter_in_model(
            peft.LoraConfig(r=lora, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
            model,
        )
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as fc:
        model(input_ids=ids, labels=ids).loss.backward()
    return fc.get_total_flops() / (B * T), model


def _ours(tmp_path, hf_model, freeze=(), layer_pieces=None, trained_outside: int = 0) -> float:
    """``flops_per_token`` of the model tiertrain builds from ``hf_model`` saved, ``freeze``
    applied as ``train.freeze``'s selectors are ('all': as adapters do)."""
    path = tmp_path / "hf"
    hf_model.save_pretrained(path)
    cfg = small_config(tmp_path, kind="llama")
    cfg.model.hf_dir, cfg.model.layer_pieces = str(path), layer_pieces
    model = build_model(cfg.model, param_dtype=torch.float32, seed=0)[0]
    if freeze == "all":
        freeze_all(model)
    elif freeze:
        apply_freeze(model, list(freeze))
    return flops_per_token(model, T, hf_model.config.hidden_size, adapters=AdapterFlops(trained=trained_outside))


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "mixtral", "gemma2", "deepseek_v3"])
def test_a_trained_models_flops_are_what_pytorch_counts(tmp_path, kind):
    counted, _ = _counted(_hf(kind))
    ours = _ours(tmp_path, _hf(kind))
    # the counter also counts the first layer's input gradient, and only products: within 0.5%
    assert ours == pytest.approx(counted, rel=5e-3), (ours, counted)
    if kind == "qwen3_moe":  # every expert counted would be far above (8 experts, 2 a token)
        experts = sum(p.numel() for p in _hf(kind).parameters() if p.dim() == 3)
        assert ours + 6 * experts * (1 - 2 / 8) > 1.5 * counted


def test_cut_layers_count_as_whole_ones(tmp_path):
    assert _ours(tmp_path / "a", _hf("qwen3_moe"), layer_pieces=3) == _ours(tmp_path / "b", _hf("qwen3_moe"))


def test_a_frozen_base_under_adapters_and_frozen_leading_layers(tmp_path):
    """LoRA: the base forms no weight gradients (4 a weight, not 6), the adapters' 6 each. The
    counter skips the input gradients of the first layer's query, key and value and of their
    adapters' A (their input, the frozen embedding's, asks none), which the count keeps: 18 k of
    its 643 k a token here, within 4% on 3 layers of 64 (less on deeper models). Frozen
    embedding and first layer in full training: no backward for them at all; the first layer
    alone (the embedding trains): its input gradients, not its weights'."""
    counted, peft_model = _counted(_hf("llama"), frozen=lambda n: True, lora=4)
    adapters = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    ours = _ours(tmp_path / "lora", _hf("llama"), freeze="all", trained_outside=adapters)
    assert counted < ours < 1.04 * counted, (ours, counted)
    full = _ours(tmp_path / "full", _hf("llama"))
    base = sum(p.numel() for n, p in _hf("llama").named_parameters() if "embed_tokens" not in n)
    assert full - ours == 2 * base - 6 * adapters  # a frozen base counted 6 a weight, as if it trained

    def lead(name):  # the embedding and the first layer, as train.freeze = ["embed", "blocks:0"]
        return "embed" in name or ".layers.0." in name or name.startswith("layers.0.")

    counted, _ = _counted(
        _hf("llama"), frozen=lambda n: ".layers.0." in n
    )  # the embedding trains: layer 0's backward runs
    assert _ours(tmp_path / "l0", _hf("llama"), freeze=("blocks:0",)) == pytest.approx(counted, rel=5e-3)
    counted, _ = _counted(_hf("llama"), frozen=lead)
    assert _ours(tmp_path / "lead", _hf("llama"), freeze=("embed", "blocks:0")) == pytest.approx(counted, rel=5e-3)


def test_a_sliding_layers_attention_counts_its_window(tmp_path):
    """Mistral with a window of 8 at 32 tokens: each layer's attention counts 8 positions a
    token (forward 2 x 8 x (heads x (16 + 16)), three times), the products as the full model's."""
    sliding = _ours(tmp_path / "w", _hf("mistral"))
    hf = _hf("mistral")
    hf.config.sliding_window = None
    full = _ours(tmp_path / "f", hf)
    assert full - sliding == 3 * 6 * (T - 8) * 4 * (16 + 16)


def expert_lora_flops(make_hf, tmp_path, r: int, batch: int = B, tokens: int = T):
    """(PyTorch's count, ours, the count before, our ``AdapterFlops``) a token for LoRA of rank
    ``r`` on every expert stack of the mixture ``make_hf()`` builds (seeded: the same model each
    call), over ``batch`` rows of ``tokens``. peft forms each stack's sum twice a forward (its
    parametrization is computed again at each access of the parameter, and transformers' experts
    access it twice); tiertrain forms it once (a pre-hook): the counter's forward ``baddbmm`` is
    halved. Also run on other families and shapes by bench/checks/expert_lora_flops.py."""
    import peft

    from tiertrain.adapters.lora import LoRA

    stacks = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    hf = make_hf()
    for p in hf.parameters():
        p.requires_grad_(False)
    hf = peft.inject_adapter_in_model(peft.LoraConfig(r=r, target_modules=[], target_parameters=stacks), hf)
    ids = torch.randint(0, 256, (batch, tokens), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as fc:
        loss = hf(input_ids=ids, labels=ids).loss
    sums = fc.get_flop_counts()["Global"].get(torch.ops.aten.baddbmm, 0)
    with FlopCounterMode(display=False) as fc2:
        loss.backward()
    counted = (fc.get_total_flops() - sums / 2 + fc2.get_total_flops()) / (batch * tokens)

    path = tmp_path / f"hf{r}"
    make_hf().save_pretrained(path)
    cfg = small_config(tmp_path / f"c{r}", kind="llama")
    cfg.model.hf_dir = str(path)
    cfg.adapter.kind, cfg.adapter.rank, cfg.adapter.target, cfg.adapter.target_parameters = "lora", r, [], stacks
    model = build_model(cfg.model, param_dtype=torch.float32, seed=0)[0]
    freeze_all(model)
    lora = LoRA(model, cfg.adapter, seed=0, device="cpu")
    adapters, width = lora.flops(), hf.config.hidden_size
    ours = flops_per_token(model, tokens, width, adapters=adapters, micro_batch_tokens=batch * tokens)
    trained = AdapterFlops(trained=sum(p.numel() for p in lora.params()))
    return counted, ours, flops_per_token(model, tokens, width, adapters=trained), adapters


def _expert_lora(tmp_path, r: int) -> tuple[float, float, float]:
    """(PyTorch's count, ours, the count before) a token for LoRA of rank ``r`` on every expert
    stack of the Qwen3-MoE (``expert_lora_flops``)."""
    counted, ours, before, adapters = expert_lora_flops(lambda: _hf("qwen3_moe"), tmp_path, r)
    assert adapters.trained == 0 and len(adapters.weighted) == 2 * 3
    return counted, ours, before


def test_lora_on_the_experts_counts_their_weights_gradient_and_the_sums(tmp_path):
    """LoRA on a mixture's 3-D experts (``adapter.target_parameters``, peft's ``ParamWrapper``):
    each forward forms ``W + B A``, so the backward forms the experts' weight gradient (6 a
    weight at top-k of E, not a frozen weight's 4), and the sums cost their own products once
    a micro-batch (6 x experts x in x out x rank), while A and B multiply no token. Counted as a
    frozen base with 6 an adapter weight a token, it was 1.28x PyTorch's count at rank 16 here."""
    c4, o4, _ = _expert_lora(tmp_path, 4)
    c16, o16, before = _expert_lora(tmp_path, 16)
    assert o16 - o4 == pytest.approx(c16 - c4, rel=1e-6), (o16 - o4, c16 - c4)  # the sums' products, exactly
    # the counter leaves out the first layer's input gradients and attention backward (nothing
    # before its experts trains: 69 k a token on these 3 layers of 64, 8% of rank 16's 890 k,
    # about 1 / layers of the non-expert share on a deep model), which the count keeps, as for
    # LoRA on linear layers
    assert 0 < o16 - c16 < 0.08 * c16, (o16, c16)
    assert before > 1.25 * c16, (before, c16)
