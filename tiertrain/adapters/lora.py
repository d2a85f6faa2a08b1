"""LoRA on a streamed, frozen base: peft's math, the adapters resident beside the units.

The base model's units stay on their tier and are streamed as always, but frozen (no gradient,
no optimizer step, never written). The adapters are small: they live on the compute device as
ordinary parameters, outside the units, and reach the blocks through forward hooks on the
targeted linear layers. A hook adds what peft's ``lora.Linear`` adds to its base layer's output,
in the same order of operations, so a run is bit for bit peft's on plain PyTorch in fp32:

    out = (base(x) + lora_B(lora_A(dropout(x.to(fp32)))) * (alpha / r)).to(base(x).dtype)

``lora_A`` is initialised Kaiming-uniform (a = sqrt(5)) and ``lora_B`` to zero, as peft does,
from a generator seeded by the run's seed (so step 1's loss is the base model's). Autograd
accumulates the adapters' gradients over the micro-batches in the layer-major backward in the
same order as plain PyTorch's micro-batch-major one (for each adapter, micro-batch 0 first), and
the recomputed forward of a block calls the same hooks.

A mixture of experts' 3-D expert parameters (``adapter.target_parameters``: transformers'
``mlp.experts.gate_up_proj``, ``[experts, out, in]``, or ``[experts, in, out]`` where the module
says ``is_transposed``) get what peft's ``ParamWrapper`` gives them: one ``lora_A`` of
``(r x experts) x in`` and one ``lora_B`` of ``out x (r x experts)`` per parameter, and for the
experts' forward the weight ``baddbmm(W, lhs, rhs, alpha=scaling)`` in place of ``W`` (``lhs``,
``rhs``: peft's per-expert views of B and A, ``expert_factors``). peft swaps it in with a torch
parametrization, which would move the parameter away from the one the parameter store binds
to slot memory; here a forward pre-hook on the experts module puts the new weight in the
module's parameter table for that call and a forward hook (run even on an error) puts the
frozen Parameter back. The graph is peft's: the base enters the ``baddbmm`` without a
gradient, B and A get theirs through it, and a recomputed forward calls the same hooks.

Adapters are keyed by the full name of the module they sit on (``blocks.3.self_attn.q_proj``),
or of the parameter (``blocks.3.mlp.experts.down_proj``); peft's names for export are made in
``adapters/peft_io.py``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..config import AdapterConfig, ConfigError
from ..config.peft_names import resolve
from ..models.base import LayeredModel
from ..training.metrics import AdapterFlops

__all__ = ["LoRA", "Target", "find_targets", "linear_shape", "expert_factors", "expert_delta"]

log = logging.getLogger("tiertrain")
SEED_SALT = 0x10_4A  # the adapters' generator: the run's seed + this (not the base's unit streams)


@dataclass(frozen=True)
class Target:
    """A linear layer that gets an adapter: ``name`` (full, as in the model's state dict
    without ``.weight``), ``module``, and its ``in_features`` / ``out_features``. Or, with
    ``param`` set, the 3-D parameter ``param`` of ``module`` (``name``: the parameter's full
    name), one matrix per expert of ``experts``, stored ``[experts, in, out]`` if
    ``transposed`` else ``[experts, out, in]``."""

    name: str
    module: nn.Module
    in_features: int
    out_features: int
    param: str | None = None
    experts: int = 1
    transposed: bool = False


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear layer (``nn.Linear``, or transformers' ``Conv1D`` whose weight
    is stored transposed); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    w = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor):
        n_in, n_out = w.shape
        return int(n_in), int(n_out)
    return None


def find_targets(
    model: LayeredModel, names: list[str], parameters: list[str] | None = None, *, leave: tuple[str, ...] = ()
) -> list[Target]:
    """The blocks' linear layers whose last name is in ``names`` (empty: every one, or none
    where ``parameters`` are named, as peft's ``target_modules``) and their 3-D parameters
    that ``parameters`` name (peft's ``target_parameters``: the parameter's path in the model,
    or a dotted tail of it), in model order (block by block, each block's modules in
    registration order, a module's parameters in theirs: peft's parameter order); ``leave``:
    names every linear layer leaves out (``peft_names``). Refused, naming what the model has: a
    name that matches nothing, a parameter that is not 3-D."""
    parameters = list(parameters or [])
    every = not names and not parameters
    paths = _paths(model)
    out: list[Target] = []
    have: dict[str, None] = {}
    stacks: dict[str, None] = {}  # the 3-D parameters' last names
    matched: set[str] = set()
    for b, block in enumerate(model.blocks):
        i = model.layer_of(b)  # layers cut into sub-layer units: the layer's number names them
        for local, module in block.named_modules():
            shape = linear_shape(module)
            if shape is not None:
                last = local.rsplit(".", 1)[-1]
                have[last] = None
                if (every and last not in leave) or last in names:
                    out.append(Target(f"blocks.{i}.{local}", module, *shape))
            for pname, p in module.named_parameters(recurse=False):
                if p.dim() == 3:
                    stacks[stack_name(f"{local}.{pname}")] = None
                key = f"{paths.get(id(module), f'blocks.{i}.{local}')}.{pname}"
                hits = [n for n in parameters if key == n or key.endswith(f".{n}")]
                if not hits:
                    continue
                full = f"blocks.{i}.{local}.{pname}" if local else f"blocks.{i}.{pname}"
                if p.dim() != 3:
                    raise ConfigError(
                        f"adapter.target_parameters = {parameters!r}: {hits[0]!r} matches {full} of shape "
                        f"{tuple(p.shape)}, not an experts' 3-D parameter; name linear layers in adapter.target"
                    )
                matched.update(hits)
                out.append(_expert_target(full, module, pname, p))
    missing = [n for n in names if n not in have]
    if missing or (not parameters and not out):
        raise ConfigError(
            f"adapter.target = {names!r}: {', '.join(map(repr, missing)) or 'nothing'} matches no linear layer of "
            f"this model's blocks; it has {', '.join(have) or 'none'}"
        )
    missing = [n for n in parameters if n not in matched]
    if missing:
        raise ConfigError(
            f"adapter.target_parameters = {parameters!r}: {', '.join(map(repr, missing))} matches no parameter of "
            "this model's blocks; "
            + (
                f"its experts' 3-D parameters are {', '.join(stacks)}"
                if stacks
                else "it has no 3-D (experts') parameter: name its linear layers in adapter.target"
            )
        )
    return out


def stack_name(path: str) -> str:
    """The name a 3-D parameter at ``path`` is targeted by: its own (``gate_up_proj``), or
    with its module's where that alone names nothing apart (JetMoE's ``input_linear.weight``)."""
    parts = path.strip(".").split(".")
    return ".".join(parts[-2:]) if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]


def _paths(model: LayeredModel) -> dict[int, str]:
    """The blocks' modules' paths as peft matches parameter names against them: in the
    transformers model (by identity), or tiertrain's own for the built-in model."""
    if model.hf_model is None:
        return {
            id(m): f"blocks.{model.layer_of(i)}.{n}".rstrip(".")
            for i, b in enumerate(model.blocks)
            for n, m in b.named_modules()
        }
    return {id(m): n for n, m in model.hf_model.named_modules()}


