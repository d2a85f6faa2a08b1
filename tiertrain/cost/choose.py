"""What the cost model chooses for a run: the update path, where ``update.mode = "auto"``, and
how many (block, micro-batch) pairs send their activations to the storage tier, where
``memory.activations = "auto"``.

The update paths ``auto`` may choose (``Update.auto_candidate``) hold the same states in the
same memory and run the same math in the same order (bit-identical), so choosing between them
changes only the time: the fastest by the prediction, a tie keeping the first (the simplest)
of the registry's order. A path that is not a candidate (other processes, other memory) is
only ever asked for by name. The choice asks the paths what they are; it names none.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import Config
from ..update.base import Update
from .probe import Rates

__all__ = ["resolve_update", "resolve_activations", "resolve_speculation", "with_mode"]

MIB = 1 << 20


def _candidates_of_auto() -> list[tuple[str, type[Update]]]:
    """The paths ``auto`` chooses from, the simplest first (the registry's order)."""
    from ..update import UPDATES

    return [(name, cls) for name, cls in UPDATES.items() if cls.auto_candidate and name != "auto"]


def _with_update(cfg: Config, **fields) -> Config:
    """``cfg`` with these ``update`` fields replaced."""
    return dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, **fields))


def with_mode(cfg: Config, mode: str) -> Config:
    """``cfg`` with ``update.mode = mode``."""
    return _with_update(cfg, mode=mode)


def resolve_update(
    cfg: Config,
    rt,
    rates_fn: Callable[[], Rates] | None,
    agree: Callable[[tuple[str, str]], tuple[str, str]] | None = None,
) -> tuple[Config, str | None]:
    """``cfg`` with ``update.mode = "auto"`` resolved, and why (None where it was not auto).
    ``agree`` (ranks: ``RankGroup.rank0s``) makes every rank take one rank's choice: each chose
    from its own measurements, which may differ."""
    cfg, why = _choose_update(cfg, rt, rates_fn)
    if why is not None and agree is not None:
        mode, why = agree((cfg.update.mode, why))
        cfg = with_mode(cfg, mode)  # (the group says whose choice it was: ``choice_note``)
    return cfg, why


def _choose_update(cfg: Config, rt, rates_fn: Callable[[], Rates] | None) -> tuple[Config, str | None]:
    """``resolve_update`` on this process's own measurements.

    Where the update moves nothing on the storage tier (every state it reads in memory) there
    is no I/O to hide: it runs beside the compute only on CUDA (its CPU kernels beside the
    device's); on a CPU device it would take cores from it. Otherwise the prediction decides,
    from ``rates_fn()`` (the machine's measured rates; called only then), or, where nothing is
    to be measured (``rates_fn`` None), the overlap, which hides the update's I/O."""
    if cfg.adapter.on:  # nothing of the model is updated: its parameters are the only state
        return with_mode(cfg, "frozen"), "frozen (adapters on a frozen model: the adapters update in the trainer)"
    if cfg.update.mode != "auto":
        return cfg, None
    paths = _candidates_of_auto()
    simplest = paths[0][0]
    beside = next(name for name, cls in paths if cls.beside_compute)  # the one that hides the update
    if cfg.update.eager or cfg.update.speculate == "on":
        eager = next(name for name, cls in paths if cls.supports_eager)
        asked = "update.eager" if cfg.update.eager else "update.speculate = 'on'"
        return with_mode(cfg, eager), f"{eager} ({asked}: each unit as its gradient arrives)"
    from . import predict_with, step_traffic

    t = step_traffic(
        with_mode(cfg, simplest),
        rt.model,
        rt.layout,
        rt.dtype,
        rt.align,
        hidden=rt.hidden_size,
        kept=0,
        separate=rt.dev.separate,
    )
    if t.update_read + t.update_write == 0:
        mode = beside if rt.dev.cuda else simplest
        why = (
            "the update moves nothing on the storage tier: its CPU work runs beside the device's"
            if rt.dev.cuda
            else "the update moves nothing on the storage tier and the compute is on this CPU: nothing to hide"
        )
        return with_mode(cfg, mode), f"{mode} ({why})"
    if rates_fn is None:
        moved = (t.update_read + t.update_write) / 1e9
        return with_mode(cfg, beside), (
            f"{beside} (the update moves {moved:.2f} GB a step on the storage tier; "
            "not measured here: hidden under the next forward)"
        )
    rates = rates_fn()
    times = {name: predict_with(with_mode(cfg, name), rt, rates).step_s for name, _ in paths}
    mode = simplest  # a tie (within 2%) keeps the simpler path
    for name, _ in paths[1:]:
        if times[name] < 0.98 * times[mode]:
            mode = name
    listed = ", ".join(f"{v:.2f} s/step for {k}" for k, v in times.items())
    return with_mode(cfg, mode), f"{mode} (predicted {listed})"


def _state_file_bytes(cfg: Config, rt) -> int:
    from ..update import UPDATES

    decls = UPDATES[cfg.update.mode].declare(cfg, rt.layout, rt.dtype, rt.align, cfg.io.paths)
    return sum(d.file_bytes for d in decls)


