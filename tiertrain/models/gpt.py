"""The built-in GPT: a small, clean decoder-only transformer for the default job.

Pre-norm blocks (LayerNorm, causal self-attention through PyTorch's SDPA, GELU MLP),
learned positions, untied head by default. Weights are initialised per unit from a
generator seeded by (seed, unit), so initialisation never needs the whole model.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import LayeredModel, default_positions, document_mask, no_cache

__all__ = ["GPTEmbed", "GPTBlock", "GPTHead", "build_gpt"]


class GPTEmbed(nn.Module):
    TOKENS = "wte"

    def __init__(self, vocab: int, d: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.finish(self.wte(idx), positions)

    def finish(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        pos = default_positions(tokens) if positions is None else positions
        return self.drop(tokens + self.wpe(pos))

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Generation: ``[B, T]`` ids at per-row ``position_ids`` (``[B, T]``)."""
        return self.drop(self.wte(input_ids) + self.wpe(position_ids))


class GPTBlock(nn.Module):
    def __init__(self, d: int, n_heads: int, d_ff: int, dropout: float, index: int = 0) -> None:
        super().__init__()
        self.n_heads, self.dropout, self.index = n_heads, dropout, index  # index: its layer of a decoding cache
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d_ff)
        self.out = nn.Linear(d_ff, d)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        no_cache(cache)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        if positions is not None and positions.dim() == 2:  # packed rows: attention within each document
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions), dropout_p=drop)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.resid_drop(self.out(F.gelu(self.fc(self.ln2(x)))))

    def decode(self, x: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """Generation: the new positions ``x`` (``[B, T, d]``) write their keys and values into
        ``cache.layers[index]`` after the ones there and attend to all of them under ``mask``
        (``gpt_decode.decode_mask``)."""
        layer = cache.layers[self.index]
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        past = layer.cumulative_length  # a host int (gpt_decode.GPTCache): no device sync
        layer.keys[:, :, past : past + t], layer.values[:, :, past : past + t] = k, v
        layer.cumulative_length += t
        y = F.scaled_dot_product_attention(
            q, layer.keys[:, :, : past + t], layer.values[:, :, : past + t], attn_mask=mask
        )
        x = x + self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.resid_drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPTHead(nn.Module):
    PROJ = "lm_head"

    def __init__(self, d: int, vocab: int, tied: nn.Embedding | None) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied is not None:
            self.lm_head.weight = tied.weight

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_f(h)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the model does to its projection's logits: nothing (see ``models/base.py``)."""
        return logits

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(h))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, divisor: int | None = None) -> torch.Tensor:
        """Mean cross-entropy over the targets (ignore index -100 left out); with ``divisor``,
        their sum over it (a step's scored tokens: ``data/examples.py``)."""
        flat = logits.float().view(-1, logits.shape[-1])
        if divisor is None:
            return F.cross_entropy(flat, targets.reshape(-1))
        return F.cross_entropy(flat, targets.reshape(-1), reduction="sum") / divisor

    def forward(self, h: torch.Tensor, targets: torch.Tensor, divisor: int | None = None) -> torch.Tensor:
        return self.loss(self.logits(h), targets, divisor)


def _init_unit(n_layers: int, std: float):
    def init(unit_index: int, unit: nn.Module, gen: torch.Generator) -> None:
        resid_std = std / math.sqrt(2 * n_layers)  # GPT-2: scale residual projections by depth
        for name, p in unit.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in f".{name}" and name.endswith("weight"):
                nn.init.ones_(p)
            elif name.endswith(("proj.weight", "out.weight")) and not name.startswith("lm_head"):
                nn.init.normal_(p, 0.0, resid_std, generator=gen)
            else:
                nn.init.normal_(p, 0.0, std, generator=gen)

    return init


def build_gpt(
    *,
    vocab_size: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    d_ff: int | None,
    max_seq_len: int,
    dropout: float = 0.0,
    tie_embeddings: bool = False,
    init_std: float = 0.02,
) -> LayeredModel:
    """The built-in GPT, on whatever device/placeholder context the caller sets up."""
    embed = GPTEmbed(vocab_size, d_model, max_seq_len, dropout)
    blocks = [GPTBlock(d_model, n_heads, d_ff or 4 * d_model, dropout, i) for i in range(n_layers)]
    head = GPTHead(d_model, vocab_size, embed.wte if tie_embeddings else None)
    model = LayeredModel(embed, blocks, head, kind="gpt")
    model.init_unit = _init_unit(n_layers, init_std)
    return model
