"""One memory budget: the host memory (``memory.host_mib``) and, on CUDA, the device memory
(``memory.device_mib``) a run may use, and the placement of every state within them.

The fixed pools come first (parameter slots, gradient buffers, the update's buffers, I/O
buffers: without them no step runs). What is left goes to the states that can live either in
memory or on the storage tier, in order of the step time a byte of memory saves (measured
rates; ``Rates``):

- parameters: read by the forward and the backward, read (without a master copy) and written
  by the update: ``3-4`` bytes of I/O per byte;
- gradients, optimizer state, spilled hidden states, the top-k residual: written once and
  read once: ``2`` bytes of I/O per byte;
- kept activations: a block's recompute (its forward) and its stashed input's I/O per byte
  of its autograd graph (host memory on CPU, device memory on CUDA).

A byte of I/O costs ``1/bandwidth`` plus, with checksums, its CRC32C on the CPU. A state gets
``min(what it needs, what is left)``; the states fill in units, first units first, as the
parts that hold them place them. A ``*_mib`` field set explicitly is taken as given (and
counted against the budget). If everything fits, nothing is measured: no ranking is needed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

import torch

from ..activations.stash import HiddenStash
from ..config import Config, ConfigError
from ..execute.tied import tied_rows_bytes
from ..memlimit import available_memory, cgroup_memory
from ..state.grads import GradStore, accum_dtype_for
from ..state.quant import base_storage
from ..update import UPDATES
from ..update.streamed import optimizer_sizes
from .device_states import device_state_bytes, resolve_device_states


def accum_dtype_of(cfg: Config, dtype: torch.dtype) -> torch.dtype | None:
    return accum_dtype_for(cfg.train.grad_accum_dtype, cfg.data.micro_batches, dtype)


__all__ = [
    "PLANNED",
    "STATES_ON_STORAGE",
    "BudgetPlan",
    "resolve_budget",
    "default_host_bytes",
    "PoolsOverBudget",
    "warn_above_available",
]

log = logging.getLogger("tiertrain")

MIB, GIB = 1 << 20, 1 << 30
# memory.<field>: what it holds (fields left unset are planned)
PLANNED = {
    "host_param_mib": "parameters",
    "grad_host_mib": "gradients",
    "optim_host_mib": "optimizer state",
    "stash_host_mib": "hidden states",
    "keep_act_mib": "kept activations",
    "residual_host_mib": "top-k residual",
}
# Every state on the storage tier but for small host buffers of gradients, hidden states and
# residuals, and 512 MiB of kept activations: the fixed settings before the one budget (the
# benchmarks against DeepSpeed, whose states are all on NVMe, use them).
STATES_ON_STORAGE = dict(
    host_param_mib=0, grad_host_mib=256, optim_host_mib=0, stash_host_mib=256, keep_act_mib=512, residual_host_mib=256
)
HOST_FRACTION = 0.5  # of the memory available at start, when memory.host_mib is unset
BUILTIN_STATES = 0.25  # of its states' bytes the built-in default job keeps in memory (``builtin_job``)


def default_host_bytes() -> tuple[int, str]:
    avail, where = available_memory()  # a memory cgroup's limit, where one is tighter than the machine
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks on this machine share it
    if ranks > 1:
        return (
            int(avail * HOST_FRACTION / ranks),
            f"half of the {avail / GIB:.1f} GiB {where}, shared by this machine's {ranks} ranks",
        )
    return int(avail * HOST_FRACTION), f"half of the {avail / GIB:.1f} GiB {where}"


LIMIT_MARGIN = 0.1  # of a cgroup's limit kept free of the budget: page cache under writeback, allocator slack


def warn_above_available(host: int) -> None:
    """A budget set above the memory this machine has available now is taken as given (the
    user may know better, say with memory to be freed), but said, with the figure. Above a
    memory cgroup's limit (with what the cgroup holds already: this process's interpreter,
    libraries and model skeleton among it) it is refused: the kernel would kill the run
    (SIGKILL, no checkpoint) once it grew that far; within ``LIMIT_MARGIN`` of it, said."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cg = cgroup_memory()
    if cg is not None:
        need = host * ranks + cg.used
        fix = max(0, int(cg.limit * (1 - LIMIT_MARGIN) - cg.used) // ranks // MIB)  # keeps the margin
        each = f" for each of this machine's {ranks} ranks" if ranks > 1 else ""
        if need > cg.limit:
            raise ConfigError(
                f"memory.host_mib = {host // MIB:,} MiB{each} and the {cg.used // MIB:,} MiB its memory cgroup holds "
                f"already (this process's interpreter and libraries among it) exceed the cgroup's limit of "
                f"{cg.limit // MIB:,} MiB ({cg.where}): the kernel would kill the run once it grew that far; set "
                f"memory.host_mib at most {fix:,} (or leave it unset for half of what the limit leaves)"
            )
        if need > cg.limit * (1 - LIMIT_MARGIN):
            log.warning(
                "memory.host_mib = %s MiB%s and the %s MiB its memory cgroup holds already come within %d%% of the "
                "cgroup's limit of %s MiB (%s): page cache and allocator slack may have the kernel kill the run; "
                "memory.host_mib = %s keeps that margin",
                f"{host // MIB:,}", each, f"{cg.used // MIB:,}", int(LIMIT_MARGIN * 100), f"{cg.limit // MIB:,}",
                cg.where, f"{fix:,}",
            )  # fmt: skip
            return
    avail, where = available_memory()
    if host > avail:
        log.warning(
            "memory.host_mib = %s MiB is more than the %s MiB %s: the states placed in memory by it may not fit "
            "(leave memory.host_mib unset for half of that)",
            f"{host // MIB:,}",
            f"{avail // MIB:,}",
            where,
        )


@dataclass
class BudgetPlan:
    """What ``resolve_budget`` decided, to print at start."""

    host_bytes: int
    host_source: str
    fixed: dict[str, int]
    given: dict[str, int] = field(default_factory=dict)  # field -> bytes (explicit or planned)
    planned: list[str] = field(default_factory=list)  # fields that were planned
    demand: dict[str, int] = field(default_factory=dict)  # field -> bytes to hold everything
    value: dict[str, float] = field(default_factory=dict)  # field -> seconds per step saved per GiB
    device_acts: bool = False  # kept activations are device memory (CUDA), not host memory
    act_bytes: int = 0  # one pair's saved activations (kept), as measured or estimated
    record_bytes: int = 0  # one pair's record of offloaded activations (0: not measured, or no room)
    step_working: int = 0  # of the working set, what a training step's unit step holds (the heap trim's room)
    # kept activations in the working set's room that initialisation alone holds (its units: a
    # step never does, and activations are kept only in steps), on the host; counted once
    shared_acts: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def host_used(self) -> int:
        return (
            sum(self.fixed.values())
            + sum(v for k, v in self.given.items() if not (self.device_acts and k == "keep_act_mib"))
            - self.shared_acts
        )

    def lines(self) -> list[str]:
        used = self.host_used
        out = [
            f"host memory budget {self.host_bytes / GIB:.2f} GiB ({self.host_source}); fixed pools "
            f"{sum(self.fixed.values()) / GIB:.2f} GiB ("
            + ", ".join(f"{k} {v / MIB:,.0f} MiB" for k, v in self.fixed.items() if v)
            + ")"
        ]
        for f in sorted(self.given, key=lambda k: -self.value.get(k, 0.0)):
            need, got = self.demand.get(f, 0), self.given[f]
            if not need and not got:
                continue  # nothing of this kind in this run
            how = "planned" if f in self.planned else "set"
            why = f", {self.value[f]:.2f} s/step saved per GiB" if f in self.value else ""
            out.append(f"  {PLANNED[f]}: {got / MIB:,.0f} of {need / MIB:,.0f} MiB in memory (memory.{f}, {how}{why})")
        if self.shared_acts:
            out.append(
                f"  of which {self.shared_acts / MIB:,.0f} MiB of kept activations in the working set's room that only "
                "initialisation holds (a step holds none of its units)"
            )
        out.append(f"  in all {used / GIB:.2f} GiB of {self.host_bytes / GIB:.2f} GiB")
        return out + [f"  {n}" for n in self.notes]


def _act_bytes_estimate(cfg: Config, rt) -> int:
    """One (block, micro-batch)'s saved activations before any probe (Korthikanti et al.'s
    34 s b h + 5 a s^2 b bytes at 2 bytes per value, scaled to the dtype); with adapters on a
    mixture of experts' experts (``adapter.target_parameters``), the adapted copy of a unit's
    experts each forward makes and saves for its backward (peft's: W + scaling x A B)."""
    d, h = cfg.data, rt.hidden_size
    heads = getattr(getattr(rt.model, "hf_config", None), "num_attention_heads", None) or cfg.model.n_heads
    adapted = 0
    if rt.adapters is not None and rt.adapters.on_experts:
        adapted = max(sum(r.numel for r in u.params if len(r.shape) == 3) for u in rt.layout.units)
    return int(
        (34 * d.seq_len * d.micro_batch_size * h + 5 * heads * d.seq_len**2 * d.micro_batch_size)
        * rt.dtype.itemsize
        / 2
        + adapted * rt.dtype.itemsize
    )


def _base_bytes(cfg: Config, rt) -> int:
    """Bytes the parameters' backing copy takes: a frozen base in its own dtype or format."""
    n = rt.state_layout.total_numel
    if not cfg.adapter.on:
        return n * rt.dtype.itemsize
    stored, dtype = base_storage(cfg, rt.state_layout, rt.dtype, rt.align)
    return stored.total_numel * dtype.itemsize


def demands(cfg: Config, rt, act_bytes: int) -> dict[str, int]:
    """Bytes each planned field needs to hold all it can hold."""
    e, M, L = rt.dtype.itemsize, cfg.data.micro_batches, len(rt.model.blocks)
    n = rt.state_layout.total_numel  # as placed: units with their padding; ranks: this rank's 1/N
    stash = stash_sizes(cfg, rt)
    own = UPDATES[cfg.update.mode].states_in_trainer  # else the path keeps them in files of its own
    trained = 0 if cfg.adapter.on else 1  # adapters: the model forms no gradient and has no optimizer state
    out = {
        "host_param_mib": _base_bytes(cfg, rt) if own else 0,
        "grad_host_mib": n * e * trained,
        # (adapters: the base has no optimizer state, and its layout is not laid for one: not sized)
        "optim_host_mib": (
            sum(optimizer_sizes(cfg.optim, rt.state_layout, rt.dtype).values()) - device_state_bytes(cfg, rt)
            if own and trained
            else 0
        ),
        "stash_host_mib": sum(stash),
        "keep_act_mib": L * M * act_bytes if cfg.memory.activations != "recompute" else 0,
        "residual_host_mib": n * 4 if cfg.update.error_feedback else 0,
    }
    return {k: -(-v // MIB) * MIB for k, v in out.items()}  # whole MiB


WORKING_SLACK = 128 * MIB  # allocator arenas of the I/O threads, interpreter, fragmentation


def offload_possible(cfg: Config) -> bool:
    """Whether pairs not kept may go to the storage tier (their record pool is then fixed)."""
    m = cfg.memory
    return m.activations in ("auto", "offload") and (m.offload_pairs is None or m.offload_pairs > 0)


def fixed_pools(cfg: Config, rt, act_bytes: int = 0, record_bytes: int = 0) -> dict[str, int]:
    """Memory every step needs whatever the placement, in host memory (on CPU the device's
    slots and gradient buffers are host memory too), with the working set that is no pool:
    initialisation and autograd hold a few units' tensors at once, and a micro-batch's
    activations live while a block computes."""
    m, layout, e = cfg.memory, rt.layout, rt.dtype.itemsize
    unit = layout.max_unit_numel * e
    chunk = cfg.io.chunk_kib << 10
    out = {"I/O buffers": len(cfg.io.paths) * 2 * 2 * chunk, "checkpoint buffers": 2 * chunk}
    path = _update_path(cfg)
    out.update(path.fixed_pools(cfg, rt))  # the update path's own
    if rt.dev.separate:  # pinned staging for units and gradients crossing to the device
        sharded = getattr(rt, "world", 1) > 1
        out["staging"] = m.device_slots * unit + GradStore.buffers_for(layout) * GradStore.staging_unit_bytes(
            layout, rt.dtype, accum_dtype_of(cfg, rt.dtype), sharded
        )
    else:
        out["parameter slots"] = m.device_slots * unit
        out["gradient buffers"] = GradStore.buffers_for(layout) * unit
        out["gradient accumulators"] = GradStore.accum_bytes_for(layout, accum_dtype_of(cfg, rt.dtype))
        out["tied embedding's rows"] = _tied_bytes(cfg, rt)
    adapters = getattr(rt, "adapters", None)
    if adapters is not None and not rt.dev.separate:  # weights, gradients and AdamW's two moments, fp32
        out["adapters"] = 4 * adapters.nbytes
    widest = max(rt.model.block_widths or [rt.hidden_size]) / rt.hidden_size
    out["stash spill buffers"] = HiddenStash.spill_buffers_for(cfg.data.micro_batches, widest) * max(
        stash_sizes(cfg, rt)
    )
    if record_bytes:
        out["activation records"] = m.act_buffers * record_bytes
    routed = router_logits_bytes(cfg, rt)
    if routed and not rt.dev.separate:
        out["router logits"] = routed
    out["working set"] = working_set(cfg, rt, act_bytes)
    return out


def stash_sizes(cfg: Config, rt) -> list[int]:
    """Bytes of each of the stash's entries, in forward order (each block's input width: layers
    cut into sub-layer units hand wider tensors between the MLP's pieces)."""
    d = cfg.data
    shape = (d.micro_batch_size, d.seq_len, rt.hidden_size)
    entries = len(rt.model.blocks) * d.micro_batches
    return HiddenStash.sizes(shape, rt.dtype, entries, rt.model.block_widths, d.micro_batches)


def router_logits_bytes(cfg: Config, rt) -> int:
    """A mixture of experts' router logits, kept from the forward to the head for the auxiliary
    loss (``models/routers.py``): every router's for every micro-batch, ``tokens x experts``
    each, at most fp32 (device memory where it is separate). 0 without the loss."""
    routers = getattr(rt.model, "routers", None)
    if routers is None:
        return 0
    d = cfg.data
    return routers.count * d.micro_batches * d.micro_batch_size * d.seq_len * routers.experts * 4


def _update_path(cfg: Config):
    """The update path's class: adapters freeze the whole model."""
    return UPDATES["frozen" if cfg.adapter.on else cfg.update.mode]


def working_set(cfg: Config, rt, act_bytes: int = 0, *, steps: bool = False) -> int:
    """Bytes initialisation and autograd hold at once beyond the pools (``steps``: once
    initialisation is done, the training steps' own, never more): a few units' tensors,
    and a micro-batch's activations while a block computes."""
    path = _update_path(cfg)
    units = path.working_units
    if steps and path.step_working_units is not None:
        units = min(units, path.step_working_units)
    unit = rt.layout.max_unit_numel * rt.dtype.itemsize
    return units * unit + (0 if rt.dev.separate else 2 * act_bytes) + WORKING_SLACK


def values(cfg: Config, rt, rates) -> dict[str, float]:
    """Seconds per step saved per byte in memory, per planned field."""
    r = rates
    cpu = 1 / (r.crc_gbps * 1e9 * r.cores) if cfg.io.checksum else 0.0
    rd, wr = 1 / (r.read_gbps * 1e9) + cpu, 1 / (r.write_gbps * 1e9) + cpu
    reads = 3 if rt.dtype == torch.float32 else 2
    entry, _, _ = HiddenStash.plan((cfg.data.micro_batch_size, cfg.data.seq_len, rt.hidden_size), rt.dtype, 1, 0)
    keep = (r.block_fwd_s + entry * (rd + wr)) / max(r.act_bytes, 1)
    return {
        "host_param_mib": reads * rd + wr,
        "grad_host_mib": rd + wr,
        "optim_host_mib": rd + wr,
        "stash_host_mib": rd + wr,
        "keep_act_mib": keep,
        "residual_host_mib": rd + wr,
    }


def resolve_budget(cfg: Config, rt, rates_fn, act_fn=None) -> tuple[Config, BudgetPlan]:
    """``cfg`` with every unset ``memory.*_mib`` field of ``PLANNED`` set from the budget, and
    the plan. ``rates_fn()``: the measured ``Rates``, called only if the states do not all fit;
    ``act_fn()``: one pair's (activation bytes, offload record bytes), when kept or offloaded
    activations are planned (default: the rates' figures). The record pool of offloaded
    activations is fixed only where the pairs kept in memory are not all of them."""
    act, record = _act_bytes_estimate(cfg, rt), 0
    room = _device_budget(cfg, rt)
    cfg, on_device = resolve_device_states(cfg, rt, None if room is None else room - _device_fixed(cfg, rt, act))
    if "keep_act_mib" in _todo(cfg) or offload_possible(cfg):
        pools_fit_unmeasured(cfg, rt)
        if act_fn is not None:
            act, record = act_fn()
        else:
            r = rates_fn()
            act, record = r.act_bytes, r.record_bytes
    cfg_out, plan = _resolve_fitting(cfg, rt, rates_fn, act, 0)
    if record and offload_possible(cfg) and plan.given.get("keep_act_mib", 0) < plan.demand.get("keep_act_mib", 0):
        try:  # pairs left for the storage tier: their record pool is fixed
            cfg_out, plan = _resolve_fitting(cfg, rt, rates_fn, act, record)
        except ConfigError:
            if cfg.memory.activations == "offload":
                raise
            # auto: no room for the records' pool: what is not kept is recomputed
            plan.notes.append(
                f"activations: no room in the budget for {cfg.memory.act_buffers} records of "
                f"{record / MIB:,.0f} MiB (memory.act_buffers): none offloaded, the pairs not kept are "
                "recomputed; raise memory.host_mib to offload them"
            )
            record = 0
    plan.act_bytes, plan.record_bytes = act, record
    if on_device:
        plan.notes.append(on_device)
    return cfg_out, plan


class _Unmeasured(Exception):
    """The placement needs the machine's measurements (the fixed pools fit)."""


def pools_fit_unmeasured(cfg: Config, rt) -> None:
    """Raise ``PoolsOverBudget`` now where the budget cannot hold the fixed pools even with no
    activations at all: before the dry run of a block and the probes, which measure what is
    needed only to place the states (minutes for a 70 B block on a CPU, to then refuse)."""

    def unmeasured():
        raise _Unmeasured

    try:
        _resolve_fitting(cfg, rt, unmeasured, 0, 0)
    except _Unmeasured:
        return
    except PoolsOverBudget as exc:
        try:  # the figure to give: with one pair's activations as estimated (they are in the working set)
            _resolve_fitting(cfg, rt, unmeasured, _act_bytes_estimate(cfg, rt), 0)
            estimated = exc.needed
        except PoolsOverBudget as more:
            estimated = more.needed
        except _Unmeasured:
            estimated = exc.needed
        raise PoolsOverBudget.of(exc.host, exc.source, exc.needed, max(estimated, exc.needed)) from None


class PoolsOverBudget(ConfigError):
    """The budget is less than the fixed pools (the buffers at their defaults may shrink);
    ``needed``: the bytes they and the sizes set explicitly take."""

    def __init__(self, message: str, needed: int = 0, host: int = 0, source: str = "") -> None:
        super().__init__(message)
        self.needed, self.host, self.source = needed, host, source

    @classmethod
    def of(cls, host: int, source: str, needed: int, estimated: int = 0, acts: int = 0, data=None) -> "PoolsOverBudget":
        """The refusal of budget ``host`` (from ``source``) where ``needed`` bytes are the least
        that would run; ``estimated``: refused before measuring, that figure with one pair's
        activations estimated (``needed``: with none). ``acts``: of ``needed``, the measured
        activations' bytes (a micro-batch's, held while a block computes, and the records'), for
        the rows and tokens of ``data`` (its config section): named where they are what is short."""
        least = -(-(estimated or needed) // MIB)
        figure = (
            f"{needed / MIB:,.0f} MiB before any activations, about {estimated / MIB:,.0f} MiB with a micro-batch's, "
            "estimated"
            if estimated
            else f"{needed / MIB:,.0f} MiB"
        )
        if acts and data is not None:
            figure += (
                f", of which {acts / MIB:,.0f} MiB are activations of a micro-batch of {data.micro_batch_size} x "
                f"{data.seq_len:,} tokens, as measured"
            )
        fewer = ""
        if acts and data is not None and needed - acts <= host:  # the activations are what does not fit
            fewer = (
                "fewer rows a micro-batch (data.micro_batch_size, with more data.micro_batches for the same tokens), "
            )
        return cls(
            f"memory.host_mib: the budget ({host / MIB:,.0f} MiB, {source}) is less than the fixed pools, the working "
            f"set and the sizes set explicitly ({figure}); {fewer and 'take ' + fewer + 'or '}raise memory.host_mib to "
            f"{'about' if estimated else 'at least'} "
            f"{least:,} or lower memory.device_slots / memory.update_buffer_kib / io.chunk_kib / memory.act_buffers / "
            "the *_mib fields set",
            needed=needed,
            host=host,
            source=source,
        )


# Buffers that a small budget may lower from their defaults, in stages, down to these floors:
# first the I/O requests and update sets (4 MiB requests and 8 MiB update sets, the sizes the
# 1/5-of-plain benchmarks ran at), then the parameter slots to two (one computing, one loading:
# no deeper prefetch). Each: section, field, floor, unit.
SHRINKABLE = (
    (("io", "chunk_kib", 4096, "KiB"), ("memory", "update_buffer_kib", 8192, "KiB")),
    (("memory", "device_slots", 2, "slots"),),
)


def _halved_buffers(cfg: Config, given: Config) -> Config | None:
    """``cfg`` with the first stage of ``SHRINKABLE`` that can shrink shrunk: each field that
    ``given`` leaves at its default and that is above its floor, halved (down to the floor);
    None when none can shrink. A value other than the default was set by the user and is kept."""
    for stage in SHRINKABLE:
        changed: dict[str, dict[str, int]] = {}
        for section, name, floor, unit in stage:
            sec = getattr(cfg, section)
            value = getattr(sec, name)
            even = unit != "KiB" or value % 2 == 0  # KiB buffers stay whole blocks
            if getattr(getattr(given, section), name) == _default(sec, name) and value > floor and even:
                kw = {**changed.get(section, {}), name: max(floor, value // 2)}
                if _valid(sec, kw):  # (a chunk halved below the user's checksum blocks: refused by the config,
                    changed[section] = kw  # naming a value the user never set)
        if changed:
            return dataclasses.replace(
                cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **kw) for sec, kw in changed.items()}
            )
    return None


def _valid(sec, kw: dict) -> bool:
    """Whether section ``sec`` with ``kw`` set passes its own checks."""
    try:
        dataclasses.replace(sec, **kw)
    except ConfigError:
        return False
    return True


def _default(sec, name: str) -> int:
    f = next(f for f in dataclasses.fields(sec) if f.name == name)
    return f.default


def _resolve_fitting(cfg: Config, rt, rates_fn, act: int, record: int) -> tuple[Config, BudgetPlan]:
    """``_resolve``; where the fixed pools do not fit, first with the request and update
    buffers, then the parameter slots, lowered from their defaults (noted in the plan), then
    the error."""
    given = cfg
    while True:
        try:
            cfg_out, plan = _resolve(cfg, rt, rates_fn, act, record)
        except PoolsOverBudget:
            smaller = _halved_buffers(cfg, given)
            if smaller is None:
                raise
            cfg = smaller
            continue
        lowered = [
            f"{sec}.{name} {getattr(getattr(given, sec), name)} -> {getattr(getattr(cfg, sec), name)} {unit}"
            for stage in SHRINKABLE
            for sec, name, _, unit in stage
            if getattr(getattr(cfg, sec), name) != getattr(getattr(given, sec), name)
        ]
        if lowered:
            plan.notes.append(
                f"buffers lowered from their defaults to fit the fixed pools in the budget: "
                f"{', '.join(lowered)} (smaller requests; set them to choose)"
            )
        return cfg_out, plan


def _todo(cfg: Config) -> list[str]:
    return [f for f in PLANNED if getattr(cfg.memory, f) is None]


def builtin_job(cfg: Config) -> bool:
    """The built-in default job: the default model, trained on the bundled corpus, no adapter
    (``tiertrain train`` with no arguments)."""
    default = Config()
    return cfg.model == default.model and cfg.data.corpus == default.data.corpus and not cfg.adapter.on


def _host_budget(cfg: Config, fixed: int, states: int) -> tuple[int, str]:
    """The host budget and where it comes from: ``memory.host_mib``; for the built-in default job
    (whose states would all fit) its fixed pools and ``BUILTIN_STATES`` of its states, so
    the rest streams from the storage tier and its first run shows the tiers at work; else half
    the memory available (``default_host_bytes``)."""
    m = cfg.memory
    if m.host_mib is not None:
        return m.host_mib * MIB, "memory.host_mib"
    if builtin_job(cfg):
        host = (fixed + int(states * BUILTIN_STATES)) // MIB * MIB
        return host, (
            f"the built-in default job's: its fixed pools and a quarter of its states' {states / MIB:,.0f} MiB, "
            f"the rest on the storage tier ({', '.join(cfg.io.paths)}); set memory.host_mib to choose"
        )
    return default_host_bytes()


def _resolve(cfg: Config, rt, rates_fn, act: int, record: int) -> tuple[Config, BudgetPlan]:
    m = cfg.memory
    todo = _todo(cfg)
    explicit = {f: getattr(m, f) * MIB for f in PLANNED if f not in todo}
    device_acts = rt.dev.separate  # kept activations live in device memory on CUDA
    rates = None
    fixed = fixed_pools(cfg, rt, act, record)
    need = demands(cfg, rt, act)
    host_need = {f: v for f, v in need.items() if not (device_acts and f == "keep_act_mib")}
    host, source = _host_budget(
        cfg, sum(fixed.values()) + sum(v for f, v in explicit.items() if f in host_need), sum(host_need.values())
    )
    plan = BudgetPlan(host, source, fixed, planned=todo, device_acts=device_acts)
    plan.step_working = working_set(cfg, rt, act, steps=True)
    plan.demand = need
    left = host - sum(fixed.values()) - sum(v for f, v in explicit.items() if f in host_need)
    if left < 0:
        acts = (0 if device_acts else 2 * act) + fixed.get("activation records", 0)  # ``working_set``'s, the records'
        raise PoolsOverBudget.of(host, source, host - left, acts=acts, data=cfg.data)
    given = dict(explicit)
    # initialisation's units, which no step holds: room the kept activations (only ever held in
    # steps) may take too, beyond what is left
    shared = 0 if device_acts else fixed["working set"] - plan.step_working
    if todo:
        host_todo = [f for f in todo if f in host_need]
        if sum(host_need[f] for f in host_todo) > left:  # not everything fits: rank by benefit per byte
            rates = rates or rates_fn()
            val = values(cfg, rt, rates)
            plan.value = {f: v * GIB for f, v in val.items()}
            host_todo.sort(key=lambda f: -val[f])
        for f in host_todo:
            extra = shared if f == "keep_act_mib" else 0
            given[f] = min(host_need[f], max(0, left) + extra)
            in_shared = min(given[f], extra)
            plan.shared_acts += in_shared
            left -= given[f] - in_shared
        if device_acts and "keep_act_mib" in todo:
            given["keep_act_mib"] = _device_keep(cfg, rt, need["keep_act_mib"], act)
    plan.given = given
    # whole MiB, rounded down: never over the budget (demands are whole MiB already)
    mem = dataclasses.replace(m, **{f: given[f] // MIB if f in todo else getattr(m, f) for f in PLANNED})
    return dataclasses.replace(cfg, memory=mem), plan


def _device_keep(cfg: Config, rt, need: int, act: int) -> int:
    """Kept activations on CUDA: what ``memory.device_mib`` (default: 90% of the free device
    memory) leaves after slots, gradient buffers and one micro-batch's working activations."""
    budget = _device_budget(cfg, rt)
    if budget is None:  # the simulated device of the tests: separate, its memory the host's, no limit of its own
        return need
    return max(0, min(need, budget - _device_fixed(cfg, rt, act) - device_state_bytes(cfg, rt)))


def _device_budget(cfg: Config, rt) -> int | None:
    """``memory.device_mib`` (default: 90% of the free device memory); None: no limit (CPU, or
    the tests' simulated device, whose memory is the host's)."""
    if cfg.memory.device_mib is not None:
        return cfg.memory.device_mib * MIB
    if rt.dev.cuda:
        return int(0.9 * torch.cuda.mem_get_info(rt.dev.device)[0])
    return None


def _device_fixed(cfg: Config, rt, act: int) -> int:
    """Device memory every step holds: slots, gradient buffers (and accumulators), one
    micro-batch's working activations (twice), router logits, a tied embedding's rows."""
    unit = rt.layout.max_unit_numel * rt.dtype.itemsize
    return (
        (cfg.memory.device_slots + GradStore.buffers_for(rt.layout)) * unit
        + 2 * act
        + GradStore.accum_bytes_for(rt.layout, accum_dtype_of(cfg, rt.dtype))
        + router_logits_bytes(cfg, rt)
        + _tied_bytes(cfg, rt)
    )


def _tied_bytes(cfg: Config, rt) -> int:
    """A tied embedding's gradient rows kept in plain order (``execute/tied.py``)."""
    return tied_rows_bytes(rt.model, rt.layout, cfg.data, rt.dtype, accum_dtype_of(cfg, rt.dtype))
