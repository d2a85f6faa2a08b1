"""Model adapters: units, ties, and fidelity to the models' own forward."""

import pytest
import torch

from tiertrain.config import ModelConfig
from tiertrain.models import build_model, random_source, unit_param_names


def bind_random(model, seed=0):
    src = random_source(model, seed)
    for u, own in enumerate(unit_param_names(model)):
        vals = src.load(u, [n for n, _ in own])
        for n, p in own:
            p.data = vals[n].clone()


@pytest.mark.parametrize("kind,tie", [("gpt", False), ("gpt", True), ("llama", False), ("llama", True), ("gpt2", True)])
def test_ties_survive_the_skeleton(kind, tie):
    cfg = ModelConfig(kind=kind, n_layers=2, d_model=32, n_heads=2, vocab_size=64, max_seq_len=16, tie_embeddings=tie)
    model, _ = build_model(cfg, param_dtype=torch.float32, seed=0)
    owned = unit_param_names(model)
    head_owns = [n for n, _ in owned[-1]]
    assert any("lm_head" in n for n in head_owns) != tie
    assert model.n_units == 4 and len(owned) == 4
    # placeholders cost nothing until bound
    assert all(p.untyped_storage().nbytes() <= 4 for _, p in model.named_parameters())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_units_compute_what_the_hf_model_computes(kind):
    cfg = ModelConfig(kind=kind, n_layers=2, d_model=64, n_heads=4, vocab_size=256, max_seq_len=32)
    model, _ = build_model(cfg, param_dtype=torch.float32, seed=0)
    bind_random(model)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    ours = model(x, y)
    theirs = model.hf_model(input_ids=x, labels=y, shift_labels=y).loss
    assert torch.equal(ours, theirs)


def test_gemma_from_its_directory_computes_what_transformers_computes(tmp_path):
    """Gemma's layout is Llama's; its embeddings are scaled by sqrt(d_model) within its embedding
    module, which the embedding unit calls: the loss is transformers' to the bit (it was refused
    for a while as a family that scales them outside)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    from tiertrain.config import Config

    torch.manual_seed(0)
    hf = GemmaForCausalLM(
        GemmaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    )  # fmt: skip
    hf.save_pretrained(tmp_path)
    cfg = Config.from_dict({"model": {"hf_dir": str(tmp_path)}, "data": {"seq_len": 32}})
    model, source = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    model.hf_model.load_state_dict(hf.state_dict(), strict=False, assign=True)
    hf.config._attn_implementation = "sdpa"  # as the units run it
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    assert torch.equal(model(x, y), hf(input_ids=x, labels=y, shift_labels=y).loss)


def test_random_init_is_per_unit_and_seeded():
    cfg = ModelConfig(n_layers=3, d_model=32, n_heads=2, vocab_size=64, max_seq_len=16)
    model, _ = build_model(cfg, param_dtype=torch.float32, seed=0)
    names = [[n for n, _ in own] for own in unit_param_names(model)]
    a = random_source(model, 1).load(2, names[2])
    b = random_source(model, 1).load(2, names[2])
    c = random_source(model, 2).load(2, names[2])
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)
    std = a["blocks.1.qkv.weight"].std().item()
    assert 0.015 < std < 0.025  # init_std 0.02


@pytest.mark.slow
def test_a_fresh_process_builds_the_skeleton_without_dynamo_and_transformers_still_initialises():
    """The built-in skeleton skips the modules' default initialisation (on meta it imported
    torch._dynamo: seconds of every process's start); torch's initialisers are back afterwards,
    for transformers too, imported later in the same process (it keeps the ones it finds)."""
    import subprocess
    import sys

    code = """
import sys, torch
from tiertrain.config import ModelConfig
from tiertrain.models import build_model
build_model(ModelConfig(kind="gpt", n_layers=2, d_model=32, n_heads=2, vocab_size=100), param_dtype=torch.float32, seed=0)
assert "torch._dynamo" not in sys.modules, "dynamo imported"
from tiertrain.models import unit_param_names
for kind in ("llama", "gpt2"):
    model, source = build_model(
        ModelConfig(kind=kind, n_layers=1, d_model=32, n_heads=2, vocab_size=100), param_dtype=torch.float32, seed=0
    )
    names = [n for n, _ in unit_param_names(model)[1] if n.endswith("weight")]
    values = source.load(1, names)  # the block, initialised as transformers does
    assert all(0.01 < values[n].std().item() < 0.03 for n in names if values[n].dim() == 2), kind
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
