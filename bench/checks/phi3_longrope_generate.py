"""Outside check (python bench/checks/phi3_longrope_generate.py): Phi-3 with longrope, where
generation passes original_max_position_embeddings, on shapes the test does not use (3 layers of
96, head dim 24, original 24 of 96 positions), prompts of 23, 24, 10 and 30 tokens (just under,
at, well under and already past the switch), one a micro-batch: each against transformers'
generate of that prompt alone; the key/value cache in host memory and on the storage tier."""

import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import torch  # noqa: E402
import transformers as t  # noqa: E402
from test_families import _family_config  # noqa: E402
from test_generate import _hf_generate  # noqa: E402

from tiertrain.inference.generate import Sampling, generate  # noqa: E402

tmp = pathlib.Path(tempfile.mkdtemp())
rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
        "short_factor": [1.0 + 0.05 * i for i in range(12)], "long_factor": [1.5 + 0.4 * i for i in range(12)]}  # fmt: skip
config = t.Phi3Config(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=96, original_max_position_embeddings=24,
                      rope_parameters=rope, initializer_range=0.08, tie_word_embeddings=False, pad_token_id=0,
                      bos_token_id=0, eos_token_id=1)  # fmt: skip
torch.manual_seed(5)
t.AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "m")
hf = t.AutoModelForCausalLM.from_pretrained(tmp / "m").eval()
prompts = [list(range(30, 53)), list(range(100, 124)), list(range(7, 17)), list(range(200, 230))]
want = [_hf_generate(hf, [p], 16)[0] for p in prompts]
cfg = _family_config(tmp, str(tmp / "m"))
cfg.data.micro_batch_size, cfg.data.seq_len = 1, 64
memory = generate(cfg, prompts, Sampling(max_new_tokens=16), eos=())
cfg.memory.kv_host_mib, cfg.memory.host_param_mib = 0, 0
spilled = generate(cfg, prompts, Sampling(max_new_tokens=16), eos=())
for p, w, a, b in zip(prompts, want, memory, spilled):
    print(f"| {len(p)} | {a == w} | {b == w} | {sum(x != y for x, y in zip(a, w))} |")
