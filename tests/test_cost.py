"""The cost model: its bytes per step against the storage tier's own counters, its
prediction's arithmetic, and `tiertrain plan`. (How close its times come to measured steps
is a benchmark: bench/cost_model.py.)"""

import dataclasses
import re
import subprocess
import sys
import time

import pytest
import torch
from reference import small_config, tiny_flags

from tiertrain.cost import Rates, kept_pairs, predict, run_traffic
from tiertrain.cost.probe import probe_act_bytes
from tiertrain.cost.traffic import Traffic
from tiertrain.training.trainer import Trainer


@pytest.mark.parametrize(
    "case",
    [
        dict(layers=6, micro_batches=2, slots=2),
        dict(layers=6, micro_batches=2, slots=3, tie=True),
        dict(layers=5, micro_batches=3, slots=4, host_param_mib=1, grad_host_mib=1, optim_host_mib=1),
        dict(kind="llama", layers=4, micro_batches=4, slots=3, keep_act_mib=1),
        dict(layers=4, micro_batches=2, dtype="bfloat16", stash_host_mib=1),
        dict(layers=4, micro_batches=3, keep_act_mib=1, activations="keep-first"),
        dict(layers=3, micro_batches=2, slots=3, vocab_pieces=3),
        dict(kind="llama", layers=3, micro_batches=3, slots=4, vocab_pieces=5, host_param_mib=1),
        dict(kind="gpt2", layers=2, micro_batches=2, slots=2, vocab_pieces=4, tie=True),
        dict(layers=4, micro_batches=2, slots=2, freeze=["embed", "blocks:0-1"]),  # no backward to embed
        dict(kind="llama", layers=3, micro_batches=2, slots=3, freeze=["blocks:1", "head"], grad_host_mib=1),
    ],
)
def test_bytes_per_step_are_what_the_storage_tier_counts(tmp_path, case):
    """In all and by state, the model's bytes equal the counters of a real step. (Reads used to
    exceed them at M >= 3: the stash dropped prefetched entries and read them again.)"""
    optim_host = case.pop("optim_host_mib", 0)
    policy = case.pop("activations", "keep")
    pieces = case.pop("vocab_pieces", None)
    freeze = case.pop("freeze", [])
    cfg = small_config(tmp_path, steps=3, **case)
    cfg.train.freeze = freeze
    cfg.model.vocab_pieces = pieces
    cfg.memory.optim_host_mib = optim_host
    cfg.memory.activations = policy
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        rec = tr.train_step()
        kept = len(tr.model.blocks) * cfg.data.micro_batches - tr.executor.recomputed
        act = probe_act_bytes(tr.cfg, tr.model, tr.layout, tr.dev, tr.dtype, tr.rt.hidden_size)
        assert kept_pairs(tr.cfg, len(tr.model.blocks), act) == kept  # the policy's count, predicted
        t = run_traffic(tr, kept=kept)
        assert len(tr.executor.head_pieces) == (pieces or 0) if pieces else not tr.executor.head_pieces
    assert t.write == rec.ssd_write_bytes
    assert t.read == rec.ssd_read_bytes
    assert t.read == sum(v[0] for v in t.by_state.values()) and t.write == sum(v[1] for v in t.by_state.values())
    # the forward reads only parameters: all of them trained's, but for frozen units
    assert (t.forward_trained_read < t.forward_read) if freeze else (t.forward_trained_read == t.forward_read)


def test_kept_pairs_follow_the_budget_and_the_policy(tmp_path):
    cfg = small_config(tmp_path, layers=4, micro_batches=3, keep_act_mib=10)
    assert kept_pairs(cfg, 4, 3 << 20) == 3  # 10 MiB // 3 MiB
    assert kept_pairs(cfg, 4, 1 << 10) == 12  # all of them
    cfg.memory.activations = "recompute"
    assert kept_pairs(cfg, 4, 1 << 10) == 0


def _rates(**kw):
    base = dict(
        read_gbps=1.0,
        write_gbps=2.0,
        crc_gbps=10.0,
        io_cpu_s_per_gb=0.0,
        embed_fwd_s=0.0,
        embed_bwd_s=0.0,
        block_fwd_s=0.1,
        block_bwd_s=0.2,
        head_s=0.05,
        act_bytes=1 << 20,
        update_elem_s=1e-9,
        cores=2,
        io_slowdown=1.0,
    )
    return Rates(**{**base, **kw})