def resolve_speculation(
    cfg: Config,
    rt,
    rates_fn: Callable[[], Rates] | None,
    agree: Callable[[tuple[str, str]], tuple[str, str]] | None = None,
) -> tuple[Config, str | None]:
    """``cfg`` with ``update.speculate = "auto"`` resolved to "on" or "off", and why (None where
    there is nothing to choose). On where the update path can speculate (``Update.speculates``)
    and clips, the prediction with the states held twice (fewer of them in memory) is shorter
    than without by 2%, and the storage tier's free space holds every state file twice with
    10% to spare. The prediction assumes the clip rarely acts: a run where it keeps acting
    turns speculation off (``update/speculate.py``). ``agree``: ranks take rank 0's choice."""
    from ..io.space import device_of, free_bytes
    from . import predict_with
    from .device_states import device_units_of

    if cfg.update.speculate != "auto":
        return cfg, None
    from ..update import UPDATES

    off = _with_update(cfg, speculate="off")
    if cfg.optim.grad_clip == 0 or cfg.adapter.on:
        return off, None  # nothing to speculate on: the update waits for no norm, or runs elsewhere
    if not UPDATES[cfg.update.mode].speculates:
        return off, f"speculative update (auto): off (the {cfg.update.mode} update path does not speculate)"
    if device_units_of(off, rt):  # the budget placed them for a run not speculating
        return off, (
            "speculative update (auto): off (the optimizer's states are in device memory, memory.optim_device_mib, "
            "where the update takes milliseconds and the speculation could not hold them twice)"
        )
    on = _with_update(cfg, speculate="on")
    if rates_fn is None:
        choice, why = "off", "off (nothing measured: no gain predicted; update.speculate = 'on' to choose it)"
    else:
        need = _state_file_bytes(on, rt)
        fs = {device_of(p): p for p in cfg.io.paths}  # paths on one filesystem share its space
        free = sum(free_bytes(p) for p in fs.values())
        rates = rates_fn()
        t_on, t_off = predict_with(on, rt, rates).step_s, predict_with(off, rt, rates).step_s
        gain = f"predicted {t_on:.2f} s/step speculating against {t_off:.2f} s without"
        if need * 1.1 > free:
            choice, why = (
                "off",
                f"off (the states held twice take {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free; {gain})",
            )
        elif t_on < 0.98 * t_off:
            choice, why = "on", f"on ({gain}; the states held twice take {need / 2**30:.2f} GiB on the storage tier)"
        else:
            choice, why = "off", f"off ({gain})"
    if agree is not None:
        choice, why = agree((choice, why))
    return _with_update(cfg, speculate=choice), f"speculative update (auto): {why}"


def _with_offload(cfg: Config, n: int) -> Config:
    return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, offload_pairs=n))


def _candidates(rest: int, most: int = 48) -> list[int]:
    if rest <= most:
        return list(range(rest + 1))
    return sorted({round(i * rest / most) for i in range(most + 1)})


def resolve_activations(
    cfg: Config, rt, act_bytes: int, record_bytes: int, rates_fn: Callable[[], Rates] | None
) -> tuple[Config, str | None]:
    """``cfg`` with ``memory.offload_pairs`` planned (0 where nothing is offloaded), and why.

    The pairs the keep budget holds are kept; of the rest, in forward order just before the
    kept ones: ``offload`` sends them all to the storage tier; ``auto`` the number whose
    predicted step is the shortest (the cost model: their records' writes under the forward,
    reads under the backward, against each one's recompute), from ``rates_fn()`` (called
    only when there is a choice), or all of them where nothing is measured (``rates_fn``
    None): I/O that the disk keeps up with hides under compute."""
    from . import kept_pairs, predict_with

    m = cfg.memory
    L, M = len(rt.model.blocks), cfg.data.micro_batches
    if m.activations not in ("auto", "offload") or not record_bytes:
        return _with_offload(cfg, 0), None
    kept = kept_pairs(cfg, L, act_bytes)
    rest = L * M - kept
    head = f"activations (memory.activations = {m.activations!r}): {kept} of {L * M} pairs kept in memory, "
    if m.offload_pairs is not None:
        n = min(m.offload_pairs, rest)
        return _with_offload(cfg, n), head + f"{n} on the storage tier (memory.offload_pairs), {rest - n} recomputed"
    if rest == 0:
        return _with_offload(cfg, 0), head + "none left to offload or recompute"
    if m.activations == "offload" or rates_fn is None:
        why = "" if m.activations == "offload" else " (not measured: the storage tier's I/O hides under compute)"
        return _with_offload(cfg, rest), head + f"the other {rest} on the storage tier{why}"
    rates = dataclasses.replace(rates_fn(), act_bytes=act_bytes, record_bytes=record_bytes)
    times = {n: predict_with(_with_offload(cfg, n), rt, rates).step_s for n in _candidates(rest)}
    best = min(times.values())
    n = min(k for k, t in times.items() if t <= 1.01 * best)  # within 1%: fewer bytes on the disk
    return _with_offload(cfg, n), head + (
        f"{n} on the storage tier, {rest - n} recomputed (predicted {times[n]:.2f} s/step; all recomputed "
        f"{times[0]:.2f} s, all offloaded {times[rest]:.2f} s; {record_bytes / MIB:.1f} MiB per pair)"
    )
