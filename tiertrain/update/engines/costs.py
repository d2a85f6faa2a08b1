"""What the update engines cost a run, for the planner and the cost model: their memory (what
the trainer shares with them, their buffers, their interpreters) and how their update meets
the trainer's forward and backward (beside both, in other processes, on the same disk and, on
a CPU device, the same cores)."""

from __future__ import annotations

from ...config import Config

__all__ = ["ENGINE_PROCESS", "engine_pools", "predict_engines"]

MIB = 1 << 20
ENGINE_PROCESS = 320 * MIB  # an engine's interpreter with torch loaded, before its pools (measured: 300-330 MiB)


def engine_pools(cfg: Config, rt) -> dict[str, int]:
    """Host memory of the engines for a run of ``cfg`` on the runtime ``rt``."""
    from ...state.layout import chunk_align
    from ...state.scales import ScaleLayout
    from ..adamw8bit import eight_bit
    from ..streamed import update_set_bytes
    from .decl import engine_slot_bytes, slice_views

    m, chunk = cfg.memory, cfg.io.chunk_kib << 10
    n = cfg.update.engines or len(cfg.io.paths)
    pools = {
        "engine slots (shared)": engine_slot_bytes(rt.layout, n, rt.align, rt.dtype),
        # update sets and two I/O queues each; the read-ahead (with its units' 8-bit scales) is
        # the engines' together, each taking its share (``StreamedOptimizer._ahead_fit``)
        "engine buffers": n
        * (3 * update_set_bytes(cfg, rt.dtype, rt.align, rt.layout.max_unit_numel) + 2 * 2 * 2 * chunk)
        + (m.engine_read_ahead_mib << 20),
        "engine interpreters": n * ENGINE_PROCESS,
    }
    if eight_bit(cfg.optim):  # each engine's three sets' units' records of scales (fp32)
        _, views = slice_views(rt.layout, n, chunk_align(rt.align, rt.dtype))
        pools["8-bit states' scales (engines)"] = sum(3 * 4 * ScaleLayout(v).max_unit_numel for v in views)
    return pools


def predict_engines(c):
    """The update runs in the engines during the next forward and backward, on the same disk and
    (on a CPU device) the same cores: their kernel, checksums and I/O threads' CPU. The step is
    bound by the slower of the trainer's forward and backward and the disk's work of the whole
    step."""
    from ..base import Phase

    t, r = c.traffic, c.rates
    share = c.upd_cpu * c.fwd.compute_s / max(c.fwd.compute_s + c.bwd.compute_s, 1e-9)
    fwd = c.phase("forward", c.fwd_c, t.forward_read, t.forward_write, extra_cpu=share if c.cpu_compute else 0.0)
    fwd.time_s += c.first_read_s()
    bwd = c.phase(
        "backward",
        c.bwd_c,
        t.backward_read,
        t.backward_write,
        extra_cpu=c.upd_cpu - share if c.cpu_compute else 0.0,
    )
    speculate = c.cfg.update.speculate == "on"
    # speculating, a kept step is updated from the gradients' shared slots: none is read back
    back = t.by_state.get("grads", [0, 0])[0] if speculate else 0
    disk = (t.read - back) / (r.read_gbps * 1e9) + t.write / (r.write_gbps * 1e9)
    trainer = fwd.time_s + bwd.time_s
    step = max(trainer, disk, c.upd_c)
    bound = (
        "trainer's forward+backward" if step == trainer else ("disk (whole step)" if step == disk else "update kernel")
    )
    upd = Phase("update (engines, overlapped)", c.upd_c, c.upd.io_s, c.upd.crc_s, 0.0, "hidden")
    note = (
        f"engines: the update's bytes move during the next forward and backward; their CPU ({c.upd_cpu:.2f} s a "
        "step) shares the cores with the trainer"
        if c.cpu_compute
        else "engines: the update's bytes move during the next forward and backward"
    )
    if speculate:
        redo = c.upd.io_s + back / (r.read_gbps * 1e9)
        note = (
            "engines (speculative): each engine updates a unit as its gradient arrives, under the backward, into "
            f"the states' second copy, reading no gradient back ({back / 1e9:.2f} GB less a step); a step the clip "
            f"acts in is redone from the first copy ({redo:.2f} s more of the disk's time)"
        )
    return [fwd, bwd, upd], step, bound, [note]