def test_a_phase_is_the_slower_of_compute_and_io(tmp_path):
    cfg = small_config(tmp_path, layers=4, micro_batches=2)
    cfg.io.checksum = False
    t = Traffic(
        forward_read=int(0.5e9),
        backward_read=int(3e9),
        backward_write=int(2e9),
        update_read=int(4e9),
        update_write=int(2e9),
    )
    p = predict(cfg, t, _rates(), blocks=4, kept=8, n_trained=10**8, first_read=0, cpu_compute=True)
    fwd, bwd, upd = p.phases
    assert fwd.compute_s == pytest.approx(2 * (4 * 0.1 + 0.05)) and fwd.bound == "compute"
    assert fwd.time_s == pytest.approx(0.9)
    assert bwd.io_s == pytest.approx(3.0 + 1.0) and bwd.bound == "I/O" and bwd.time_s == pytest.approx(4.0)
    assert upd.time_s == pytest.approx(5.0) and p.step_s == pytest.approx(0.9 + 4.0 + 5.0)
    # recompute adds a forward per pair not kept; checksums take CPU from a CPU device's compute
    cfg.io.checksum = True
    p2 = predict(cfg, t, _rates(), blocks=4, kept=0, n_trained=10**8, first_read=0, cpu_compute=True)
    assert p2.phase("backward").compute_s == pytest.approx(2 * 4 * 0.2 + 8 * 0.1)
    assert p2.phase("forward").time_s == pytest.approx(0.9 + 0.5e9 / 10e9 / 2)
    # engines: the update hides under the next step's forward and backward, on the same disk
    cfg.update.mode = "engines"
    p3 = predict(cfg, t, _rates(), blocks=4, kept=8, n_trained=10**8, first_read=0, cpu_compute=True)
    disk = (0.5 + 3 + 4) / 1.0 + (2 + 2) / 2.0
    assert p3.step_s == pytest.approx(disk) and p3.bound == "disk (whole step)"


def test_the_overlapped_update_runs_under_the_forward_or_the_backward(tmp_path):
    """update.mode = overlap: the update's own time (I/O here: 4 GB / 1 + 2 GB / 2 = 5 s)
    moves under the next forward, adding its bytes to that phase's disk time; eager, under
    the backward. Its CPU goes to the cores of a CPU device; its kernel runs in one thread."""
    cfg = small_config(tmp_path, layers=4, micro_batches=2)
    cfg.io.checksum = False
    t = Traffic(
        forward_read=int(0.5e9),
        backward_read=int(3e9),
        backward_write=int(2e9),
        update_read=int(4e9),
        update_write=int(2e9),
    )
    cfg.update.mode = "overlap"
    p = predict(cfg, t, _rates(), blocks=4, kept=8, n_trained=10**8, first_read=0, cpu_compute=True)
    fwd, bwd, upd = p.phases
    assert fwd.io_s == pytest.approx(0.5 + 5.0) and fwd.time_s == pytest.approx(5.5) and fwd.bound == "I/O"
    assert bwd.time_s == pytest.approx(4.0) and upd.time_s == 0.0
    assert p.step_s == pytest.approx(5.5 + 4.0)  # the baseline's 0.9 + 4.0 + 5.0, less the forward's 0.9
    # the update (5 s alone) paces the forward (0.9 s of compute): the trained units' parameters it
    # reads are handed over in memory instead
    t.forward_trained_read = int(0.4e9)
    h = predict(cfg, t, _rates(), blocks=4, kept=8, n_trained=10**8, first_read=0, cpu_compute=True)
    assert h.phase("forward").io_s == pytest.approx(0.1 + 5.0)
    # the update (0.2 s alone: its kernel) ahead of the forward: nothing handed
    fast = _rates(read_gbps=100.0, write_gbps=100.0)
    assert predict(cfg, t, fast, blocks=4, kept=8, n_trained=10**8, first_read=0, cpu_compute=True).phase(
        "forward"
    ).io_s == pytest.approx(0.005 + 0.06)
    t.forward_trained_read = 0
    cfg.optim.grad_clip, cfg.update.eager = 0.0, True
    e = predict(cfg, t, _rates(), blocks=4, kept=8, n_trained=10**8, first_read=0, cpu_compute=True)
    assert e.phase("forward").time_s == pytest.approx(0.9)
    assert e.phase("backward").io_s == pytest.approx(4.0 + 5.0) and e.step_s == pytest.approx(0.9 + 9.0)
    # the update's CPU (its kernel: 1e8 elements x 1e-9 s on 2 cores, 0.2 s in one thread) bounds it
    # when its I/O is small; on a CPU device it also takes that CPU from the compute
    small = Traffic(forward_read=0, update_read=int(1e6), update_write=int(1e6))
    cfg.update.eager = False
    cfg.optim.grad_clip = 1.0
    q = predict(cfg, small, _rates(), blocks=4, kept=8, n_trained=10**8, first_read=0, cpu_compute=True)
    assert q.phase("forward").time_s == pytest.approx(0.9 + 0.1 / 2)  # compute + the kernel's CPU over 2 cores
    tiny = predict(
        cfg,
        small,
        _rates(block_fwd_s=0.001, head_s=0.0),
        blocks=4,
        kept=8,
        n_trained=10**8,
        first_read=0,
        cpu_compute=True,
    )
    assert tiny.phase("forward").time_s == pytest.approx(0.2)  # the update thread's own kernel time


