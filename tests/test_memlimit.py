"""A memory cgroup's limit (a container's, a Slurm job's) bounds the default budget and refuses a
budget over it, where the machine's available memory would not (``tiertrain/memlimit.py``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tiertrain.config import ConfigError
from tiertrain.cost import budget
from tiertrain.memlimit import CgroupMemory, available_memory, cgroup_memory

MIB = 1 << 20


def _write(path, name, text):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, name), "w") as f:
        f.write(text)


def test_a_v2_cgroup_gives_its_tightest_ancestor_less_inactive_page_cache(tmp_path):
    root = tmp_path / "cg"
    job = root / "slurm" / "job7"
    _write(root / "slurm", "memory.max", str(8 << 30))
    _write(root / "slurm", "memory.current", str(1 << 30))
    _write(job, "memory.max", str(2 << 30))
    _write(job, "memory.current", str(900 * MIB))
    _write(job, "memory.stat", f"anon {600 * MIB}\ninactive_file {300 * MIB}\n")
    _write(tmp_path, "cgroup", "0::/slurm/job7\n")
    cg = cgroup_memory(str(tmp_path / "cgroup"), str(root))
    assert cg == CgroupMemory(2 << 30, 600 * MIB, str(job)) and cg.free == (2 << 30) - 600 * MIB
    _write(job, "memory.max", "max")  # unlimited here: the parent's limit holds
    assert cgroup_memory(str(tmp_path / "cgroup"), str(root)).limit == 8 << 30
    _write(root / "slurm", "memory.max", "max")
    assert cgroup_memory(str(tmp_path / "cgroup"), str(root)) is None


def test_a_v1_cgroup_gives_its_hierarchical_limit_and_no_limit_is_none(tmp_path):
    root = tmp_path / "cg"
    mem = root / "memory" / "docker" / "abc"
    _write(mem, "memory.usage_in_bytes", str(500 * MIB))
    _write(mem, "memory.stat", f"total_inactive_file {100 * MIB}\nhierarchical_memory_limit {1 << 30}\n")
    _write(tmp_path, "cgroup", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    cg = cgroup_memory(str(tmp_path / "cgroup"), str(root))
    assert cg == CgroupMemory(1 << 30, 400 * MIB, str(mem))
    _write(mem, "memory.stat", f"hierarchical_memory_limit {9223372036854771712}\n")
    assert cgroup_memory(str(tmp_path / "cgroup"), str(root)) is None
    assert cgroup_memory(str(tmp_path / "missing"), str(root)) is None


def test_the_default_budget_and_a_given_one_follow_the_cgroup(monkeypatch, caplog):
    """Half of what the limit leaves, said; a budget that with what the cgroup holds passes the
    limit is refused with the figure that fits; one within 10% of it is warned about."""
    import tiertrain.memlimit as memlimit

    cg = CgroupMemory(2048 * MIB, 448 * MIB, "/sys/fs/cgroup/job")
    monkeypatch.setattr(memlimit, "cgroup_memory", lambda: cg)
    monkeypatch.setattr(budget, "cgroup_memory", lambda: cg)
    host, where = budget.default_host_bytes()
    assert (
        host == 800 * MIB and "half of the 1.6 GiB available now within its memory cgroup's limit of 2.0 GiB" in where
    )
    assert available_memory()[0] == 1600 * MIB
    with pytest.raises(ConfigError, match=r"memory.host_mib = 1,700 MiB and the 448 MiB its memory cgroup holds "
                       r"already .* exceed the cgroup's limit of 2,048 MiB \(/sys/fs/cgroup/job\).* at most 1,395"):  # fmt: skip
        budget.warn_above_available(1700 * MIB)
    with caplog.at_level(logging.WARNING, logger="tiertrain"):
        budget.warn_above_available(1500 * MIB)
        assert "within 10% of the cgroup's limit" in caplog.text and "memory.host_mib = 1,395 keeps" in caplog.text
        caplog.clear()
        budget.warn_above_available(1395 * MIB)
        assert caplog.text == ""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks of this machine in the same cgroup
    with pytest.raises(ConfigError, match=r"for each of this machine's 2 ranks .* at most 697"):
        budget.warn_above_available(1000 * MIB)


@pytest.mark.slow
def test_a_run_in_a_small_memory_cgroup_plans_within_it_and_a_budget_over_it_is_refused(tmp_path):
    """In a real 1 GiB cgroup (v1 or v2; skipped where none can be made): with no budget given,
    the run plans half of what the limit leaves and finishes; a budget over the limit is
    refused at start by name, before anything is probed or written."""
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1):
        path, knob, value = os.path.join(v1, f"tiertrain-test-{os.getpid()}"), "memory.limit_in_bytes", str(1 << 30)
    elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        path, knob, value = f"/sys/fs/cgroup/tiertrain-test-{os.getpid()}", "memory.max", str(1 << 30)
    else:
        pytest.skip("no memory cgroup file system here")
    try:
        os.mkdir(path)
        with open(os.path.join(path, knob), "w") as f:
            f.write(value)
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup at {path}: {exc}")
    corpus = tmp_path / "text.txt"
    corpus.write_text("a corpus of one's own, so that the budget is the default's half\n" * 200)
    enter = f'echo $$ > {path}/cgroup.procs && exec "$@"'
    base = [sys.executable, "-m", "tiertrain", "train", f"--io.paths={tmp_path / 'ssd'}", f"--data.corpus={corpus}",
            "--model.n_layers=2", "--model.d_model=64", "--train.steps=2"]  # fmt: skip
    try:
        ok = subprocess.run(["sh", "-c", enter, "sh", *base, f"--train.run_dir={tmp_path / 'a'}"],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
        assert ok.returncode == 0, ok.stderr[-3000:]
        assert "within its memory cgroup's limit of 1.0 GiB" in ok.stderr, ok.stderr[-3000:]
        bad = subprocess.run(["sh", "-c", enter, "sh", *base, "--memory.host_mib=4096", f"--train.run_dir={tmp_path / 'b'}"],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
        assert "exceed the cgroup's limit of 1,024 MiB" in bad.stderr and "probing" not in bad.stderr, bad.stderr[
            -3000:
        ]
    finally:
        subprocess.run(["sh", "-c", f"rmdir {path} 2>/dev/null || true"], check=False)


def test_generation_gives_the_heap_back_past_its_budget(tmp_path):
    """Generation and evaluation trim the heap after a unit once the process has grown past its start and
    budget less a unit (as training does): the transient tensors of a pass stay in glibc's
    heap otherwise (measured 0.5 GB over a 1 GiB budget on a 1.2 B NF4 base)."""
    from reference import small_config

    from tiertrain.inference.weights import heap_trim as _heap_trim
    from tiertrain.runtime import Runtime

    cfg = small_config(tmp_path, kind="llama")
    cfg.memory.host_mib = 300
    rt = Runtime(cfg)
    trim = _heap_trim(cfg, rt, 1000)
    assert trim.limit == 1000 + 300 * MIB - rt.layout.max_unit_numel * 4
    cfg.memory.trim_heap = False
    assert _heap_trim(cfg, rt, 1000) is None
