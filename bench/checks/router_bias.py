"""Outside check (python bench/checks/router_bias.py): a router's correction bias (a persistent
buffer) read from the model directory, on dots.llm1 and GLM-4-MoE-Lite (the test uses DeepSeek-V3
and GLM-4.5), a larger bias (2 x N(0, 1)), another seed and other prompts: tiertrain's eval loss
against transformers' forward, its greedy tokens against transformers' generate."""

import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import torch  # noqa: E402
import transformers as t  # noqa: E402
from test_generate import _hf_generate  # noqa: E402
from test_moe import _config, _moe_config  # noqa: E402

from tiertrain.data import EvalSet  # noqa: E402
from tiertrain.inference.evaluate import evaluate  # noqa: E402
from tiertrain.inference.generate import Sampling, generate  # noqa: E402

for fam in ("dots1", "glm4_moe_lite"):
    tmp = pathlib.Path(tempfile.mkdtemp())
    torch.manual_seed(1)
    hf = t.AutoModelForCausalLM.from_config(_config(fam))
    biases = [b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    g = torch.Generator().manual_seed(3)
    for b in biases:
        b.copy_(torch.randn(b.shape, generator=g) * 2)
    hf.save_pretrained(tmp / "m")
    loaded = t.AutoModelForCausalLM.from_pretrained(tmp / "m").eval()
    cfg = _moe_config(tmp, str(tmp / "m"))
    text = tmp / "held_out.txt"
    text.write_text("".join(f"{i} other held-out words {i * 3 % 7}.\n" for i in range(30)))
    cfg.data.eval_corpus, cfg.data.eval_micro_batches = str(text), 0
    with torch.no_grad():
        want = [float(loaded(input_ids=x, labels=y, shift_labels=y).loss) for x, y in EvalSet(cfg.data).micro_batches()]
    got = evaluate(cfg).loss
    prompts = [list(range(5, 22)), list(range(60, 69))]
    cfg.data.micro_batch_size = 2
    same = generate(cfg, prompts, Sampling(max_new_tokens=8), eos=()) == _hf_generate(loaded, prompts, 8)
    print(
        f"| {fam} | {len(biases)} | {got:.9f} | {sum(want) / len(want):.9f} | {got == sum(want) / len(want)} | {same} |"
    )
