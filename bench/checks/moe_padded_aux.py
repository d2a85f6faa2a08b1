"""Outside check (python bench/checks/moe_padded_aux.py): padded rows' pads left out of the auxiliary loss on Qwen2-MoE and Qwen3-MoE,
shapes the tests do not use; tiertrain's step-1 losses against transformers' forward given a
padding collator's attention_mask, and against the forward without it."""

import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import torch  # noqa: E402
import transformers as t  # noqa: E402
from reference import reference_model, weights_of  # noqa: E402
from test_finetune_data import _finetune_cfg, _finetune_data  # noqa: E402
from test_parity import run_tiertrain  # noqa: E402

from tiertrain.data import open_corpus  # noqa: E402

tmp = pathlib.Path(tempfile.mkdtemp())
os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")
tok, _, chat = _finetune_data(tmp)
# what both models share: a small vocabulary, the auxiliary loss on
shared = dict(vocab_size=64, output_router_logits=True, router_aux_loss_coef=0.25, max_position_embeddings=64)
confs = {
    "qwen2_moe 3x80": t.Qwen2MoeConfig(
        **shared,
        hidden_size=80,
        intermediate_size=96,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=56,
        num_hidden_layers=3,
        num_attention_heads=5,
        num_key_value_heads=1,
        num_experts=6,
        num_experts_per_tok=2,
    ),
    "qwen3_moe 5x48": t.Qwen3MoeConfig(
        **shared,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        num_experts=5,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}
for name, c in confs.items():
    torch.manual_seed(0)
    d = tmp / name.split()[0]
    t.AutoModelForCausalLM.from_config(c).save_pretrained(d)
    cfg = _finetune_cfg(tmp / ("r" + name.split()[0]), chat, tok, kind="llama", micro_batches=2, micro_batch_size=2)
    cfg.model.hf_dir, cfg.data.packing, cfg.train.steps, cfg.data.seq_len = str(d), False, 1, 32
    cfg.model.vocab_size = 64
    corpus = open_corpus(cfg.data)
    (x, y), mask = corpus.batches(0)[0], corpus.attention(0)[0]
    hf = t.AutoModelForCausalLM.from_pretrained(d)
    losses, _, _ = run_tiertrain(cfg, weights_of(reference_model(cfg)))
    scored = corpus.scored(0)
    with torch.no_grad():
        masked = float(hf(input_ids=x, attention_mask=mask, labels=y, shift_labels=y, num_items_in_batch=scored).loss)
        plain = float(hf(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=scored).loss)
    ours = losses[0][0]
    print(
        f"{name}: pads in the micro-batch {int((~mask).sum())}; tiertrain {ours:.8f}; transformers masked {masked:.8f} "
        f"(rel {abs(ours - masked) / masked:.1e}); unmasked {plain:.8f} (rel {abs(ours - plain) / plain:.1e})"
    )
