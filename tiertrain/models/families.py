"""The transformers decoder-only families tiertrain cuts into units, and each one's quirks.

Every family here has one layout: ``model.embed_tokens``, ``model.layers`` (decoder layers,
each called whole with the model's own masks and rotary tables), a final norm and ``lm_head``.
What a family's own ``forward`` computes outside those modules is its quirks, named here so
that the units compute them exactly as the model does (``decoder.py``):

- ``final_norm``: the final norm's attribute (``norm``; Phi: ``final_layernorm``);
- ``embed_dropout``: a dropout module applied to the embeddings before the first layer (Phi);
  ``embed_dropout_p``: the config field of a functional one (Starcoder 2's ``embedding_dropout``);
- ``embed_multiplier`` / ``logits_divisor``: config fields the embeddings are multiplied and
  the logits divided by (Granite); ``logits_multiplier``: the logits multiplied by (Cohere's
  ``logit_scale``); ``hidden_divisor``: the final norm's output divided by it before the output
  projection (MiniCPM3's ``logits_scaling``);
- ``logit_softcap``: the config field of the final logits' soft cap, ``tanh(x / c) * c``
  (Gemma 2 and 3);
- ``attention``: the attention implementation transformers requires for the family (Gemma 2:
  ``eager``, its attention soft-capping has no SDPA kernel), else SDPA;
- ``aux_inexact_unless_zero``: a config field that must be 0 for the auxiliary loss to be exact
  (Phi-MoE's ``router_jitter_noise``: above 0 its sparsemixer uses the router logits in more
  places than the routing, and their gradients would be summed in another order than plain
  PyTorch sums them; up to 2e-10 measured): refused with the loss on, not computed inexactly;
- ``recompute_past``: a config field past which generation drops the key/value cache and
  computes the whole sequence again, once, where the sequence first passes it (Phi-3 and
  Phi-MoE's ``prepare_inputs_for_generation``, at ``original_max_position_embeddings``: there
  longrope's rotary tables switch from the short factors to the long, and the keys cached so far
  were rotated with the short); nothing where the config lacks the field.

Per-layer attention types (full or sliding window) and per-layer-type rotary tables are read
from the model's config and modules (``decoder.layer_types``), not from this table. A family
not here is refused when the model is built, in one line (``unsupported``): its forward may
compute what the units would silently leave out. Mixtures of experts not checked are refused
apart, naming what is run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Family", "FAMILIES", "family_of", "unsupported_reason"]


@dataclass(frozen=True)
class Family:
    """One family's quirks (see the module docstring)."""

    name: str
    final_norm: str = "norm"
    embed_dropout: str | None = None
    embed_multiplier: str | None = None
    logits_divisor: str | None = None
    logits_multiplier: str | None = None
    hidden_divisor: str | None = None
    embed_dropout_p: str | None = None
    logit_softcap: str | None = None
    attention: str = "sdpa"
    aux_inexact_unless_zero: str | None = None
    recompute_past: str | None = None
    # every layer slides where config.sliding_window is set and there are no layer_types (the
    # forward picks its mask on it); the other families' configs may carry the key unused
    window_slides: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral", window_slides=True),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3"),
    "phi3": Family("Phi-3", window_slides=True, recompute_past="original_max_position_embeddings"),
    "olmo2": Family("OLMo 2"),
    "gemma": Family("Gemma"),  # its embeddings scaled within its embedding module
    "gemma2": Family("Gemma 2", logit_softcap="final_logit_softcapping", attention="eager"),
    "gemma3_text": Family("Gemma 3", logit_softcap="final_logit_softcapping"),
    "phi": Family("Phi", final_norm="final_layernorm", embed_dropout="embed_dropout"),
    "granite": Family("Granite", embed_multiplier="embedding_multiplier", logits_divisor="logits_scaling"),
    # the Llama layout, each family's own layers (norms, biases, partial or no rotary, sliding
    # layers from the config) called whole: nothing in their forward outside them but what is here
    "stablelm": Family("StableLM"),
    "olmo": Family("OLMo"),
    "exaone4": Family("EXAONE 4"),
    "helium": Family("Helium"),
    "smollm3": Family("SmolLM3"),
    "glm": Family("GLM"),
    "glm4": Family("GLM-4"),
    "nemotron": Family("Nemotron"),
    "hunyuan_v1_dense": Family("Hunyuan"),
    "ernie4_5": Family("ERNIE 4.5"),
    "starcoder2": Family("Starcoder 2", embed_dropout_p="embedding_dropout", window_slides=True),
    "arcee": Family("Arcee"),
    "apertus": Family("Apertus"),
    "ministral": Family("Ministral"),
    "cohere": Family("Command R", logits_multiplier="logit_scale"),
    "cohere2": Family("Command R7B", logits_multiplier="logit_scale"),
    "seed_oss": Family("Seed-OSS"),
    "olmo3": Family("OLMo 3"),
    "ministral3": Family("Ministral 3", window_slides=True),
    "apertus1p5_text": Family("Apertus 1.5"),
    "bitnet": Family("BitNet"),
    "cwm": Family("CWM"),
    "diffllama": Family("DiffLlama"),
    "exaone": Family("EXAONE"),
    "internlm3": Family("InternLM3"),
    "iquestcoder": Family("IQuest-Coder"),
    "jais2": Family("Jais 2"),
    # its embedding module scales by scale_emb (as Gemma's); residual branches scaled in its layers
    "minicpm3": Family("MiniCPM3", hidden_divisor="logits_scaling"),
    # MuP: embeddings times embedding_multiplier, logits *times* logits_scaling (Granite divides)
    "hyperclovax": Family("HyperCLOVA X", embed_multiplier="embedding_multiplier", logits_multiplier="logits_scaling"),
    # mixtures of experts: routers, experts (3-D parameters, converted from per-expert checkpoints,
    # ``convert.py``), shared experts, all inside the layer; the auxiliary loss: ``routers.py``
    "mixtral": Family("Mixtral", window_slides=True),
    "qwen2_moe": Family("Qwen2-MoE"),
    "qwen3_moe": Family("Qwen3-MoE", window_slides=True),
    "olmoe": Family("OLMoE"),
    "gpt_oss": Family("gpt-oss", attention="eager"),  # its attention sinks have no SDPA kernel
    "deepseek_v3": Family("DeepSeek-V3"),  # multi-head latent attention; shared experts; no auxiliary loss
    "deepseek_v2": Family("DeepSeek-V2"),
    "glm4_moe": Family("GLM-4.5"),  # DeepSeek-V3's routing, full attention, partial rotary
    "glm4_moe_lite": Family("GLM-4-MoE-Lite"),  # DeepSeek-V3's latent attention and routing
    "dots1": Family("dots.llm1"),
    "flex_olmo": Family("FlexOlmo"),
    # its input jitter draws random numbers in training, as dropout (exact at one micro-batch)
    "phimoe": Family(
        "Phi-MoE",
        aux_inexact_unless_zero="router_jitter_noise",
        window_slides=True,
        recompute_past="original_max_position_embeddings",
    ),
    "granitemoe": Family("Granite-MoE", embed_multiplier="embedding_multiplier", logits_divisor="logits_scaling"),
    "llama4_text": Family("Llama 4 (text)"),  # chunked attention; no rotary on every fourth layer
    "jetmoe": Family("JetMoE"),
}

