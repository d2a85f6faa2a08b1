"""The MFU's FLOPs a token for LoRA on a mixture's experts (``adapter.target_parameters``) on
families and shapes the tests do not use (Mixtral 96 wide with 6 experts, OLMoE 128 wide with
8, each at two depths), against PyTorch's FLOP counter on peft's ParamWrapper (eager attention
and experts; the counter's forward ``baddbmm`` halved: peft forms each sum twice a forward,
tiertrain once). Prints what rank 4 -> 16 adds (the sums' products: exact), the totals at rank
16, and the count before this change (a frozen base, 6 an adapter weight a token).

    python bench/checks/expert_lora_flops.py
"""

import os
import pathlib
import sys
import tempfile

import torch
import transformers as t

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from test_flops import expert_lora_flops  # noqa: E402

B, T = 2, 48


def conf(kind, layers):
    common = dict(vocab_size=256, num_hidden_layers=layers)
    if kind == "mixtral":
        c = t.MixtralConfig(
            **common,
            hidden_size=96,
            intermediate_size=160,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_local_experts=6,
            num_experts_per_tok=2,
        )
    else:
        c = t.OlmoeConfig(
            **common,
            hidden_size=128,
            intermediate_size=96,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
        )
    c._attn_implementation = "eager"
    c._experts_implementation = "eager"
    return c


def run(kind, layers, r, tmp):
    def make():
        torch.manual_seed(0)
        return t.AutoModelForCausalLM.from_config(conf(kind, layers))

    counted, ours, before, _ = expert_lora_flops(make, pathlib.Path(tmp) / f"{kind}{layers}", r, B, T)
    return counted, ours, before


tmp = tempfile.mkdtemp()
for kind, layers in (("mixtral", 4), ("mixtral", 12), ("olmoe", 5), ("olmoe", 15)):
    c4, o4, _ = run(kind, layers, 4, tmp)
    c16, o16, b16 = run(kind, layers, 16, tmp)
    print(
        f"{kind} {layers} layers: rank 4->16 added: counted {c16 - c4:.0f} ours {o16 - o4:.0f}; total r16: counted {c16:.0f} ours {o16:.0f} ({o16 / c16:.4f}x), the count before {b16:.0f} ({b16 / c16:.3f}x)"
    )
