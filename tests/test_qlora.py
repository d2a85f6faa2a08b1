"""QLoRA on a streamed 4-bit base (``model.base_dtype = 'nf4' | 'fp4'``): the same losses and
adapter weights as peft's LoRA on transformers' bitsandbytes-quantized model
(``BitsAndBytesConfig(load_in_4bit=True)``, as users load it) on plain PyTorch + AdamW, bit for
bit in fp32 on CPU; the base stored quantized, read in its quantized bytes (the cost model's
too), never written; checkpoints resumed, exported and evaluated."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import reference_model, reference_train, weights_of
from test_lora import _layered, _peft_names, _train, lora_config
from test_parity import run_tiertrain

from tiertrain.adapters import LoRA
from tiertrain.reference import HFWrapper

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


def quantized_reference(cfg, plain, tmp_path, kind="nf4", double=False):
    """transformers' model of ``plain``'s weights loaded as users load QLoRA's base, with peft's
    LoRA injected and set to the adapters tiertrain starts from; (model, peft's names)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    where = tmp_path / "hf-plain"
    plain.hf.save_pretrained(where)
    qc = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip
    q = AutoModelForCausalLM.from_pretrained(where, quantization_config=qc, dtype=torch.float32, device_map="cpu")
    q.config.use_cache = False
    # trained as users train it (from_pretrained gives eval mode, where bitsandbytes repacks a
    # weight for its bf16 CPU kernel whenever the input needs no gradient: not the training path)
    q.train()
    layered = _layered(cfg, plain.hf)
    ours = LoRA(layered, cfg.adapter, seed=cfg.train.seed, device="cpu")
    a = cfg.adapter
    pc = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=list(a.target))
    inner = peft.inject_adapter_in_model(pc, q)
    names = _peft_names(layered, ours)
    state = dict(inner.named_parameters())
    with torch.no_grad():
        for name, p in ours.named():
            state[names[name]].copy_(p)
    return HFWrapper(inner), names


def qlora_config(tmp_path, kind="nf4", double=False, **kw):
    cfg = lora_config(tmp_path, "llama", **kw)
    cfg.model.base_dtype, cfg.model.base_double_quant = kind, double
    return cfg


@pytest.mark.parametrize(
    "kind,double,host_param_mib",
    [("nf4", False, 0), ("nf4", True, 64), ("fp4", False, 64), ("fp4", True, 0)],
)
def test_qlora_trains_as_peft_on_a_bitsandbytes_base(tmp_path, kind, double, host_param_mib):
    cfg = qlora_config(tmp_path, kind, double, host_param_mib=host_param_mib, steps=3)
    plain = reference_model(cfg)
    init = weights_of(plain)
    ref, names = quantized_reference(cfg, plain, tmp_path, kind, double)
    ref_losses, ref_weights = reference_train(cfg, ref)
    losses, _, tr = run_tiertrain(cfg, init)
    assert losses == ref_losses
    adapters = dict(tr.rt.adapters.named())
    assert len(adapters) == 2 * len(tr.rt.adapters.targets) > 0
    for name, p in adapters.items():
        assert torch.equal(p.detach(), ref_weights[names[name]]), name
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in adapters.items()), "the adapters did not train"
