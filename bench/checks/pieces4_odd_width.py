"""Outside check (python bench/checks/pieces4_odd_width.py): layers cut into four pieces at MLP
widths no multiple of the vector length, on transformers families made by save_pretrained (the
test uses the built-in Llama at 200 and 65): Qwen3 (width 200, 3 layers of 72) and Gemma (GELU-tanh
gate, width 130, 2 layers of 96), 3 fp32 steps with clipping, 2 micro-batches, against plain
PyTorch + AdamW: equal losses, and every weight bit for bit."""

import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import torch  # noqa: E402
import transformers as t  # noqa: E402
from reference import reference_model, reference_train, small_config, weights_of  # noqa: E402
from test_parity import ref_name_map, run_tiertrain  # noqa: E402

shapes = {
    "qwen3 3x72 ff200": t.Qwen3Config(vocab_size=256, hidden_size=72, intermediate_size=200, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=18,
                                      max_position_embeddings=64, tie_word_embeddings=False),
    "gemma 2x96 ff130": t.GemmaConfig(vocab_size=256, hidden_size=96, intermediate_size=130, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                      max_position_embeddings=64),
}  # fmt: skip
for name, conf in shapes.items():
    tmp = pathlib.Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    t.AutoModelForCausalLM.from_config(conf).save_pretrained(tmp / "m")
    cfg = small_config(tmp, kind="llama", micro_batches=2, steps=3, clip=0.5)
    cfg.model.hf_dir, cfg.model.layer_pieces = str(tmp / "m"), 4
    ref = reference_model(cfg)
    ref_losses, ref_weights = reference_train(cfg, ref)
    losses, weights, tr = run_tiertrain(cfg, weights_of(ref))
    names = ref_name_map(tr, weights)
    differ = [n for n in weights if not torch.equal(weights[n], ref_weights[names[n]])]
    print(
        f"| {name} | {len(tr.model.blocks)} | {losses == ref_losses} | {len(weights) - len(differ)} of {len(weights)} |"
    )
