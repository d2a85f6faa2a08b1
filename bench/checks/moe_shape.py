"""The mixtures of experts' checks on a shape the tests do not use: 3 layers, hidden 96, 6 heads
(3 key/value heads; 6 for latent attention), 6 experts of 40, top-3, auxiliary loss coefficient
0.05, seq 48, 3 micro-batches, 4 steps, clip 0.3; graphs recomputed and offloaded; greedy
generation of 12 tokens for 3 prompts of 9 to 31 tokens against transformers' generate."""

import os
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from reference import small_config
from test_generate import _hf_generate
from test_parity import assert_parity
from transformers import AutoModelForCausalLM

from tiertrain.inference.generate import Sampling, generate
from tiertrain.models.families import FAMILIES as KNOWN

BASE = dict(vocab_size=256, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
            max_position_embeddings=96, bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.05)


def config(family):
    import transformers as t

    latent = dict(kv_lora_rank=24, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    return {
        "olmoe": lambda: t.OlmoeConfig(**BASE, intermediate_size=40, num_experts=6, num_experts_per_tok=3, **AUX),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(
            **BASE, head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40, **AUX
        ),
        "gpt_oss": lambda: t.GptOssConfig(
            **BASE,
            head_dim=16,
            intermediate_size=40,
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=5,
            **AUX,
        ),
        "deepseek_v2": lambda: t.DeepseekV2Config(
            **{**BASE, "num_key_value_heads": 6},
            n_routed_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            n_shared_experts=2,
            first_k_dense_replace=1,
            n_group=3,
            topk_group=2,
            **latent,
        ),  # fmt: skip
    }[family]()


for fam in sys.argv[1:]:
    tmp = pathlib.Path(tempfile.mkdtemp())
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config(fam)).save_pretrained(tmp / "m")
    results = []
    for acts in ("recompute", "offload"):
        kw = dict(activations="offload") if acts == "offload" else {}
        cfg = small_config(tmp / acts, kind="llama", micro_batches=3, steps=4, clip=0.3, **kw)
        cfg.model.hf_dir, cfg.data.seq_len = str(tmp / "m"), 48
        tr, losses = assert_parity(cfg)
        results.append(f"{acts} bit-identical (step-1 loss {sum(losses[0]) / 3:.4f})")
    hf = AutoModelForCausalLM.from_pretrained(tmp / "m", attn_implementation=KNOWN[fam].attention).eval()
    hf.config.output_router_logits = False  # transformers' generate fails with it; not part of generating
    prompts = [list(range(10, 41)), list(range(50, 59)), list(range(70, 87))]
    g = small_config(tmp / "g", kind="llama")
    g.model.hf_dir, g.data.micro_batch_size = str(tmp / "m"), 2
    gen_ok = generate(g, prompts, Sampling(max_new_tokens=12), eos=()) == _hf_generate(hf, prompts, 12)
    aux = "auxiliary loss on" if tr.model.routers is not None else "no auxiliary loss in its forward"
    print(f"{fam} ({aux}): {'; '.join(results)}; generation {'token-equal' if gen_ok else 'DIFFERS'}", flush=True)
    assert gen_ok