@pytest.mark.slow
def test_plan_prints_placement_bytes_and_the_predicted_step(tmp_path):
    flags = [f for f in tiny_flags(tmp_path, layers=3) if not f.startswith("--train.steps")]
    r = subprocess.run(
        [sys.executable, "-m", "tiertrain.cli", "plan", "--probe-mib=8", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    for want in (
        "placement:",
        "| exp_avg | update (baseline, overlap) |",
        "bytes per step on the storage tier: read",
        "| forward |",
        "| backward |",
        "| update",
        "| step |",
        "micro-batches:",
        "update path: baseline ",
        "overlap ",
        "engines ",
    ):
        assert want in out, want
    # update.mode = auto picks by the probe: the update phase is the baseline's or the overlap's
    assert ("| update |" in out) != ("| update (thread, under the next forward) |" in out)
    assert "update path (auto): " in r.stderr
    # the scratch space, as train says it at start (the plan said none at all: found from outside)
    assert re.search(r"scratch space needed on .*: [\d.]+ GiB \(\w+\.bin [\d.]+ MiB, ", r.stderr), r.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing trained, no run directory
    assert not any((tmp_path / "ssd").glob("*.bin"))  # and no state files
    assert not any((tmp_path / "ssd").glob(".tiertrain-probe-*"))  # the probe's file is gone
    bad = subprocess.run(
        [sys.executable, "-m", "tiertrain.cli", "plan", "--probe-mib=0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--probe-mib = 0: measure at least 1 MiB" in bad.stderr


@pytest.mark.slow
def test_train_prints_the_prediction_then_predicted_against_measured(tmp_path):
    flags = [f for f in tiny_flags(tmp_path, steps=5) if f != "--train.predict=false"]
    r = subprocess.run(
        [sys.executable, "-m", "tiertrain.cli", "train", *flags], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "predicted step: " in r.stderr and "`tiertrain plan` shows why" in r.stderr
    assert "step time: predicted " in r.stderr and "(median of the last 3 steps;" in r.stderr


def test_predictions_for_machines_we_do_not_have():
    """The stated-input model: Llama shapes by their sizes (7B: 6,738,415,616 parameters, as
    its checkpoints hold), ZeRO-Infinity's parameter traffic growing with M and tiertrain's not,
    and more drives never slower."""
    from tiertrain.bench.machines import MACHINES, SHAPES, predict_on, table

    assert SHAPES["Llama 7B"].params == 6_738_415_616
    one = MACHINES["H100 SXM, 1 NVMe"]
    z8, z64 = (predict_on(SHAPES["Llama 7B"], one, micro_batches=m, system="zero-infinity") for m in (8, 64))
    t8, t64 = (predict_on(SHAPES["Llama 7B"], one, micro_batches=m) for m in (8, 64))
    assert z64.nvme_s == pytest.approx(8 * z8.nvme_s) and t64.nvme_s == pytest.approx(t8.nvme_s)
    for shape in SHAPES.values():
        for system in ("baseline", "overlap", "engines", "zero-infinity"):
            steps = [predict_on(shape, MACHINES[f"H100 SXM, {n} NVMe"], system=system).step_s for n in (1, 2, 4)]
            assert steps == sorted(steps, reverse=True), (shape.name, system, steps)
    assert table().count("\n") == 2 + len(SHAPES) * len(MACHINES) * 2 - 1
    # the overlap hides the update under the forward: never slower than the baseline, never
    # faster than the engines (which hide it under the forward and the backward)
    for shape in SHAPES.values():
        for m in MACHINES.values():
            for M in (8, 64):
                b, o, e = (
                    predict_on(shape, m, micro_batches=M, system=s).step_s for s in ("baseline", "overlap", "engines")
                )
                assert e <= o * 1.0001 and o <= b * 1.0001, (shape.name, m.name, M, b, o, e)


def test_the_update_phase_steps_only_what_is_trained(tmp_path):
    """The update's compute is AdamW over the trained parameters: every one in full training,
    the units ``train.freeze`` leaves, only the adapters under LoRA (a plan of a 2.4 B LoRA run
    predicted 2.35 s of update for its 23 M adapters, as if it stepped the frozen base)."""
    from tiertrain.cost import predict_with
    from tiertrain.runtime import Runtime

    r = _rates(update_elem_s=1e-6)

    def update_s(cfg):
        rt = Runtime(cfg)
        return rt, predict_with(cfg, rt, r).phase("update").compute_s

    rt, full = update_s(small_config(tmp_path / "a", kind="llama", layers=3, micro_batches=1))
    assert full == pytest.approx(rt.layout.n_params * 1e-6)
    cfg = small_config(tmp_path / "b", kind="llama", layers=3, micro_batches=1)
    cfg.train.freeze = ["embed", "blocks:0-1"]
    rt, frozen = update_s(cfg)
    trained = sum(u.used for u in rt.layout.units if not u.frozen)
    assert 0 < trained < rt.layout.n_params and frozen == pytest.approx(trained * 1e-6)
    cfg = small_config(tmp_path / "c", kind="llama", layers=3, micro_batches=1)
    cfg.adapter.kind, cfg.adapter.rank, cfg.adapter.target = "lora", 4, ["q_proj", "v_proj"]
    cfg.update.mode = "auto"
    rt, lora = update_s(cfg)
    adapters = sum(p.numel() for p in rt.adapters.params())
    assert 0 < adapters < rt.layout.n_params / 10 and lora == pytest.approx(adapters * 1e-6)


def test_a_narrower_base_is_widened_on_the_computes_thread(tmp_path):
    """A bf16 base under fp32 compute: every fetch of a unit widens it on the thread that waits
    for it (``widen_in_place``), in the phase that fetched it; the cost model adds those bytes
    at the measured rate to that phase's compute, on a CPU device."""
    from tiertrain.cost import predict_with, step_traffic
    from tiertrain.cost.probe import probe_widen
    from tiertrain.runtime import Runtime

    cfg = small_config(tmp_path, kind="llama", layers=3, micro_batches=1, slots=2, host_param_mib=0)
    cfg.adapter.kind, cfg.adapter.rank, cfg.adapter.target = "lora", 4, ["q_proj"]
    cfg.update.mode, cfg.model.base_dtype = "auto", "bfloat16"
    rt = Runtime(cfg)
    t = step_traffic(cfg, rt.model, rt.layout, rt.dtype, rt.align, hidden=rt.hidden_size, kept=0)
    # every unit is read from the file (none in host memory), in bf16, and widened to fp32
    assert t.widen["forward"] + t.widen["backward"] == 2 * t.by_state["params"][0]
    assert t.widen["forward"] > 0 and t.widen["backward"] > 0
    assert probe_widen(torch.bfloat16, torch.float32, 1 << 20) > 0 == probe_widen(torch.float32, torch.float32, 1)
    r = _rates(widen_gbps=1.0)
    with_widen = predict_with(cfg, rt, r)
    without = predict_with(cfg, rt, _rates())
    for phase in ("forward", "backward"):
        extra = with_widen.phase(phase).compute_s - without.phase(phase).compute_s
        assert extra == pytest.approx(t.widen[phase] / 1e9), phase


def test_predicted_against_measured_separates_the_disks_drift(tmp_path):
    """After the warm-up the run says its prediction against the measured step, then again with
    the disk as fast as those steps found it: the probed rates scaled by the time their bytes
    take at the probed rates over the time a request was in flight (reads and writes that
    overlap share it): the disk's drift since the probe apart from the model's error."""
    import types

    from tiertrain.cost import predict_with
    from tiertrain.cost.report import against_measured
    from tiertrain.runtime import Runtime

    cfg = small_config(tmp_path, layers=3, micro_batches=2, host_param_mib=0, optim_host_mib=0)
    rt = Runtime(cfg)
    pred = predict_with(cfg, rt, _rates(read_gbps=1.0, write_gbps=2.0))

    def rec(s, r, w, busy):
        return types.SimpleNamespace(step_s=s, ssd_read_bytes=r, ssd_write_bytes=w, ssd_busy_s=busy)

    # 2 GB read and 2 GB written take 2 + 1 = 3 s at the probed rates: busy 1.5 s is twice as fast
    line = against_measured(cfg, rt, pred, [rec(3.0, 2e9, 2e9, 1.5), rec(1.0, 2e9, 2e9, 1.0), rec(2.0, 2e9, 2e9, 6.0)])
    again = predict_with(cfg, rt, _rates(read_gbps=2.0, write_gbps=4.0))  # the median pace: 2x
    assert again.step_s != pred.step_s
    assert line.startswith(f"step time: predicted {pred.step_s:.2f} s, measured 2.00 s (median of the last 3 steps;")
    assert "with the disk 2.00x as fast as probed, as these steps found it (read 2.00, write 4.00 GB/s): " in line
    assert line.endswith(f"predicted {again.step_s:.2f} s ({2.0 / again.step_s:.2f}x)")
    quiet = against_measured(cfg, rt, pred, [rec(2.0, 0, 0, 0.0)] * 3)  # nothing on the storage tier
    assert quiet.endswith(f"; {2.0 / pred.step_s:.2f}x)") and "as fast" not in quiet


def test_busy_time_counts_overlapping_reads_and_writes_once(tmp_path):
    """A path's busy time: per direction while one of its requests is in flight, and in all
    while any is (overlapping reads and writes counted once)."""
    from tiertrain.io.stats import PathStats

    st = PathStats("p")
    st.begin("r")
    time.sleep(0.05)
    st.begin("w")
    time.sleep(0.05)
    st.end("r", 10)
    time.sleep(0.05)
    st.end("w", 20)
    snap = st.snapshot()
    assert snap.read_bytes == 10 and snap.write_bytes == 20
    assert snap.read_busy_s == pytest.approx(0.10, abs=0.03) and snap.write_busy_s == pytest.approx(0.10, abs=0.03)
    assert snap.busy_s == pytest.approx(0.15, abs=0.03) and snap.busy_s < snap.read_busy_s + snap.write_busy_s
    assert (snap - snap).busy_s == 0.0 and (snap + snap).busy_s == pytest.approx(2 * snap.busy_s)


def test_the_disk_probe_reads_as_deep_as_a_units_read(tmp_path):
    """The probe keeps as many pieces in flight as fill every I/O thread's chunk, as a unit's
    read does: one 16 MiB piece at a time (one chunk in flight at the default 16 MiB chunks)
    read at 0.85 GB/s where the steps right after read at 1.50 GB/s."""
    from tiertrain.config import load_config
    from tiertrain.cost.probe import DiskProbe
    from tiertrain.io import IOFuture

    class Counting:
        def __init__(self):
            self.inflight, self.most, self.offsets = 0, 0, []

        def pread(self, buf, file_offset):
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            self.offsets.append(file_offset)
            fut = IOFuture.completed(buf.numel())
            return IOFuture([], finish=lambda _: (setattr(self, "inflight", self.inflight - 1), fut.get())[1])

    for chunk_kib, threads, depth in ((16384, 8, 8), (4096, 8, 2), (4096, 2, 1)):
        io = load_config(None, [f"--io.paths={tmp_path}", f"--io.chunk_kib={chunk_kib}", f"--io.threads={threads}"]).io
        with DiskProbe(io, 256) as d:
            real, d.f = d.f, Counting()
            try:
                d.read()
                assert d.depth == depth and d.f.most == depth, (chunk_kib, threads)
                assert d.f.offsets == list(range(0, 256 << 20, 16 << 20)) and d.f.inflight == 0
            finally:
                d.f = real


def test_the_disk_probe_times_an_overwrite_as_training_writes(tmp_path):
    """Training overwrites its state files; a first write into a new file's space ran 1.2-1.5x
    slower here, so the probe lays its file out untimed and times the second pass."""
    from tiertrain.config import IOConfig
    from tiertrain.cost.probe import DiskProbe

    with DiskProbe(IOConfig(paths=[str(tmp_path)]), 32) as d:
        writes = []
        real = d.f.pwrite
        d.f.pwrite = lambda buf, **kw: (writes.append(kw["file_offset"]), real(buf, **kw))[1]
        assert d.write() > 0
        pieces = d.size // d.piece
        assert writes == 2 * list(range(0, d.size, d.piece)) and pieces == 2  # laid out, then timed
        d.write()
        assert len(writes) == 3 * pieces  # once laid out, every pass is timed


def test_a_long_probe_pass_is_followed_by_one_timed_pass(tmp_path, monkeypatch, caplog):
    """The compute probe times ``repeats`` passes after a warm-up; where the warm-up took more
    than ``LONG_PASS_S`` (large units on a CPU), one (a plan's wait: two passes, not three).
    The busy probe takes the quiet one's activation bytes instead of measuring them again."""
    import logging

    from tiertrain.cost import measure_rates, unit_timing
    from tiertrain.cost import probe as probe_mod
    from tiertrain.execute.executor import LayerMajorExecutor
    from tiertrain.runtime import Runtime

    cfg = small_config(tmp_path, kind="llama", layers=3, micro_batches=2)
    rt = Runtime(cfg)
    passes, acts = [], []
    embed, measure = LayerMajorExecutor.embed_forward, probe_mod._measure_acts
    monkeypatch.setattr(LayerMajorExecutor, "embed_forward", lambda self, *a: passes.append(1) or embed(self, *a))
    monkeypatch.setattr(probe_mod, "_measure_acts", lambda *a: acts.append(1) or measure(*a))
    try:
        args = (cfg, rt.model, rt.layout, rt.dev, rt.dtype, rt.hidden_size)
        probe_mod.probe_compute(*args)
        assert len(passes) == 3 and len(acts) == 1  # a warm-up, then the median of 2
        passes.clear()
        monkeypatch.setattr(unit_timing, "LONG_PASS_S", 0.0)
        with caplog.at_level(logging.INFO, logger="tiertrain"):
            out = probe_mod.probe_compute(*args)
        assert len(passes) == 2 and "one more timed, not 2" in caplog.text
        assert out["block_fwd_s"] > 0 and out["block_bwd_s"] > 0 and out["head_s"] > 0
        acts.clear()
        rates = measure_rates(cfg, rt, probe_mib=8)
        assert len(acts) == 1 and rates.act_bytes > 0 and rates.io_slowdown >= 1.0
    finally:
        rt.close()


def test_the_link_is_measured_and_in_the_forward_and_the_backward(tmp_path):
    """Where device memory is separate, a step's host <-> device copies (``Traffic.up`` and
    ``down``) at the probed rates are half in the forward's I/O and half in the backward's (they
    were counted by the traffic, never timed: a CUDA step's prediction left out the link)."""
    from tiertrain.cost.probe import probe_link
    from tiertrain.device import Device
    from tiertrain.device.simulated import AsyncCpuDevice

    dev = AsyncCpuDevice(delay=0.0)
    up, down = probe_link(dev, mib=4)
    assert up > 0 and down > 0 and probe_link(Device(), mib=4) == (0.0, 0.0)
    cfg = small_config(tmp_path, layers=4, micro_batches=2)
    cfg.io.checksum = False
    t = Traffic(forward_read=int(0.5e9), backward_read=int(1e9), up=int(6e9), down=int(2e9))
    args = dict(blocks=4, kept=8, n_trained=10**8, first_read=0, cpu_compute=False)
    without = predict(cfg, t, _rates(), **args)
    p = predict(cfg, t, _rates(up_gbps=3.0, down_gbps=1.0), **args)  # 2 s up, 2 s down
    for phase, disk in (("forward", 0.5), ("backward", 1.0)):
        assert without.phase(phase).io_s == pytest.approx(disk), phase
        assert p.phase(phase).io_s == pytest.approx(disk + 2.0) and p.phase(phase).bound == "I/O", phase
    cfg.update.mode = "engines"  # every path's phases carry it, once
    assert predict(cfg, t, _rates(up_gbps=3.0, down_gbps=1.0), **args).phase("backward").io_s == pytest.approx(3.0)
    cfg.update.mode, cfg.update.eager, cfg.optim.grad_clip = "overlap", True, 0.0
    eager = predict(cfg, t, _rates(up_gbps=3.0, down_gbps=1.0, read_gbps=1e9, write_gbps=1e9), **args)
    assert eager.phase("backward").io_s == pytest.approx(2.0, rel=1e-6)


def test_the_plan_names_the_tokens_a_step_from_which_the_step_is_compute_bound(tmp_path):
    """`tiertrain plan`'s knee: the fewest micro-batches (powers of two) at which the device's
    forward and backward take at least 90% of the predicted step, and what bounds the step
    below (each resource alone: the device, the drive, the link, the host's update)."""
    from tiertrain.cost import predict_with
    from tiertrain.cost.report import COMPUTE_BOUND, _terms, knee
    from tiertrain.runtime import Runtime

    cfg = small_config(tmp_path, kind="llama", layers=3, micro_batches=1, slots=2, host_param_mib=0)
    cfg.io.checksum = False
    rt = Runtime(cfg)
    r = _rates(block_fwd_s=0.01, block_bwd_s=0.02, head_s=0.005, read_gbps=0.01, write_gbps=0.01)
    pred = predict_with(cfg, rt, r)
    terms = _terms(pred)
    assert terms["the drive"] > terms["the device's compute"] and terms["the link"] == 0.0
    said = knee(cfg, rt, pred)
    tokens = cfg.data.micro_batch_size * cfg.data.seq_len
    m = int(said.split("(")[1].split(" micro-batches")[0])
    assert said.startswith(f"compute-bound from {m * tokens:,} tokens a step ({m} micro-batches") and m > 1, said
    assert "below that bound by the drive: this run's" in said, said

    def share(k):
        c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, micro_batches=k))
        p = predict_with(c, rt, r)
        return _terms(p)["the device's compute"] / p.step_s

    assert share(m) >= COMPUTE_BOUND > share(m // 2)
    fast = dataclasses.replace(r, read_gbps=1e6, write_gbps=1e6)
    assert knee(cfg, rt, predict_with(cfg, rt, fast)).startswith("compute-bound: this run's")
    slow = dataclasses.replace(r, update_elem_s=1.0)  # the host's update outweighs any batch here
    assert knee(cfg, rt, predict_with(cfg, rt, slow), most=8).startswith(
        f"not compute-bound up to {8 * tokens:,} tokens a step"
    )
    assert "bound by the host's update" in knee(cfg, rt, predict_with(cfg, rt, slow), most=8)


def test_where_the_hosts_update_bounds_the_step_the_plan_says_what_device_states_would_do(tmp_path):
    """Bound by the host's update on a device with memory of its own, the knee line says what
    the step would be with the optimizer's states in device memory (`memory.optim_device_mib`);
    not on CPU, and not where they are there already."""
    from tiertrain.cost import predict_with
    from tiertrain.cost.report import knee
    from tiertrain.device import AsyncCpuDevice
    from tiertrain.runtime import Runtime

    cfg = small_config(tmp_path, kind="llama", layers=3, micro_batches=1, slots=2, host_param_mib=0)
    slow = _rates(block_fwd_s=0.01, block_bwd_s=0.02, head_s=0.005, update_elem_s=1e-3)
    rt = Runtime(cfg, device=AsyncCpuDevice(delay=0.0))
    pred = predict_with(cfg, rt, slow)
    said = knee(cfg, rt, pred, most=8)
    assert "bound by the host's update" in said, said
    hint = said.split("(with the optimizer's ")[1]
    assert "GiB of states in device memory, memory.optim_device_mib=none: " in hint, said
    there = float(hint.split("memory.optim_device_mib=none: ")[1].split(" s predicted")[0])
    assert there < pred.step_s / 10, (there, pred.step_s)
    assert "optim_device_mib" not in knee(cfg, Runtime(cfg), predict_with(cfg, Runtime(cfg), slow), most=8)
    cfg.memory.optim_device_mib = 1
    assert "(with the optimizer's" not in knee(cfg, rt, predict_with(cfg, rt, slow), most=8)
