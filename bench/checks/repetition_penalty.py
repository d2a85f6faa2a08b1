"""Outside check (python bench/checks/repetition_penalty.py): generation_config.json's
repetition_penalty applied as transformers' generate applies it, on families and a shape the test
does not use (the test: a 2 x 64 Llama): Qwen2 and Gemma 2, 3 layers of 80, three prompts of
different lengths in micro-batches of 2 (left padding), penalties 1.05 (Qwen2.5 Instruct's) and
1.6, the key/value cache in memory and spilled to the storage tier: tiertrain's greedy tokens
against transformers' generate on the saved directory."""

import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import torch  # noqa: E402
import transformers as t  # noqa: E402
from test_generate import _cfg, _hf_generate  # noqa: E402

from tiertrain.inference.generate import Sampling, generate  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=80, intermediate_size=144, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
CONFIGS = {
    "qwen2": lambda: t.Qwen2Config(**SHAPE),
    "gemma2": lambda: t.Gemma2Config(**SHAPE, head_dim=20, sliding_window=8),
}
PROMPTS = [list(range(30, 51)), list(range(7, 12)), [9, 9, 9, 4, 9, 9, 9, 4, 9]]

print("| family | repetition_penalty | cache | tokens = transformers' | tokens differ from no penalty |")
print("|---|---|---|---|---|")
for fam, make in CONFIGS.items():
    tmp = pathlib.Path(tempfile.mkdtemp())
    torch.manual_seed(4)
    t.AutoModelForCausalLM.from_config(make()).save_pretrained(tmp / "m")
    for penalty in (1.05, 1.6):
        (tmp / "m" / "generation_config.json").write_text(json.dumps({"repetition_penalty": penalty}))
        hf = t.AutoModelForCausalLM.from_pretrained(tmp / "m").eval()
        want = _hf_generate(hf, PROMPTS, 16)
        hf.generation_config.repetition_penalty = 1.0
        plain = _hf_generate(hf, PROMPTS, 16)
        for cache in ("memory", "spilled"):
            cfg = _cfg(tmp / f"{penalty}-{cache}", str(tmp / "m"))
            cfg.data.seq_len = 64
            if cache == "spilled":
                cfg.memory.kv_host_mib = 0
            got = generate(cfg, PROMPTS, Sampling(max_new_tokens=16), eos=())
            print(f"| {fam} | {penalty} | {cache} | {got == want} | {want != plain} |")
