"""One memory budget (memory.host_mib): the fixed pools first, then the states by the step
time a byte saves; explicit *_mib fields as given; never over the budget."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from reference import small_config
from test_parity import assert_parity

from tiertrain.config import ConfigError, load_config
from tiertrain.cost import Rates
from tiertrain.cost.budget import PLANNED, builtin_job, demands, fixed_pools, resolve_budget
from tiertrain.runtime import Runtime
from tiertrain.training.trainer import Trainer

MIB = 1 << 20


def planned_config(tmp_path, host_mib=None, **kw):
    """small_config with every *_mib field left to the budget."""
    cfg = small_config(tmp_path, **kw)
    for f in PLANNED:
        setattr(cfg.memory, f, None)
    cfg.memory.host_mib = host_mib
    return cfg


def rates(**kw):
    base = dict(
        read_gbps=1.0,
        write_gbps=2.0,
        crc_gbps=10.0,
        io_cpu_s_per_gb=0.0,
        embed_fwd_s=0.0,
        embed_bwd_s=0.0,
        block_fwd_s=1e-3,
        block_bwd_s=2e-3,
        head_s=1e-3,
        act_bytes=1 << 20,
        update_elem_s=1e-9,
        cores=2,
        io_slowdown=1.0,
    )
    return Rates(**{**base, **kw})


def _no_probe():
    raise AssertionError("measured although everything fits")


def test_everything_fits_nothing_is_measured(tmp_path):
    cfg = planned_config(tmp_path / "a", layers=4, micro_batches=2)
    rt = Runtime(cfg)
    out, plan = resolve_budget(cfg, rt, _no_probe, lambda: (1 << 20, 0))
    need = demands(cfg, rt, 1 << 20)
    for f in ("host_param_mib", "grad_host_mib", "optim_host_mib", "stash_host_mib", "keep_act_mib"):
        assert getattr(out.memory, f) * MIB == need[f] > 0, f
    assert out.memory.residual_host_mib == 0  # no error feedback: nothing to hold
    assert plan.host_used <= plan.host_bytes and "half of the" in plan.host_source


def test_a_tight_budget_goes_to_what_saves_most_per_byte(tmp_path):
    """Parameters save 3 reads + 1 write per byte (fp32), the others 1 + 1: parameters first,
    the rest to the next in rank; the order follows the measured rates."""
    cfg = planned_config(tmp_path / "a", layers=6, d=128, micro_batches=2)
    rt = Runtime(cfg)
    fixed = sum(fixed_pools(cfg, rt, 1 << 20).values())
    need = demands(cfg, rt, 1 << 20)
    cfg.memory.host_mib = (fixed + need["host_param_mib"] + need["grad_host_mib"] // 2) // MIB
    calls = []
    slow_recompute = rates(block_fwd_s=1e-9)  # kept activations save next to nothing
    out, plan = resolve_budget(cfg, rt, lambda: calls.append(1) or slow_recompute, lambda: (1 << 20, 0))
    assert calls == [1]  # measured once, since not everything fits
    m = out.memory
    assert m.host_param_mib * MIB == need["host_param_mib"]
    assert 0 < m.grad_host_mib * MIB < need["grad_host_mib"]  # tie between equal ranks: in field order
    assert m.optim_host_mib == m.stash_host_mib == m.keep_act_mib == 0
    assert plan.host_used <= plan.host_bytes
    # with a cheap recompute ranked below I/O, but an expensive one above everything
    out2, _ = resolve_budget(cfg, rt, lambda: rates(block_fwd_s=10.0), lambda: (1 << 20, 0))
    assert out2.memory.keep_act_mib == min(need["keep_act_mib"], cfg.memory.host_mib * MIB - fixed) // MIB
    assert out2.memory.host_param_mib == 0


def test_explicit_fields_are_taken_as_given_and_counted(tmp_path):
    cfg = planned_config(tmp_path / "a", layers=4, micro_batches=2)
    cfg.memory.optim_host_mib = 0  # the expert keeps the moments on the SSD
    rt = Runtime(cfg)
    out, plan = resolve_budget(cfg, rt, _no_probe, lambda: (1 << 20, 0))
    assert out.memory.optim_host_mib == 0 and "optim_host_mib" not in plan.planned
    cfg.memory.host_mib = 1
    with pytest.raises(
        ConfigError,
        match=r"memory.host_mib: the budget \(1 MiB, memory.host_mib\) is less than the "
        r"fixed pools",
    ):
        resolve_budget(cfg, rt, _no_probe, lambda: (1 << 20, 0))


def test_planned_run_is_bit_identical_and_keeps_the_user_config(tmp_path):
    """Placement changes where states live, never the math; checkpoints keep the config as
    given, so a resumed run plans its memory again."""
    cfg = planned_config(tmp_path, kind="llama", layers=3, micro_batches=2, steps=3)
    cfg.memory.host_mib = 200
    tr, _ = assert_parity(cfg)
    assert tr.budget.host_used <= 200 * MIB
    assert 0 < tr.cfg.memory.host_param_mib and tr.user_cfg.memory.host_param_mib is None


_CHILD = r"""
import json, pathlib, sys
sys.path.insert(0, sys.argv[2])
from test_budget import planned_config
from tiertrain.device import host_rss, host_peak_rss, reset_peak_rss
from tiertrain.training.trainer import Trainer
cfg = planned_config(pathlib.Path(sys.argv[1]), host_mib=int(sys.argv[3]), layers=8, d=512, heads=8, micro_batches=2,
                     steps=2, update_kib=1024)
