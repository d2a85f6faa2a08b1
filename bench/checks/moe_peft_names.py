"""Outside check (python bench/checks/moe_peft_names.py): the experts' old names in adapter.target
read as peft reads them, on families and a shape the tests do not use (the tests: Qwen3-MoE and
Mixtral, 2 layers of 64). DeepSeek-V3 (latent attention, a shared expert and a dense first layer
whose MLPs carry the names), OLMoE and GLM-4-MoE, 3 layers of 96, 6 experts, top-2: tiertrain's
LoRA with the usual recipe's names trained 3 steps with clipping against peft on plain PyTorch
(losses and every adapter bit for bit), and its export loaded by PeftModel.from_pretrained
against tiertrain's logits; then the every-linear default (trained, exported, loaded in peft)."""

import copy
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import peft  # noqa: E402
import torch  # noqa: E402
import transformers as t  # noqa: E402
from test_lora import _layered, assert_lora_parity  # noqa: E402
from test_moe_lora import _lora  # noqa: E402

from tiertrain.adapters import LoRA  # noqa: E402
from tiertrain.adapters.peft_io import export_peft  # noqa: E402
from tiertrain.training.trainer import Trainer  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=6, max_position_embeddings=256)  # fmt: skip
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=40)
CONFIGS = {
    "deepseek_v3": lambda: t.DeepseekV3Config(
        **SHAPE,
        **MOE,
        n_routed_experts=6,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        kv_lora_rank=24,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    ),  # fmt: skip
    "olmoe": lambda: t.OlmoeConfig(**{**SHAPE, "num_key_value_heads": 2}, num_experts=6, num_experts_per_tok=2),
    "glm4_moe": lambda: t.Glm4MoeConfig(
        **SHAPE,
        **MOE,
        n_routed_experts=6,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        head_dim=16,
    ),  # fmt: skip
}
ATTENTION = {
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "olmoe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "glm4_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}

print(
    "| family | target | adapted layers | expert stacks (rank) | losses and adapters = peft | export's logits in peft |"
)
print("|---|---|---|---|---|---|")
for fam, make in CONFIGS.items():
    tmp = pathlib.Path(tempfile.mkdtemp())
    torch.manual_seed(2)
    t.AutoModelForCausalLM.from_config(make()).save_pretrained(tmp / "m")
    for label, names in (("recipe", ATTENTION[fam] + ["gate_proj", "up_proj", "down_proj"]), ("default", [])):
        run = tmp / label
        cfg = _lora(run, str(tmp / "m"), target=tuple(names), params=())
        if names:
            tr = assert_lora_parity(cfg)  # raises where a loss or an adapter differs from peft's
        else:  # (peft's all-linear adapts the experts and the router here: no peft run to compare with)
            with Trainer(cfg) as tr:
                tr.initialize(progress=False)
                for _ in range(cfg.train.steps):
                    tr.train_step()
        lora = tr.rt.adapters
        stacks = ", ".join(f"{t_.param} ({lora.names.rank(t_.param, cfg.adapter.rank)})" for t_ in lora.targets
                           if t_.param is not None) or "none"  # fmt: skip
        trained = {n: p.detach().clone() for n, p in lora.named()}
        base = t.AutoModelForCausalLM.from_pretrained(tmp / "m").eval()
        ours_model = _layered(cfg, base)
        ours = LoRA(ours_model, cfg.adapter, seed=0, device="cpu")
        ours.load_named(trained)
        export_peft(ours_model, ours, str(run / "adapter"))
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(run / "adapter")).eval()
        x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            same = torch.equal(loaded(input_ids=x).logits, ours_model.hf_model(input_ids=x).logits)
        layers = sum(t_.param is None for t_ in lora.targets)
        parity = "True" if names else "(no peft run)"
        print(f"| {fam} | {label} | {layers} ({', '.join(lora.kinds)}) | {stacks} | {parity} | {same} |")
