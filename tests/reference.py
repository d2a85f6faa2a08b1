"""Plain PyTorch training: the reference that tiertrain's numerics are measured against."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tiertrain.config import Config, DataConfig, IOConfig, MemoryConfig, ModelConfig, OptimConfig, TrainConfig
from tiertrain.data import Corpus
from tiertrain.models import hf_config_from
from tiertrain.models.gpt import build_gpt
from tiertrain.update.schedule import lr_at


def small_config(tmp_path, *, kind="gpt", layers=3, d=64, heads=4, micro_batches=1, steps=4, clip=1.0,
                 tie=False, dtype="float32", host_param_mib=0, grad_host_mib=0, stash_host_mib=0,
                 paths=1, update_kib=64, slots=3, lr=2e-3, keep_act_mib=0, **io) -> Config:
    """A tiny model whose every state is on the storage tier, with small update chunks so
    that chunks cut through parameters and units. Blocks are recomputed in the backward
    unless ``keep_act_mib`` is given (tests of kept graphs)."""
    return Config(
        io=IOConfig(paths=[str(tmp_path / f"ssd{i}") for i in range(paths)], stripe_kib=64, chunk_kib=256,
                    checksum_block_kib=64, **io),
        model=ModelConfig(kind=kind, n_layers=layers, d_model=d, n_heads=heads, vocab_size=256, max_seq_len=64,
                          tie_embeddings=tie),
        data=DataConfig(seq_len=32, micro_batch_size=2, micro_batches=micro_batches),
        optim=OptimConfig(lr=lr, grad_clip=clip, warmup_steps=2, weight_decay=0.1),
        memory=MemoryConfig(device_slots=slots, host_param_mib=host_param_mib, grad_host_mib=grad_host_mib,
                            stash_host_mib=stash_host_mib, update_buffer_kib=update_kib, keep_act_mib=keep_act_mib),
        train=TrainConfig(steps=steps, param_dtype=dtype, run_dir=str(tmp_path / "run"), progress=False, device="cpu"),
    )


class HFWrapper(nn.Module):
    """An HF causal LM called the way tiertrain's head computes the loss."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x, y):
        return self.hf(input_ids=x, labels=y, shift_labels=y).loss


def reference_model(cfg: Config, seed: int = 0) -> nn.Module:
    """A real (in-memory) model of the configured kind, with PyTorch's/HF's own init."""
    torch.manual_seed(seed)
    m = cfg.model
    if m.kind == "gpt":
        return build_gpt(vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                         d_ff=m.d_ff, max_seq_len=m.max_seq_len, tie_embeddings=m.tie_embeddings)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_config_from(m))
    return HFWrapper(hf)


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Initial weights to hand to tiertrain: our names for the built-in GPT, HF names otherwise."""
    inner = model.hf if isinstance(model, HFWrapper) else model
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def reference_train(cfg: Config, model: nn.Module, *, mixed: bool = False):
    """Train ``model`` plainly: micro-batch-major accumulation, clip_grad_norm_, fused AdamW.

    ``mixed``: bf16 model with fp32 master weights (the reference for bf16 runs).
    Returns (per-micro-batch losses per step, final fp32 weights by name).
    """
    corpus = Corpus(cfg.data)
    o, M = cfg.optim, cfg.data.micro_batches
    model = copy.deepcopy(model)
    if mixed:
        master = [p.detach().clone().float() for p in model.parameters()]
        model.to(torch.bfloat16)
        opt_params = [nn.Parameter(w) for w in master]
    else:
        opt_params = list(model.parameters())
    if o.name == "sgd":
        opt = torch.optim.SGD(opt_params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, fused=True)
    else:
        opt = torch.optim.AdamW(opt_params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                weight_decay=o.weight_decay, fused=True)
    losses = []
    for step in range(cfg.train.steps):
        step_losses = []
        for x, y in corpus.batches(step):
            loss = model(x, y)
            (loss / M).backward()
            step_losses.append(loss.item())
        losses.append(step_losses)
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        if mixed:
            for p, w in zip(model.parameters(), opt_params):
                w.grad = p.grad.float()
        for g in opt.param_groups:
            g["lr"] = lr_at(step + 1, o, cfg.train.steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if mixed:
            with torch.no_grad():
                for p, w in zip(model.parameters(), opt_params):
                    p.copy_(w)
    inner = model.hf if isinstance(model, HFWrapper) else model
    if mixed:
        names = [n for n, _ in inner.named_parameters()]
        return losses, {n: w.detach() for n, w in zip(names, opt_params)}
    return losses, {k: v.detach().float() for k, v in inner.state_dict().items()}


def tiny_flags(tmp_path, *extra: str, steps: int = 2, layers: int = 2) -> list[str]:
    """``tiertrain train`` flags of a run that takes about a second: scratch and run directory
    under ``tmp_path``, small chunks so that checksums and chunking are exercised."""
    return [f"--io.paths={tmp_path / 'ssd'}", f"--train.run_dir={tmp_path / 'run'}", f"--model.n_layers={layers}",
            "--model.d_model=64", "--data.seq_len=32", "--data.micro_batch_size=2", "--data.micro_batches=2",
            f"--train.steps={steps}", "--train.progress=false", "--io.chunk_kib=256", "--io.checksum_block_kib=64",
            "--io.stripe_kib=64", "--memory.update_buffer_kib=64", *extra]
