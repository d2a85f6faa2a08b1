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

    from tiertrain.inference.budget import heap_trim, host_budget
    from tiertrain.runtime import Runtime

    cfg = small_config(tmp_path, kind="llama")
    cfg.memory.host_mib = 300
    rt = Runtime(cfg)
    assert host_budget(cfg) == (300 * MIB, "memory.host_mib = 300")
    trim = heap_trim(cfg, rt, 1000, host_budget(cfg)[0])
    assert trim.limit == 1000 + 300 * MIB - rt.layout.max_unit_numel * 4
    cfg.memory.trim_heap = False
    assert heap_trim(cfg, rt, 1000, 300 * MIB) is None


def test_a_cpu_quota_is_read_from_v1_and_v2_trees(tmp_path):
    from tiertrain.memlimit import cpu_quota

    root = tmp_path / "cg"
    _write(root / "kubepods" / "pod1", "cpu.max", "150000 100000\n")
    _write(root / "kubepods", "cpu.max", "max 100000\n")
    _write(tmp_path, "v2", "0::/kubepods/pod1\n")
    assert cpu_quota(str(tmp_path / "v2"), str(root)) == 1.5
    _write(root / "kubepods" / "pod1", "cpu.max", "max 100000\n")
    assert cpu_quota(str(tmp_path / "v2"), str(root)) is None
    v1 = tmp_path / "v1root"
    _write(v1 / "cpu" / "docker" / "c1", "cpu.cfs_quota_us", "200000")
    _write(v1 / "cpu" / "docker" / "c1", "cpu.cfs_period_us", "100000")
    _write(v1 / "cpu", "cpu.cfs_quota_us", "-1")
    _write(v1 / "cpu", "cpu.cfs_period_us", "100000")
    _write(tmp_path, "v1", "3:cpu,cpuacct:/docker/c1\n9:memory:/docker/c1\n")
    assert cpu_quota(str(tmp_path / "v1"), str(v1)) == 2.0


def test_torchs_threads_fit_the_quota_unless_omp_num_threads_chooses(monkeypatch, caplog):
    import torch

    import tiertrain.runtime as runtime

    was = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(8)
        monkeypatch.setattr(runtime, "affinity_cores", lambda: 8)  # torch's default on an 8-core machine
        monkeypatch.setattr(runtime, "cpu_quota", lambda: 3.5)
        monkeypatch.setattr(runtime, "_QUOTA_SAID", False)
        with caplog.at_level(logging.INFO, logger="tiertrain"):
            assert runtime.fit_threads_to_quota() == 3 and torch.get_num_threads() == 3
        assert "compute threads: 3, the 3.5 cores' worth of this cgroup's CPU quota (torch would take 8" in caplog.text
        torch.set_num_threads(8)
        assert runtime.fit_threads_to_quota(2) == 1  # two ranks of this machine share it
        torch.set_num_threads(2)
        assert runtime.fit_threads_to_quota() is None and torch.get_num_threads() == 2  # never raised
        torch.set_num_threads(5)
        assert runtime.fit_threads_to_quota() is None and torch.get_num_threads() == 5  # the caller's choice
        torch.set_num_threads(8)
        monkeypatch.setenv("OMP_NUM_THREADS", "8")
        assert runtime.fit_threads_to_quota() is None and torch.get_num_threads() == 8
        monkeypatch.setattr(runtime, "cpu_quota", lambda: None)
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert runtime.fit_threads_to_quota() is None and torch.get_num_threads() == 8
    finally:
        torch.set_num_threads(was)


_QUOTA_CHILD = """
import logging, pathlib, sys, torch
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, sys.argv[1])
from reference import small_config
from tiertrain.runtime import Runtime
torch.set_num_threads(2)
Runtime(small_config(pathlib.Path(sys.argv[2]), kind="llama"))
print(torch.get_num_threads())
"""


@pytest.mark.slow
def test_in_a_real_cpu_cgroup_of_one_core_torch_computes_on_one_thread(tmp_path):
    """A v1 or v2 CPU cgroup with a quota of one core (skipped where none can be made)."""
    pid = os.getpid()
    if os.path.isdir("/sys/fs/cgroup/cpu"):
        path = f"/sys/fs/cgroup/cpu/tiertrain-test-{pid}"
        files = {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}
    elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        path, files = f"/sys/fs/cgroup/tiertrain-test-cpu-{pid}", {"cpu.max": "100000 100000"}
    else:
        pytest.skip("no cpu cgroup file system here")
    try:
        os.mkdir(path)
        for name, value in files.items():
            with open(os.path.join(path, name), "w") as f:
                f.write(value)
    except OSError as exc:
        pytest.skip(f"cannot make a cpu cgroup at {path}: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    try:
        r = subprocess.run(
            ["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c", _QUOTA_CHILD,
             os.path.dirname(__file__), str(tmp_path)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.split()[-1] == "1", (r.stdout, r.stderr[-2000:])
        assert "compute threads: 1, the 1.0 cores' worth of this cgroup's CPU quota (torch would take 2" in r.stderr
    finally:
        subprocess.run(["sh", "-c", f"rmdir {path} 2>/dev/null || true"], check=False)


def test_nprocs_fit_check_counts_the_cpu_quota(monkeypatch):
    import tiertrain.ranks_fit as fit

    monkeypatch.setattr(fit, "cpu_quota", lambda: 1.5)
    assert fit._cores() == 1  # 1.5 cores' worth: one rank at most computes without waiting on another
    monkeypatch.setattr(fit, "cpu_quota", lambda: None)
    assert fit._cores() == len(os.sched_getaffinity(0))