def _expert_target(name: str, module: nn.Module, pname: str, p: torch.Tensor) -> Target:
    """peft's reading of a 3-D parameter (``ParamWrapper._get_in_out_features``): ``[experts,
    out, in]``, or ``[experts, in, out]`` where the module says ``is_transposed``."""
    experts, a, b = (int(x) for x in p.shape)
    transposed = bool(getattr(module, "is_transposed", False))
    n_in, n_out = (a, b) if transposed else (b, a)
    if experts < 2:  # peft takes a single one as a linear layer, with other ops
        raise ConfigError(f"adapter.target_parameters: {name} holds {experts} expert; LoRA on it is not supported")
    return Target(name, module, n_in, n_out, pname, experts, transposed)


def expert_factors(
    t: Target, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's ``ParamWrapper.get_delta_factors``: ``(lhs, rhs)`` whose per-expert product is
    the delta of ``t``'s weight. A's rows are expert-major (``experts x r``), B's columns
    rank-major (``r x experts``), as peft reshapes them; the same views, so the same bits."""
    a3 = a.reshape(t.experts, -1, a.shape[-1])  # (experts, r, in)
    b3 = b.reshape(b.shape[0], -1, t.experts).permute(2, 0, 1)  # (experts, out, r)
    lhs, rhs = (a3.transpose(-2, -1), b3.transpose(-2, -1)) if t.transposed else (b3, a3)
    return lhs.to(dtype), rhs.to(dtype)


def expert_delta(t: Target, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """peft's ``ParamWrapper.get_delta_weight`` (what its merge adds to the parameter)."""
    a3 = a.reshape(t.experts, -1, a.shape[-1])
    b3 = b.reshape(b.shape[0], -1, t.experts)
    return torch.einsum("o r e, e r i -> e i o" if t.transposed else "o r e, e r i -> e o i", b3, a3) * scaling


class _Pair(nn.Module):
    """One adapter, as peft's ``LoraLayer`` holds it: ``lora_A`` (r x in), ``lora_B`` (out x r);
    on an expert stack, r x experts where r is (``ParamWrapper``: no dropout)."""

    def __init__(self, t: Target, r: int, dropout: float) -> None:
        super().__init__()
        self.lora_A = nn.Linear(t.in_features, r * t.experts, bias=False)
        self.lora_B = nn.Linear(r * t.experts, t.out_features, bias=False)
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 and t.param is None else nn.Identity()


def _check_widths(rank: int, targets: list[Target]) -> None:
    """Refuse a rank above the width of every target (it adds nothing: a typo); one above some
    (a shared expert's gate, 2048 -> 1) is peft's too, said."""
    narrow = [t for t in targets if rank > min(t.in_features, t.out_features)]
    if not narrow:
        return
    t = narrow[0]
    what = f"{t.name} ({t.in_features} -> {t.out_features})"
    if len(narrow) == len(targets):
        raise ConfigError(
            f"adapter.rank = {rank} is above the width of {what}: a rank above min(in, out) = "
            f"{min(t.in_features, t.out_features)} adds nothing; lower it"
        )
    log.info(
        "adapter.rank = %d is above the width of %d adapted layer(s) (first: %s): their adapters' product has rank "
        "min(in, out) at most, as in peft; leave them out with adapter.target if unwanted",
        rank,
        len(narrow),
        what,
    )


class LoRA(nn.Module):
    """The adapters of one model (``cfg``: the ``[adapter]`` section), on ``device`` in fp32,
    hooked into the model's targeted layers. ``params()`` lists them in peft's order."""

    def __init__(self, model: LayeredModel, cfg: AdapterConfig, *, seed: int, device: torch.device | str) -> None:
        super().__init__()
        self.cfg = cfg
        self.names = resolve(cfg, model.hf_config)  # as peft reads them on this model
        self.targets = find_targets(
            model, self.names.target, self.names.parameters, leave=self.names.dropped if self.names.every else ()
        )
        _check_widths(cfg.rank, self.targets)
        with torch.device("cpu"):
            self.adapters: list[_Pair] = [
                _Pair(t, self.names.rank(t.param, cfg.rank), cfg.dropout) for t in self.targets
            ]
        self.pairs = nn.ModuleList(self.adapters)  # registered: .to() and state_dict() see them
        self.reset(seed)
        self.to(device)
        self.scaling = cfg.scaling
        pairs = list(zip(self.targets, self.adapters))
        self._hooks = [t.module.register_forward_hook(self._hook(p)) for t, p in pairs if t.param is None]
        stacks: dict[int, list[tuple[Target, _Pair]]] = {}  # per experts module, its adapted parameters
        for t, p in pairs:
            if t.param is not None:
                stacks.setdefault(id(t.module), []).append((t, p))
        for group in stacks.values():
            self._hooks += self._swap_hooks(group)

    @property
    def kinds(self) -> list[str]:
        """The targeted layers' last names (peft's ``target_modules``), sorted."""
        return sorted({t.name.rsplit(".", 1)[-1] for t in self.targets if t.param is None})

    @property
    def stacks(self) -> list[str]:
        """The targeted 3-D parameters' names (``stack_name``), sorted."""
        return sorted({stack_name(t.name) for t in self.targets if t.param is not None})

    def reset(self, seed: int) -> None:
        """peft's initialisation from ``seed``: A Kaiming-uniform (a = sqrt(5)), B zero."""
        g = torch.Generator().manual_seed(seed + SEED_SALT)
        with torch.no_grad():
            for p in self.adapters:
                nn.init.kaiming_uniform_(p.lora_A.weight, a=math.sqrt(5), generator=g)
                nn.init.zeros_(p.lora_B.weight)

    def flops(self) -> AdapterFlops:
        """What these adapters add to the step's FLOPs (``training.metrics.flops_per_token``)."""
        trained, sums, weighted = 0, 0, []
        for t, p in zip(self.targets, self.adapters):
            if t.param is None:  # A and B multiply every token
                trained += p.lora_A.weight.numel() + p.lora_B.weight.numel()
            else:  # W + B A, formed once a micro-batch
                w = t.module._parameters[t.param]
                assert w is not None
                weighted.append(id(w))
                sums += 6 * w.numel() * self.names.rank(t.param, self.cfg.rank)
        return AdapterFlops(trained=trained, weighted=frozenset(weighted), per_micro_batch=float(sums))

    @property
    def on_experts(self) -> bool:
        """Whether any adapter sits on an experts' 3-D parameter (they are then needed whole)."""
        return any(t.param is not None for t in self.targets)

    def params(self) -> list[torch.Tensor]:
        """The trainable parameters in peft's order: per target, A then B."""
        return [w for p in self.adapters for w in (p.lora_A.weight, p.lora_B.weight)]

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(target name.lora_A.weight, parameter)`` and B's, per target in model order."""
        for t, p in zip(self.targets, self.adapters):
            yield f"{t.name}.lora_A.weight", p.lora_A.weight
            yield f"{t.name}.lora_B.weight", p.lora_B.weight

    def load_named(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set every adapter from ``tensors`` by ``named()``'s names (a checkpoint's); each one
        must be there with this run's shape."""
        with torch.no_grad():
            for name, p in self.named():
                t = tensors.get(name)
                if t is None or tuple(t.shape) != tuple(p.shape):
                    raise ConfigError(
                        f"the adapter {name} is {'missing' if t is None else f'of shape {tuple(t.shape)}'} in the "
                        f"given adapters; this run's is {tuple(p.shape)} (the [adapter] config they were made with?)"
                    )
                p.copy_(t)

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.params())

    def _hook(self, pair: _Pair) -> Any:
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            x = args[0]
            a = pair.lora_A.weight
            if x.dtype != a.dtype:
                x = x.to(a.dtype)
            return (out + pair.lora_B(pair.lora_A(pair.dropout(x))) * self.scaling).to(out.dtype)

        return hook

    def _swap_hooks(self, group: list[tuple[Target, _Pair]]) -> list[Any]:
        """The hooks that give one experts module its adapted weights for a forward: the pre-hook
        puts ``W + scaling x lhs @ rhs`` (peft's ``_LoraFactorsProxy``: one ``baddbmm``, autocast
        off, in W's dtype) in the module's parameter table; the forward hook, always called,
        puts the frozen Parameters back, the objects the parameter store binds (only their
        ``.data`` changes from unit to unit)."""
        module = group[0][0].module
        names = [t.param for t, _ in group if t.param is not None]
        # the frozen Parameters, taken from the table once: the store rebinds their .data, never the
        # objects. A forward's weights come from them, whatever an earlier forward that failed left
        frozen = {name: module._parameters[name] for name in names}

        def pre(mod: nn.Module, args: tuple) -> None:
            adapted = {}
            for name, (t, pair) in zip(names, group):  # all made before any is put in: an error leaves none
                w = frozen[name]
                lhs, rhs = expert_factors(t, pair.lora_A.weight, pair.lora_B.weight, w.dtype)
                with torch.autocast(device_type=w.device.type, enabled=False):
                    adapted[name] = torch.baddbmm(w, lhs, rhs, alpha=self.scaling)
            # plain tensors in the table for this call: the experts' forward reads them by attribute
            # (``self.gate_up_proj``) as it would peft's parametrized weight
            mod._parameters.update(adapted)  # type: ignore[arg-type]

        def post(mod: nn.Module, args: tuple, out: Any) -> None:
            mod._parameters.update(frozen)  # idempotent: also after a forward that failed

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]

    def describe(self, optim: str = "adamw") -> str:
        """The adapters in a line; ``optim``: the optimizer's name (what its states add)."""
        n = sum(w.numel() for w in self.params())
        states = {
            "adamw": "x4 with gradients and AdamW moments",
            "adamw8bit": "x2.5 with gradients and 8-bit AdamW moments; fp32 ones under 4,096 elements",
            "sgd": "x2 with gradients, x3 with SGD momentum",
        }.get(optim, "with gradients and optimizer states")
        layers = sum(t.param is None for t in self.targets)
        on = [f"{layers} layers ({', '.join(self.kinds)})"] if layers else []
        if len(self.targets) > layers:
            on.append(f"{len(self.targets) - layers} expert stacks ({', '.join(self.stacks)})")
        return (
            f"LoRA rank {self.cfg.rank}, alpha {self.cfg.alpha:g}, dropout {self.cfg.dropout:g} on "
            f"{' and '.join(on)}: {n:,} trainable parameters, "
            f"{4 * n / 2**20:.1f} MiB of weights ({states}), on the compute device{self._as_peft()}"
        )

    def _as_peft(self) -> str:
        """What peft's reading of the names changed on this model (``peft_names``), said."""
        n = self.names
        if not n.dropped:
            return ""
        named = ", ".join(n.dropped)
        if n.every:
            return (
                f"; not the linear layers named {named} (peft takes those names for the experts' fused parameters "
                "on this model: name them in adapter.target to adapt the experts as peft does)"
            )
        fused = " (gate_up_proj at twice the rank and alpha)" if n.factor else ""
        return f"; {named} taken for the experts' {', '.join(n.parameters)}{fused}, as peft takes them on this model"
