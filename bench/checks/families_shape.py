"""The families' checks on a shape the tests do not use: 3 layers, hidden 96, 6 heads (3 kv),
head_dim 16, intermediate 160, window 5, seq 48, 3 micro-batches, 4 steps, clip 0.3."""

import os
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import test_families as tf
from reference import small_config
from test_generate import _hf_generate
from test_lora import assert_lora_parity
from test_parity import assert_parity
from transformers import AutoModelForCausalLM

from tiertrain.inference.generate import Sampling, generate
from tiertrain.models.families import FAMILIES as KNOWN

tf.WINDOW = 5
tf.COMMON.update(
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=3,
    max_position_embeddings=96,
)


def cfg_for(family):
    if family == "gemma3_text":
        import transformers as t

        return t.Gemma3TextConfig(
            **tf.COMMON,
            sliding_window=tf.WINDOW,
            head_dim=16,
            final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    c = tf._config(family)
    if hasattr(c, "head_dim"):
        c.head_dim = 16
    if family == "gemma3_text":
        c.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    if family == "qwen2" or family == "qwen3":
        c.max_window_layers = 1
        c.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    return c


for fam in sys.argv[1:]:
    tmp = pathlib.Path(tempfile.mkdtemp())
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg_for(fam)).save_pretrained(tmp / "m")
    cfg = small_config(tmp / "a", kind="llama", micro_batches=3, steps=4, clip=0.3)
    cfg.model.hf_dir = str(tmp / "m")
    cfg.data.seq_len = 48
    tr, losses = assert_parity(cfg)
    kinds = sorted({b.kind for b in tr.model.blocks})
    hf = AutoModelForCausalLM.from_pretrained(tmp / "m", attn_implementation=KNOWN[fam].attention).eval()
    prompts = [list(range(10, 41)), list(range(50, 59)), list(range(70, 87))]
    g = small_config(tmp / "g", kind="llama")
    g.model.hf_dir = str(tmp / "m")
    g.data.micro_batch_size = 2
    gen_ok = generate(g, prompts, Sampling(max_new_tokens=12), eos=()) == _hf_generate(hf, prompts, 12)
    lc = small_config(tmp / "l", kind="llama", micro_batches=3, steps=3, clip=0.05)
    lc.model.hf_dir = str(tmp / "m")
    lc.data.seq_len = 48
    lin = {n.rsplit(".", 1)[-1] for n, m in hf.model.layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    lc.adapter.kind, lc.adapter.rank, lc.adapter.alpha, lc.adapter.target = "lora", 8, 16.0, sorted(lin)
    lc.update.mode = "auto"
    assert_lora_parity(lc)
    print(
        f"{fam}: training bit-identical over 4 steps (loss step 1 {sum(losses[0]) / 3:.4f}), kinds {kinds}; "
        f"generation {'token-equal' if gen_ok else 'DIFFERS'}; LoRA bit-identical",
        flush=True,
    )
    assert gen_ok
