"""A forward-only run's host memory (``tiertrain eval`` and ``generate``): its budget, taken once
(``host_budget``); the weights kept in memory across passes (``resident_budget``); generation's
key/value cache within it (``kv_host_budget``); the heap given back between units
(``heap_trim``)."""

from __future__ import annotations

import logging

from ..device.host import HeapTrim

__all__ = ["host_budget", "resident_budget", "kv_host_budget", "heap_trim", "refuse_small_budget"]

log = logging.getLogger("tiertrain")


def resident_budget(cfg, rt, other_bytes: int = 0, host: tuple[int, str] | None = None) -> tuple[int, str]:
    """Host bytes for weights kept in memory across passes, and why: ``memory.host_param_mib``
    where set, else what the run's budget (``host``, default ``host_budget``) leaves after the
    parameter slots, ``other_bytes`` and one unit's activations per micro-batch (a margin of the
    largest unit again)."""
    if cfg.memory.host_param_mib is not None:
        return cfg.memory.host_param_mib << 20, f"memory.host_param_mib = {cfg.memory.host_param_mib}"
    total, src = host if host is not None else host_budget(cfg)
    fixed = _working_bytes(cfg, rt) + other_bytes
    return max(0, total - fixed), (f"{src}, less {fixed / 2**20:,.0f} MiB of slots, cache and working memory")


def refuse_small_budget(cfg, rt) -> None:
    """Refuse a ``memory.host_mib`` below what a forward-only run cannot do without (the slots
    and a unit of working memory), naming it, as training refuses its own: eval and generate
    ran on, 5x over a budget of 50 MiB, with an INFO line."""
    from ..config import ConfigError

    need = _working_bytes(cfg, rt)
    if cfg.memory.host_mib is not None and cfg.memory.host_mib << 20 < need:
        raise ConfigError(
            f"memory.host_mib = {cfg.memory.host_mib}: below what this run cannot do without, "
            f"{-(-need >> 20)} MiB ({cfg.memory.device_slots} parameter slots and a unit of working memory, "
            f"the largest unit {rt.layout.max_unit_numel * rt.dtype.itemsize / 2**20:,.1f} MiB); raise it to at "
            f"least {-(-need >> 20)}"
        )


def _working_bytes(cfg, rt) -> int:
    """A forward-only run's fixed host memory: the parameter slots (the device's own on CUDA) and
    one unit of working memory."""
    unit = rt.layout.max_unit_numel * rt.dtype.itemsize
    return (0 if rt.dev.separate else cfg.memory.device_slots * unit) + unit


def kv_host_budget(cfg, rt, kv_bytes: int, host: tuple[int, str]) -> int | None:
    """Host bytes for generation's key/value cache of ``kv_bytes``: ``memory.kv_host_mib`` where
    set; else all of it (None) where the run's budget ``host`` holds it beside the slots and a
    unit of working memory, and what that leaves where it does not (the rest on the storage tier:
    the cache held all in memory past memory.host_mib, without a word). On CUDA the cache is in
    the device's memory: None."""
    if cfg.memory.kv_host_mib is not None:
        return cfg.memory.kv_host_mib << 20
    if rt.dev.separate:  # the cache is in the device's memory there, not the host's
        return None
    room = max(0, host[0] - _working_bytes(cfg, rt))
    if kv_bytes <= room:
        return None
    log.info(
        "key/value cache: %.1f MiB, more than %s leaves after the slots (%.1f MiB): the rest on the storage "
        "tier (memory.kv_host_mib sets the cache's share)",
        kv_bytes / 2**20,
        host[1],
        room / 2**20,
    )
    return room


def host_budget(cfg) -> tuple[int, str]:
    """A forward-only run's host budget and where it comes from: ``memory.host_mib``, or half
    the memory available now (``default_host_bytes``). Taken once, before any weight is read:
    what is available drops as they are."""
    from ..cost.budget import default_host_bytes

    if cfg.memory.host_mib is not None:
        return cfg.memory.host_mib << 20, f"memory.host_mib = {cfg.memory.host_mib}"
    return default_host_bytes()


def heap_trim(cfg, rt, rss_at_start: int, host: int) -> HeapTrim | None:
    """The heap given back after a unit (generation's and evaluation's passes) once the process
    has grown past ``rss_at_start`` (taken once the runtime is built) and its budget ``host``
    less a unit (``memory.trim_heap``, as training does): the transient tensors of a pass (a
    dequantized weight, activations) otherwise stay in glibc's heap, measured 0.5 GB over a
    1 GiB budget on a 1.2 B NF4 base."""
    if not cfg.memory.trim_heap:
        return None
    return HeapTrim(rss_at_start + host - rt.layout.max_unit_numel * rt.dtype.itemsize)
