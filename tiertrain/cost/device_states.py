"""How much of the optimizer's state lives in device memory (``memory.optim_device_mib``).

A unit whose states are in device memory is updated there (``update/on_device.py``): per
element and step 4 bytes cross the link (its gradient up, its parameter down) instead of the
host's cores reading and writing 12-16. Where the device has memory of its own, that is worth
more than any other use of it but the fixed pools: on an H200 machine the host's update of a
3 B model took 4.5 s a step against 1.5 s for plain PyTorch's whole step, while a kept
activation saves one block's forward. So, planned (``None``), the states take what the device
budget leaves after the fixed pools and one micro-batch's working activations, before kept
activations; set, the value is taken as given; 0 (the default) keeps them all on the host.
"""

from __future__ import annotations

import dataclasses

from ..config import Config
from ..update import UPDATES
from ..update.adamw8bit import eight_bit
from ..update.streamed import device_units, state_bytes_per_element

__all__ = ["all_state_bytes", "device_state_bytes", "device_units_of", "resolve_device_states", "why_not_on_device"]

MIB = 1 << 20


def why_not_on_device(cfg: Config, rt) -> str:
    """Why no optimizer state of this run can live in device memory ('' where it can)."""
    if not rt.dev.separate:
        return "the device's memory is the host's (CPU)"
    if cfg.adapter.on:
        return "adapters train beside a frozen model: its units have no optimizer state"
    if not UPDATES[cfg.update.mode].states_in_trainer:
        return f"update.mode = {cfg.update.mode!r} keeps the states in processes of its own"
    if cfg.update.speculate == "on":
        return "the speculative update holds every state twice, on the host"
    if eight_bit(cfg.optim):
        return "8-bit states are updated by bitsandbytes' kernel on the host"
    return ""


def device_units_of(cfg: Config, rt) -> frozenset[int]:
    """The units whose states ``memory.optim_device_mib`` (as resolved) places in device memory
    in a run of ``cfg``: none where they cannot be there (``why_not_on_device``: a config the
    plan turned to the speculative update or the engines after the budget, a prediction of
    another update path) whatever the setting says."""
    if not cfg.memory.optim_device_mib or why_not_on_device(cfg, rt):
        return frozenset()
    return device_units(cfg.optim, rt.state_layout, rt.dtype, cfg.memory.optim_device_mib * MIB)


def all_state_bytes(cfg: Config, rt) -> int:
    """Bytes of every trained unit's optimizer states (what all of them on the device take)."""
    return sum(u.numel for u in rt.state_layout.units if not u.frozen) * state_bytes_per_element(cfg.optim, rt.dtype)


def device_state_bytes(cfg: Config, rt) -> int:
    """Bytes of the states ``memory.optim_device_mib`` (as resolved) places in device memory:
    whole units' states, so at most the setting."""
    units = device_units_of(cfg, rt)
    return sum(rt.state_layout.units[u].numel for u in units) * state_bytes_per_element(cfg.optim, rt.dtype)


def resolve_device_states(cfg: Config, rt, room: int | None) -> tuple[Config, str]:
    """``cfg`` with ``memory.optim_device_mib`` resolved, and the line that says so ('' where
    nothing is on the device and nothing was asked). ``room``: the device memory the budget
    leaves after its fixed pools (None: no limit, the tests' simulated device)."""
    m = cfg.memory
    why = why_not_on_device(cfg, rt)
    asked = m.optim_device_mib
    if why:
        line = f"memory.optim_device_mib = {asked} is not used: {why}; every state is on the host" if asked != 0 else ""
        return _with(cfg, 0), line
    total = all_state_bytes(cfg, rt)
    if asked is None:
        given = total if room is None else max(0, min(total, room))
        cfg = _with(cfg, -(-given // MIB) if given == total else given // MIB)  # all of them: the last unit too
    elif asked == 0:
        return cfg, ""
    on = device_state_bytes(cfg, rt)
    n = len(device_units_of(cfg, rt))
    trained = sum(1 for u in rt.state_layout.units if not u.frozen)
    how = "planned: what device memory leaves beside the fixed pools" if asked is None else "set"
    return cfg, (
        f"optimizer states in device memory: {on / MIB:,.0f} of {total / MIB:,.0f} MiB, {n} of {trained} units, "
        f"updated there (memory.optim_device_mib, {how})"
    )


def _with(cfg: Config, mib: int) -> Config:
    return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, optim_device_mib=mib))
