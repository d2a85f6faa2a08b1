"""Bytes per step on each link, from the config and the model's units, before any step.

The same placement rules as the parts that hold the states (``state.regions.place``: units
in order while they fit in a host budget; the stash's spill rule; the activation policy's
keep rule), and the same order of unit fetches as the executor. Per step, with the
baseline update path (docs/DESIGN.md, "Bytes per parameter per step"):

- forward (as the executor times it: embedding, blocks, then the head's forward and
  backward): every file-resident unit it uses is read; the hidden states of recomputed
  blocks that do not fit in the stash's host slots are written; the head's gradient too;
- backward: the blocks in reverse and the embedding are read, except the last blocks of
  the forward still in a device slot; gradients of file-resident units are written;
  spilled hidden states are read back;
- update: per file-resident unit, the optimizer states (and the parameters, when there is
  no master copy) are read, the states and the parameters written, the gradients read.

Where device memory is separate (CUDA), every unit fetched also crosses PCIe (up), every
gradient and stashed hidden state comes down, and the kept ones' go back up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..activations.stash import HiddenStash
from ..config import Config
from ..execute.executor import visits
from ..state.quant import base_storage
from ..state.regions import place
from ..state.scales import ScaleLayout
from ..update.streamed import optimizer_shares, optimizer_states

__all__ = ["Traffic", "step_traffic", "run_traffic", "kept_pairs", "offloaded_pairs", "slot_fetches"]

MIB = 1 << 20


@dataclass
class Traffic:
    """Bytes per step: storage reads and writes per phase, host<->device per direction."""

    forward_read: int = 0
    forward_write: int = 0
    backward_read: int = 0
    backward_write: int = 0
    update_read: int = 0
    update_write: int = 0
    # of forward_read: the parameters of trained units (a path updating them under the next
    # forward hands their new values to it in memory instead of reading them back)
    forward_trained_read: int = 0
    up: int = 0  # host -> device (CUDA)
    down: int = 0  # device -> host (CUDA)
    by_state: dict[str, list[int]] = field(default_factory=dict)  # name -> [read, write]
    # bytes of the compute dtype made by widening a narrower frozen base (model.base_dtype) on
    # the thread that waits for each fetched unit, per phase
    widen: dict[str, int] = field(default_factory=dict)

    @property
    def read(self) -> int:
        return self.forward_read + self.backward_read + self.update_read

    @property
    def write(self) -> int:
        return self.forward_write + self.backward_write + self.update_write

    def _add(self, state: str, phase: str, kind: str, nbytes: int) -> None:
        if nbytes:
            setattr(self, f"{phase}_{kind}", getattr(self, f"{phase}_{kind}") + nbytes)
            rw = self.by_state.setdefault(state, [0, 0])
            rw[0 if kind == "read" else 1] += nbytes


def kept_pairs(cfg: Config, blocks: int, act_bytes: int, *, device_budget: int | None = None) -> int:
    """(block, micro-batch) pairs whose autograd graph the activation policy keeps, of
    ``blocks * M``, when one pair's saved tensors take ``act_bytes``."""
    m = cfg.memory
    pairs = blocks * cfg.data.micro_batches
    if m.activations == "recompute" or act_bytes <= 0:
        return 0
    budget = m.keep_act_mib * MIB if device_budget is None else device_budget
    return min(pairs, budget // act_bytes)


def offloaded_pairs(cfg: Config, blocks: int, kept: int) -> int:
    """Pairs whose activations go to the storage tier: ``memory.offload_pairs`` of those not
    kept (as planned at start; unset: none)."""
    m = cfg.memory
    if m.activations not in ("auto", "offload") or not m.offload_pairs:
        return 0
    return min(m.offload_pairs, blocks * cfg.data.micro_batches - kept)


def slot_fetches(order: list, layout, slots: int, on_host) -> list[tuple[int, int]]:
    """``(visit, unit)`` of every unit the parameter store loads in one step whose units are
    acquired in ``order`` (``executor.visits``), each visit prefetching the next ``slots - 1``:
    the store's rules (``state/store.py``) replayed, reads taken as instant. Slots start
    empty (the update changed every unit). ``on_host(u)``: needs no slot."""
    unit, state, last = [None] * slots, ["free"] * slots, [0] * slots
    clock, out = 0, []

    def load(i: int, u: int, pos: int) -> None:
        nonlocal clock
        clock += 1
        unit[i], state[i], last[i] = u, "loading", clock
        out.append((pos, u))

    def find(u: int) -> int | None:
        return next((i for i in range(slots) if unit[i] == u and state[i] != "free"), None)

    for pos, ref in enumerate(order):
        units = (*layout.units[ref.index].borrows, ref.index)
        for u in units:  # acquire
            if on_host(u):
                continue
            i = find(u)
            if i is None:
                free = [j for j in range(slots) if state[j] == "free"]
                idle = sorted((j for j in range(slots) if state[j] == "resident"), key=last.__getitem__)
                loading = sorted((j for j in range(slots) if state[j] == "loading"), key=last.__getitem__)
                i = (free or idle or loading or [None])[0]
                if i is None:
                    raise RuntimeError(f"no slot free for unit {u}: all {slots} are bound")
                load(i, u, pos)
            clock += 1
            state[i], last[i] = "bound", clock
        upcoming = [r.index for r in order[pos + 1 : pos + slots]]
        for u in upcoming:  # prefetch
            if on_host(u) or find(u) is not None:
                continue
            free = [j for j in range(slots) if state[j] == "free"]
            idle = [j for j in range(slots) if state[j] == "resident" and unit[j] not in upcoming]
            if not free and not idle:
                break
            load(free[0] if free else min(idle, key=last.__getitem__), u, pos)
        for u in units:  # release
            i = find(u)
            if i is not None and state[i] == "bound":
                state[i] = "resident"
    return out


def _on_file(layout, dtype: torch.dtype, host_bytes: int, align: int, on_device=frozenset()) -> set[int]:
    return {u for u, off in place(layout, dtype, host_bytes, align, on_device).items() if off is not None}


def step_traffic(
    cfg: Config,
    model,
    layout,
    dtype: torch.dtype,
    align: int,
    *,
    hidden: int,
    kept: int,
    separate: bool = False,
    used_pieces: list | None = None,
    offloaded: int = 0,
    record: int = 0,
    on_device: frozenset[int] = frozenset(),
) -> Traffic:
    """Bytes per step of a baseline run of ``cfg`` (the update engines move the update's
    bytes themselves: the same totals, attributed to them). ``kept``: pairs kept in memory
    (``kept_pairs``); ``separate``: device memory is not host memory (CUDA); ``used_pieces``:
    the embedding pieces the step's tokens use (None: all of them, the most a step reads);
    ``offloaded``: pairs whose activations go to the storage tier, ``record`` bytes each
    (written in the forward, read in the backward; their inputs are stashed); ``on_device``:
    the units whose optimizer states are in device memory (``cost.device_states.device_units_of``)."""
    m, d, t = cfg.memory, cfg.data, Traffic()
    M, L = d.micro_batches, len(model.blocks)
    e = dtype.itemsize
    nbytes = [u.numel * e for u in layout.units]
    # the frozen model's own layout and dtype where narrower (a 4-bit base: its bytes)
    stored, pdt = base_storage(cfg, layout, dtype, align) if cfg.adapter.on else (layout, dtype)
    params_file = _on_file(stored, pdt, m.host_param_mib * MIB, align)
    grads_file = _on_file(layout, dtype, m.grad_host_mib * MIB, align)
    plan = model.plan
    head = next(r for r in plan if r.role == "head")
    blocks = [r for r in plan if r.role == "block"]

    # parameters: every fetch of the step's unit visits, replayed against the store's slots;
    # phases as the executor times them: the head's forward and backward end the forward
    frozen = {u.index for u in layout.units if u.frozen}  # train.freeze: no gradient, no update
    # as the executor decides: some parameter of the embedding's unit or its pieces is trained
    embed_trains = any(
        layout.units[r.index].params and r.index not in frozen for r in plan if r.role in ("embed", "embed_piece")
    )
    order = visits(plan, used_pieces, embed_backward=embed_trains)
    n_forward = len(order) - len(blocks) - embed_trains  # the backward: the blocks in reverse, the embed unit
    # host-resident units are bound in place, unless they cross to the device or are converted
    on_host = (lambda u: False) if separate or pdt != dtype else (lambda u: u not in params_file)
    for pos, u in slot_fetches(order, layout, m.device_slots, on_host):
        phase = "forward" if pos < n_forward else "backward"
        if u in params_file:
            t._add("params", phase, "read", stored.units[u].numel * pdt.itemsize)
            if phase == "forward" and u not in frozen:
                t.forward_trained_read += stored.units[u].numel * pdt.itemsize
        plain = pdt == torch.uint8 and stored.units[u].plain  # a 4-bit base's unit with nothing quantized
        if pdt != dtype and not plain:  # read or in host memory, a narrower unit is widened (dequantized)
            t.widen[phase] = t.widen.get(phase, 0) + nbytes[u]
        if separate:  # a fetched unit crosses PCIe, from the file's staging or host memory (a 4-bit base:
            t.up += stored.units[u].numel if pdt == torch.uint8 else nbytes[u]  # its bytes, dequantized there)

    # gradients: written after the backward of each unit (the head's, and its pieces', in the
    # forward), read by the update
    head_side = {head.index, *(r.index for r in plan if r.role == "head_piece")}
    for u in range(len(layout.units)):
        if u in frozen:
            continue
        if u in grads_file:
            t._add("grads", "forward" if u in head_side else "backward", "write", nbytes[u])
            t._add("grads", "update", "read", nbytes[u])
        if separate:
            t.down += nbytes[u]

    # the optimizer's states (and parameters without a master copy), read and written once
    states = optimizer_states(cfg.optim, layout, dtype, align, m.optim_host_mib * MIB, owner="")
    shares = optimizer_shares(cfg.optim, layout, dtype, m.optim_host_mib * MIB)
    for st in states:
        lay = ScaleLayout(layout) if st.name == "exp_avg_scales" else layout  # 8-bit states' scales
        for u in _on_file(lay, st.dtype, shares[st.name], align, on_device) - frozen:
            n = lay.units[u].numel * st.dtype.itemsize
            t._add(st.name, "update", "read", n)
            t._add(st.name, "update", "write", n)
    has_master = dtype != torch.float32
    for u in on_device:  # updated in device memory: the gradient goes up, the new parameters down
        t.up += nbytes[u] * (1 if has_master else 2)  # (no master copy: the parameters go up too)
        t.down += nbytes[u]
    for u in params_file - frozen:
        if not has_master:
            t._add("params", "update", "read", nbytes[u])
        t._add("params", "update", "write", nbytes[u])

    # hidden states of recomputed pairs: forward pairs 0 .. first_kept-1; spilled: the first ones
    shape, widths = (d.micro_batch_size, d.seq_len, hidden), model.block_widths
    sizes = HiddenStash.sizes(shape, dtype, L * M, widths, M)  # per entry: layers cut hand on wider tensors
    _, _, spilled = HiddenStash.plan(shape, dtype, L * M, m.stash_host_mib * MIB, widths, M)
    stashed = L * M - kept  # recomputed and offloaded pairs stash their input
    # spilled entries are the first pairs; KeepLast keeps the last pairs, FirstFit the first ones
    first = kept if m.activations == "keep-first" else 0
    spill_bytes = sum(sizes[first : min(spilled, first + stashed)])
    t._add("stash", "forward", "write", spill_bytes)
    t._add("stash", "backward", "read", spill_bytes)
    t._add("activations", "forward", "write", offloaded * record)
    t._add("activations", "backward", "read", offloaded * record)
    if separate:
        rows = math.prod(shape[:-1]) * e
        pairs = range(first, first + stashed)
        h = sum(rows * (hidden if widths is None else widths[i // M]) for i in pairs)
        t.down += h + offloaded * record
        t.up += h + offloaded * record
    return t


def run_traffic(tr, *, kept: int | None = None) -> Traffic:
    """``step_traffic`` of a built run (a ``Trainer``: its config, model, layout, runtime and
    executor, read, never named here): the pairs its executor kept, the pieces its last step's
    tokens used and the activations it offloads, unless ``kept`` says otherwise."""
    from .device_states import device_units_of

    return step_traffic(
        tr.cfg,
        tr.model,
        tr.layout,
        tr.dtype,
        tr.rt.align,
        hidden=tr.rt.hidden_size,
        kept=tr.executor.kept_pairs if kept is None else kept,
        used_pieces=tr.executor.pieces_used,
        offloaded=tr.acts.offloaded,
        record=tr.acts.record_bytes,
        separate=tr.dev.separate,
        on_device=device_units_of(tr.cfg, tr.rt),
    )