base = host_rss()
if not reset_peak_rss():
    print(json.dumps({"unsupported": "cannot reset the peak RSS"})); sys.exit(0)
with Trainer(cfg) as tr:
    tr.initialize(progress=False)
    for _ in range(2):
        tr.train_step()
    print(json.dumps(dict(growth=host_peak_rss() - base, pools=sum(tr.pool_bytes.values()), used=tr.budget.host_used,
                          unit=tr.layout.max_unit_numel * 4, given={f: getattr(tr.cfg.memory, f) for f in
                          ("host_param_mib", "grad_host_mib", "optim_host_mib", "stash_host_mib", "keep_act_mib")})))
"""


@pytest.mark.slow
@pytest.mark.parametrize("host_mib", [300])
def test_the_budget_is_never_exceeded(tmp_path, host_mib):
    """A 25 M-parameter model (~400 MiB of states) under 300 MiB (measured here also at 500): the pools and placed
    states stay within the budget, and the process (from before the Trainer) grows by at most
    the budget, whose fixed part reserves the working set (4 units, two micro-batches'
    activations, 128 MiB of slack)."""
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), os.path.dirname(__file__), str(host_mib)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "unsupported" in out:
        pytest.skip(out["unsupported"])
    assert out["used"] <= host_mib * MIB
    assert out["pools"] <= host_mib * MIB, (out["pools"] / MIB, out["given"])
    assert out["growth"] <= host_mib * MIB, (out["growth"] / MIB, out["pools"] / MIB, out["given"])
    assert sum(out["given"].values()) <= host_mib  # what was placed, in MiB, before the pools


@pytest.mark.slow
def test_the_builtin_job_streams_its_states_and_says_so(tmp_path):
    """The built-in default job (``tiertrain train`` with no arguments) would fit whole in half
    the memory; its budget is its fixed pools and a quarter of its states, so the rest streams
    from the storage tier and its first run shows the tiers at work. A model of one's own, or
    data of one's own, keeps half the memory available."""
    cfg = load_config(None, [f"--io.paths={tmp_path / 'ssd'}", f"--train.run_dir={tmp_path / 'run'}"])
    assert builtin_job(cfg)
    rt = Runtime(cfg)
    out, plan = resolve_budget(cfg, rt, lambda: rates(), lambda: (1 << 20, 0))
    states = sum(demands(cfg, rt, 1 << 20).values())
    assert plan.host_bytes == (sum(plan.fixed.values()) + states // 4) // MIB * MIB
    assert "the built-in default job's: its fixed pools and a quarter of its states" in plan.host_source
    assert str(tmp_path / "ssd") in plan.host_source and "set memory.host_mib to choose" in plan.host_source
    held = sum(getattr(out.memory, f) * MIB for f in plan.demand)
    assert 0 < held <= states // 4 < states  # three quarters of its states on the storage tier
    assert plan.host_used <= plan.host_bytes
    # a training step holds initialisation's working set: no room of it goes to kept activations
    assert plan.step_working == plan.fixed["working set"] and plan.shared_acts == 0
    (tmp_path / "x.txt").write_text("some text of one's own\n" * 100)
    for flag in ("--model.n_layers=2", f"--data.corpus={tmp_path / 'x.txt'}", "--adapter.kind=lora"):
        other = load_config(None, [f"--io.paths={tmp_path / 'ssd'}", flag])
        assert not builtin_job(other), flag
    cfg.memory.host_mib = 4096  # a budget given is the budget
    _, plan = resolve_budget(cfg, rt, lambda: rates(), lambda: (1 << 20, 0))
    assert plan.host_bytes == 4096 * MIB and plan.host_source == "memory.host_mib"


def test_the_default_job_plans_its_memory_and_says_so(tmp_path):
    """No *_mib flag on a model of one's own: the budget is half the available memory, this
    small model fits, so every state is in memory and the step touches no SSD; the plan is
    printed."""
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiertrain.cli",
            "train",
            f"--io.paths={tmp_path / 'ssd'}",
            f"--train.run_dir={run}",
            "--train.steps=2",
            "--model.n_layers=2",
            "--model.d_model=64",
            "--data.seq_len=32",
            "--train.progress=false",
            "--train.predict=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "host memory budget" in r.stderr and "(half of the" in r.stderr
    assert "parameters: " in r.stderr and "(memory.host_param_mib, planned)" in r.stderr
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(d["ssd_read_bytes"] == 0 and d["ssd_write_bytes"] == 0 for d in lines)


@pytest.mark.slow
@pytest.mark.parametrize("paths", [1, 3])
def test_engines_processes_are_counted_in_the_fixed_part(tmp_path, paths):
    """The engines' shared slots (mapped by the trainer too), their buffers and interpreters
    are part of the budget: a 2.4 B model's engines run took 1.8 GiB outside it before."""
    from tiertrain.update.engines.costs import ENGINE_PROCESS

    cfg = small_config(tmp_path, paths=paths)
    cfg.update.mode = "engines"
    with Trainer(cfg) as tr:
        fixed = fixed_pools(tr.cfg, tr.rt)
        assert fixed["engine slots (shared)"] == tr.update.pools()["engine slots (shared memory)"]
        assert fixed["engine interpreters"] == paths * ENGINE_PROCESS and "update buffers" not in fixed
        assert fixed["engine buffers"] >= paths * 3 * (cfg.memory.update_buffer_kib << 10)


@pytest.mark.parametrize("optim,dtype", [("adamw", "float32"), ("adamw8bit", "bfloat16")])
def test_the_overlapped_update_needs_the_baselines_fixed_memory(tmp_path, optim, dtype):
    """update.mode = overlap runs the baseline's streamed optimizer in a thread: its three
    buffer sets, no engine process, nothing more. A set is memory.update_buffer_kib, or one
    aligned chunk (whole checksum blocks of every state file) where that is more: counted as
    the setting alone, the budget undercounted (64 KiB here, 256 KiB a set in fp32 and 896 KiB
    with 8-bit states in bf16)."""
    cfg = small_config(tmp_path)
    cfg.update.mode, cfg.optim.name, cfg.train.param_dtype = "overlap", optim, dtype
    with Trainer(cfg) as tr:
        fixed = fixed_pools(tr.cfg, tr.rt)
        assert fixed["update buffers"] == sum(s.nbytes for s in tr.update.optim.sets)
        assert fixed["update buffers"] > 3 * (cfg.memory.update_buffer_kib << 10)
        assert fixed["update buffers"] <= tr.update.pools()["update buffers + host states"]
        assert not any(k.startswith("engine") for k in fixed)
    base = small_config(tmp_path / "b")
    base.optim.name, base.train.param_dtype = optim, dtype
    assert fixed_pools(base, tr.rt) == fixed


def test_the_activation_record_pool_is_fixed_only_when_pairs_are_left_for_the_storage_tier(tmp_path):
    """memory.activations = auto: where the keep budget holds every pair nothing goes to the
    storage tier and no record pool is set aside; where it does not, memory.act_buffers
    records of the measured size are a fixed pool, counted before anything is placed."""
    cfg = planned_config(tmp_path / "a", layers=4, micro_batches=2, activations="auto")
    rt = Runtime(cfg)
    act, record = 1 << 20, 3 << 20
    _, plan = resolve_budget(cfg, rt, _no_probe, lambda: (act, record))
    assert "activation records" not in plan.fixed and plan.record_bytes == record
    tight = sum(fixed_pools(cfg, rt, act, record).values()) + demands(cfg, rt, act)["host_param_mib"]
    cfg.memory.host_mib = tight // MIB + 2  # less than the 8 MiB of kept activations
    out, plan = resolve_budget(cfg, rt, lambda: rates(), lambda: (act, record))
    assert plan.fixed["activation records"] == cfg.memory.act_buffers * record
    assert out.memory.keep_act_mib * MIB < demands(cfg, rt, act)["keep_act_mib"]
    assert plan.host_used <= plan.host_bytes
    cfg.memory.activations = "keep"  # recompute what is not kept: no pool
    _, plan = resolve_budget(cfg, rt, lambda: rates(), lambda: (act, record))
    assert "activation records" not in plan.fixed


def test_no_room_for_the_record_pool_recomputes_under_auto_and_is_refused_under_offload(tmp_path):
    cfg = planned_config(tmp_path / "a", layers=4, micro_batches=2, activations="auto")
    rt = Runtime(cfg)
    act, record = 32 << 20, 64 << 20  # kept: 256 MiB wanted; the pool of 3 records: 192 MiB
    fixed = sum(fixed_pools(cfg, rt, act).values())
    cfg.memory.host_mib = fixed // MIB + 100  # room for the fixed pools, not for the records
    out, plan = resolve_budget(cfg, rt, lambda: rates(), lambda: (act, record))
    assert plan.record_bytes == 0 and "activation records" not in plan.fixed
    assert any("no room in the budget for 3 records of 64 MiB" in line for line in plan.lines())
    assert plan.host_used <= plan.host_bytes
    cfg.memory.activations = "offload"
    with pytest.raises(ConfigError, match=r"memory.host_mib: the budget .* is less than the fixed pools"):
        resolve_budget(cfg, rt, lambda: rates(), lambda: (act, record))


def test_a_budget_below_the_default_buffers_lowers_them_and_says_so(tmp_path):
    """Request and update buffers at their defaults (16 MiB, 3 x 32 MiB) are lowered, down to
    4 MiB and 3 x 8 MiB, where the fixed pools would not fit otherwise, and then the parameter
    slots from 3 to 2; a value the user set is kept, and then the budget is refused as before."""
    cfg = planned_config(tmp_path / "a", layers=2, d=512, heads=8, micro_batches=2, activations="keep")
    cfg.io.chunk_kib, cfg.memory.update_buffer_kib = 16384, 32768  # the defaults
    rt = Runtime(cfg)
    at_default = sum(fixed_pools(cfg, rt, 1 << 20).values())
    small = dataclasses.replace(
        cfg,
        io=dataclasses.replace(cfg.io, chunk_kib=4096),
        memory=dataclasses.replace(cfg.memory, update_buffer_kib=8192),
    )
    at_floor = sum(fixed_pools(small, rt, 1 << 20).values())
    assert at_default - at_floor == (4 * 12 + 2 * 12 + 3 * 24) * MIB  # 1 path: I/O 4, checkpoint 2 chunks; 3 sets
    cfg.memory.host_mib = (at_floor + at_default) // 2 // MIB  # halved once is enough
    out, plan = resolve_budget(cfg, rt, lambda: rates(), lambda: (1 << 20, 0))
    assert (out.io.chunk_kib, out.memory.update_buffer_kib) == (8192, 16384)
    assert plan.host_used <= plan.host_bytes
    cfg.memory.host_mib = at_floor // MIB + 2  # only the smallest fit
    out, plan = resolve_budget(cfg, rt, lambda: rates(), lambda: (1 << 20, 0))
    assert (out.io.chunk_kib, out.memory.update_buffer_kib) == (4096, 8192)
    assert plan.host_used <= plan.host_bytes
    assert any(
        "io.chunk_kib 16384 -> 4096 KiB, memory.update_buffer_kib 32768 -> 8192 KiB" in line for line in plan.lines()
    )
    cfg.memory.host_mib = at_default // MIB + 64  # fits at the defaults: nothing lowered
    out, plan = resolve_budget(cfg, rt, lambda: rates(), lambda: (1 << 20, 0))
    assert (out.io.chunk_kib, out.memory.update_buffer_kib) == (16384, 32768)
    assert not any("lowered" in line for line in plan.lines())
    # below the lowered buffers' pools: then (only then) the parameter slots, 3 -> 2
    two = dataclasses.replace(small, memory=dataclasses.replace(small.memory, device_slots=2))
    at_two = sum(fixed_pools(two, rt, 1 << 20).values())
    assert at_floor - at_two == rt.layout.max_unit_numel * 4 > 2 * MIB  # a slot
    cfg.memory.host_mib = (at_floor - 1) // MIB
    assert cfg.memory.host_mib * MIB >= at_two
    out, plan = resolve_budget(cfg, rt, lambda: rates(), lambda: (1 << 20, 0))
    assert (out.io.chunk_kib, out.memory.update_buffer_kib, out.memory.device_slots) == (4096, 8192, 2)
    assert any(
        "memory.update_buffer_kib 32768 -> 8192 KiB, memory.device_slots 3 -> 2 slots" in x for x in plan.lines()
    )
    cfg.memory.host_mib = at_two // MIB - 1  # below even the lowered pools
    with pytest.raises(ConfigError, match=r"memory.host_mib: the budget .* is less than the fixed pools"):
        resolve_budget(cfg, rt, lambda: rates(), lambda: (1 << 20, 0))
    cfg.memory.host_mib = at_two // MIB + 2
    cfg.io.chunk_kib = 8192  # set by the user: kept; the update buffers and slots alone do not make room
    with pytest.raises(ConfigError, match=r"less than the fixed pools"):
        resolve_budget(cfg, rt, lambda: rates(), lambda: (1 << 20, 0))
    cfg.io.chunk_kib, cfg.memory.device_slots = 16384, 4  # slots set by the user: kept
    cfg.memory.host_mib = at_floor // MIB - 1
    with pytest.raises(ConfigError, match=r"less than the fixed pools"):
        resolve_budget(cfg, rt, lambda: rates(), lambda: (1 << 20, 0))


def test_a_trainer_with_lowered_buffers_opens_its_storage_with_them(tmp_path):
    cfg = planned_config(tmp_path / "a", layers=2, micro_batches=1, steps=1, activations="keep")
    cfg.io.chunk_kib, cfg.memory.update_buffer_kib = 16384, 32768
    rt = Runtime(cfg)
    at_default = sum(fixed_pools(cfg, rt, 1 << 20).values())
    rt.close()
    cfg.memory.host_mib = at_default // MIB - 100
    with Trainer(cfg) as tr:
        assert tr.cfg.io.chunk_kib < 16384
        assert tr.storage.workers[0].chunk_bytes == tr.cfg.io.chunk_kib << 10
        tr.initialize(progress=False)
        tr.train_step()


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_the_planned_pairs_are_the_pairs_a_step_keeps_with_document_attention(tmp_path, kind):
    """Examples packed with attention within each document: the steps' blocks save a mask the
    dry run (plain positions) did not build, and the plan said 4 of 4 pairs kept where every step
    kept 3 and recomputed 1."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"text": "In the beginning God created the heaven. " * (1 + i % 3)}) + "\n" for i in range(64)
        )
    )
    flags = [f"--model.kind={kind}", "--model.n_layers=2", "--model.d_model=64", f"--data.corpus={rows}"]
    flags += ["--data.seq_len=128", "--data.micro_batches=2", f"--io.paths={tmp_path / 'ssd'}"]
    cfg = load_config(None, [*flags, f"--train.run_dir={tmp_path / 'run'}", "--train.predict=false"])
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        assert tr.acts.kept == 4, tr.acts  # the whole demand fits the default budget
        rec = tr.train_step()
    assert (rec.extra["act_kept"], rec.extra["act_recomputed"]) == (4, 0), rec.extra


def test_a_budget_below_the_fixed_pools_is_refused_before_the_machine_is_measured(tmp_path, capsys, monkeypatch):
    """`tiertrain plan` of a 70 B shape ran a block's dry run and the probes (6 min 50 s) before
    refusing a budget below its fixed pools; the least budget that would run is given (its
    layers cut into 4 sub-layer units, the most the planner cuts: whole, they need 20 GiB more)."""
    import re

    import tiertrain.cost as cost
    import tiertrain.cost.probe as probe
    from tiertrain.cli import main

    def measured(*args, **kwargs):
        raise AssertionError("the machine was measured")

    for module, name in ((probe, "probe_acts"), (probe, "probe_compute"), (cost, "measure_rates")):
        monkeypatch.setattr(module, name, measured)
    shape = ["--model.kind=llama", "--model.n_layers=80", "--model.d_model=8192", "--model.n_heads=64"]
    shape += ["--model.n_kv_heads=8", "--model.d_ff=28672", "--model.vocab_size=128256"]
    assert main(["plan", *shape, "--memory.host_mib=4096", f"--io.paths={tmp_path / 'ssd'}"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "memory.host_mib: the budget (4,096 MiB, memory.host_mib) is less than the fixed pools" in line, line
    low, about, least = (int(x.replace(",", "")) for x in re.search(
        r"\(([\d,]+) MiB before any activations, about ([\d,]+) MiB with a micro-batch's, estimated\); raise "
        r"memory.host_mib to about ([\d,]+) ", line).groups())  # fmt: skip
    assert 5_000 < low < about == least < low * 1.1, line
