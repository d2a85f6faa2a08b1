"""One planner for a run: from the config and this machine, before anything is built, the memory
budget (with the vocabulary cut where whole units do not fit it), the update path where it is
``auto``, where the activations live, and the states every part will declare. The trainer
builds from a ``RunPlan``; ``tiertrain plan`` prints one. Nothing is patched afterwards: the
plan's config is the one the run uses (``Runtime.recut`` is the one change made to the runtime,
where the vocabulary is cut).

The machine is measured only where a choice needs it (``rates``: the storage tier, CRC32C and
one unit of each kind, a few seconds), once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..activations.offload import OffloadedGraphs
from ..activations.stash import HiddenStash
from ..config import Config
from ..dist.group import SoloGroup
from ..state.decl import StateDecl
from ..update import UPDATES

if TYPE_CHECKING:
    from ..cost.budget import BudgetPlan

__all__ = ["RunPlan", "ActivationPlan", "plan_run", "declare_states", "device_needs", "predict_step"]

log = logging.getLogger("tiertrain")
MIB = 1 << 20


def declare_states(cfg: Config, rt, record_bytes: int = 0) -> list[StateDecl]:
    """Every state a run of ``cfg`` keeps, by its owners, before any of it exists: the update
    path's (parameters, gradients, optimizer state, residual), the stash's and, with pairs
    offloaded (``memory.offload_pairs`` of ``record_bytes`` each), the activation records'."""
    update = UPDATES[cfg.update.mode].declare(cfg, rt.state_layout, rt.dtype, rt.align, cfg.io.paths)
    d, m = cfg.data, cfg.memory
    stash = HiddenStash.declare(
        (d.micro_batch_size, d.seq_len, rt.hidden_size),
        rt.dtype,
        len(rt.model.blocks) * d.micro_batches,
        (m.stash_host_mib or 0) * MIB,
        rt.model.block_widths,
        d.micro_batches,
    )
    acts = []
    if m.offload_pairs and record_bytes:
        acts = [OffloadedGraphs.declare(rt.dtype, record_bytes, m.offload_pairs, m.act_buffers)]
    return [*update, stash, *acts]


@dataclass(frozen=True)
class ActivationPlan:
    """Where the step's (block, micro-batch) pairs keep their activations, as planned at start."""

    act_bytes: int  # one pair's saved tensors (kept), measured by a dry run (0: not measured)
    record_bytes: int  # one pair's record on the storage tier (0: not measured)
    kept: int  # pairs the keep budget holds (as planned; the kept-graph budget still rules)
    offloaded: int

    @classmethod
    def of(cls, cfg: Config, rt, act_bytes: int, record_bytes: int) -> "ActivationPlan":
        from ..cost import kept_pairs, offloaded_pairs

        L = len(rt.model.blocks)
        kept = kept_pairs(cfg, L, act_bytes) if act_bytes else 0
        off = offloaded_pairs(cfg, L, kept) if record_bytes else 0
        return cls(act_bytes, record_bytes, kept, off)


@dataclass
class RunPlan:
    """What a run of the user's config is, on this machine (see the module docstring)."""

    cfg: Config  # every planned field set: memory.*_mib, update.mode, memory.offload_pairs, model.vocab_pieces
    budget: BudgetPlan  # the placement by memory budget, its lines
    acts: ActivationPlan
    states: list[StateDecl]
    notes: list[str] = field(default_factory=list)  # the choices made, and why (logged at start)
    rates: object = None  # cost.Rates, where the machine was measured

    def lines(self) -> list[str]:
        return [*self.budget.lines(), *self.notes]


def plan_run(cfg: Config, rt, group=None, *, probe_mib: int = 64, measure: bool | None = None, rates=None) -> RunPlan:
    """The plan of ``cfg`` on the runtime ``rt`` (its model may be cut again: ``Runtime.recut``).
    ``group``: the ranks, every one of which takes rank 0's choices (each measured its own
    machine). ``measure``: whether the update path's choice may measure the machine (default:
    where ``train.predict`` will anyway); ``rates``: measured already."""
    from ..cost import measure_rates
    from ..cost.budget import PoolsOverBudget
    from ..cost.choose import resolve_activations, resolve_speculation, resolve_update
    from ..cost.cuts import plan_budget
    from ..cost.probe import probe_acts

    group = group or SoloGroup()
    measured = [rates] if rates is not None else []

    def rates_fn():
        if not measured:
            log.info("probing this machine to place the states by benefit per byte")
            measured.append(measure_rates(cfg, rt, probe_mib=probe_mib))
        return measured[0]

    def act() -> tuple[int, int]:  # a dry run of block 0: bytes kept, bytes of an offloaded record
        return probe_acts(cfg, rt.model, rt.layout, rt.dev, rt.dtype, rt.hidden_size)

    try:
        planned, budget = plan_budget(cfg, rt, rates_fn, act, agree=group.rank0s)
    except PoolsOverBudget as exc:  # every rank plans the same budget: rank 0 says it
        exc.quiet = not group.leader
        raise
    notes = []
    measure = cfg.train.predict if measure is None else measure
    choose_rates = rates_fn if measure or measured else None
    planned, why = resolve_update(planned, rt, choose_rates, agree=group.rank0s)
    if why:
        notes.append(f"update path (auto): {why}{group.choice_note}")
    planned, why = resolve_speculation(planned, rt, choose_rates, agree=group.rank0s)
    if why:
        notes.append(why)
    planned, why = resolve_activations(planned, rt, budget.act_bytes, budget.record_bytes, choose_rates)
    if why:
        notes.append(why)
    notes += group.math_notes(planned)
    acts = ActivationPlan.of(planned, rt, budget.act_bytes, budget.record_bytes)
    states = declare_states(planned, rt, acts.record_bytes)
    return RunPlan(planned, budget, acts, states, notes, measured[0] if measured else None)