# Mixtures of experts not checked yet
_MOE = {"dbrx", "jamba", "granitemoeshared", "granitemoehybrid", "minimax", "qwen3_next", "ernie4_5_moe",
        "hunyuan_v1_moe", "bailing_moe", "longcat_flash"}  # fmt: skip


def family_of(config: Any) -> Family | None:
    """The family of a transformers config (None: GPT-2, or a model type not supported)."""
    return FAMILIES.get(getattr(config, "model_type", ""))


def supported_names() -> str:
    return ", ".join(f.name for f in FAMILIES.values()) + " and GPT-2"


def unsupported_reason(config: Any) -> str:
    """Why a model known by its config is not one the units compute ('' where it is)."""
    model_type = getattr(config, "model_type", "")
    if model_type == "gpt2":
        return ""
    if model_type in _MOE:
        return "a mixture of experts tiertrain has not been checked on"
    if model_type not in FAMILIES:
        return "a family tiertrain has not been checked on: its forward may compute outside its layers"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention is set (an encoder's attention, not a causal LM's)"
    field = FAMILIES[model_type].aux_inexact_unless_zero
    if field and getattr(config, "output_router_logits", False) and getattr(config, field, 0):
        return (
            f"with output_router_logits on, {field} = {getattr(config, field)} makes its auxiliary loss's gradient "
            f"sum in another order than transformers' (not bit-identical); set {field} to 0 or "
            "output_router_logits to false in config.json"
        )
    return ""