def device_needs(cfg: Config, rt, unit: int, accum) -> dict[str, int]:
    """What a run of ``cfg`` on the runtime ``rt`` holds in device memory whatever the budget
    (``Device.check_capacity``'s terms): ``unit`` bytes a slot, gradients summed in ``accum``."""
    from ..execute.tied import tied_rows_bytes
    from ..state.grads import GradStore

    m, layout, dtype = cfg.memory, rt.layout, rt.dtype
    return {
        "parameter slots (memory.device_slots)": m.device_slots * unit,
        "gradient buffers": GradStore.buffers_for(layout) * unit,
        "gradient accumulators (train.grad_accum_dtype)": GradStore.accum_bytes_for(layout, accum),
        "tied embedding's gradient rows": tied_rows_bytes(rt.model, layout, cfg.data, dtype, accum),
        "kept activations (memory.keep_act_mib)": (m.keep_act_mib or 0) * (1 << 20),  # (resolved by the plan)
        **({"adapters (weights, gradients, moments)": 4 * rt.adapters.nbytes} if rt.adapters else {}),
        "optimizer states (memory.optim_device_mib)": _device_states(cfg, rt),
    }


def _device_states(cfg: Config, rt) -> int:
    """The optimizer states placed in device memory, and the fp32 scratch a unit's gradient
    (and, without a master copy, its parameters) is uploaded into (a whole unit at most)."""
    from ..cost.device_states import device_state_bytes

    states = device_state_bytes(cfg, rt)
    if not states:
        return 0
    return states + rt.state_layout.max_unit_numel * 4 * (1 if rt.dtype != torch.float32 else 2)


def say_model(cfg: Config, rt, source) -> None:
    """The model line at start: its name, dtype, units and weights' source; adapters (and a
    quantized base's sizes) or frozen units."""
    from ..models import model_name
    from ..state.quant import base_storage, quant_spec

    log.info("model: %s %s, %s; %s", model_name(rt.model, cfg.model), rt.dtype, rt.layout.describe(), source.describe)
    if rt.adapters is not None:
        log.info("adapters: %s; the base frozen (read, never written)", rt.adapters.describe(cfg.optim.name))
        if quant_spec(cfg.model) is not None:
            log.info("%s", base_storage(cfg, rt.layout, rt.dtype, rt.align)[0].describe())
    elif rt.frozen:
        log.info("%s", rt.layout.describe_frozen(cfg.train.freeze))


def refuse_small_vocab(model, cfg: Config, *corpora) -> None:
    """Each corpus given (the training one, the evaluation one or None) fits the model's vocabulary."""
    from ..errors import ConfigError, speaks_for_ranks
    from ..models import vocab_size_of

    vocab = vocab_size_of(model, cfg)
    hf = cfg.model.hf_dir
    if (
        cfg.data.tokenizer is None
        and hf
        and vocab != 256
        and any(d is not None and d.vocab_size == 256 for d in corpora)
        and speaks_for_ranks()
    ):
        log.warning(  # (a directory of the weights alone: its text in bytes is no input the model knows)
            "model.hf_dir %s holds no tokenizer: the text is read as UTF-8 bytes (ids 0-255), not as the model's "
            "%d-token vocabulary; give its tokenizer with --data.tokenizer=DIR (or --data.tokenizer=bytes to "
            "train on bytes and not be told)",
            hf,
            vocab,
        )
    for what, data in zip(("corpus", "evaluation corpus"), corpora):
        if data is not None and data.vocab_size > vocab:
            raise ConfigError(
                f"model.vocab_size = {vocab} is smaller than the {what} vocabulary "
                f"({data.vocab_size}); raise it to at least {data.vocab_size}, or tokenize with the model's "
                "own tokenizer"
            )


def predict_step(cfg: Config, rt, rates):
    """The cost model's prediction of a run's step, logged (None when probing fails: a
    prediction is never worth stopping a run for)."""
    from ..cost import estimate
    from ..errors import one_line

    try:
        pred = estimate(cfg, rt, rates, probe_mib=64)
    except Exception as exc:  # noqa: BLE001
        log.warning("no step-time prediction: %s", one_line(exc))
        return None
    parts = ", ".join(f"{p.name} {p.time_s:.2f} s ({p.bound})" for p in pred.phases)
    log.info("predicted step: %.2f s (%s); `tiertrain plan` shows why", pred.step_s, parts)
    return pred
