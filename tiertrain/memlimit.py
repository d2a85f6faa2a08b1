"""The host memory this process may still take, and the cores it may compute on: the machine's,
or less where a cgroup limits them. Memory: the machine's available memory, or less where a
memory cgroup limits it (a container's ``--memory``, a Kubernetes limit, a Slurm job's
``--mem``, systemd's ``MemoryMax``).

``psutil.virtual_memory().available`` is the machine's: in a 2 GiB container on a 24 GiB host it
says about 20 GiB, and a budget taken from it has the kernel kill the run (SIGKILL: no
checkpoint, no message) once it grows past the container's limit. The cgroup's own figures are
read from ``/proc/self/cgroup`` and the cgroup file system: cgroup v2 (``memory.max``,
``memory.current``; every ancestor's ``memory.max`` counts) and v1 (``memory.stat``'s
``hierarchical_memory_limit``, ``memory.usage_in_bytes``). What the cgroup holds now is its
charge less its clean page cache (file pages neither dirty nor under writeback), which the
kernel reclaims before it kills anything.

Cores: a CPU quota (``docker --cpus``, a Kubernetes CPU limit; cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) leaves the affinity mask, and so torch's default
thread count, at the machine's cores: 64 threads sharing 2 cores' worth of time are throttled
in turn at every matrix product. ``cpu_quota`` says how many cores' worth the quota gives.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import psutil

__all__ = ["CgroupMemory", "cgroup_memory", "available_memory", "cpu_quota", "affinity_cores"]

_UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class CgroupMemory:
    """A memory cgroup's limit and what it holds now (bytes), and the directory read."""

    limit: int
    used: int
    where: str

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(path: str) -> dict[str, int]:
    text = _read(os.path.join(path, "memory.stat")) or ""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _v2_memory(path: str) -> CgroupMemory | None:
    limit, current = _read(os.path.join(path, "memory.max")), _read(os.path.join(path, "memory.current"))
    if not (limit and limit.isdigit() and current and current.isdigit()):
        return None  # "max": no limit here
    st = _stat(path)  # clean file pages are reclaimed before anything is killed
    clean = st.get("file", st.get("inactive_file", 0)) - st.get("file_dirty", 0) - st.get("file_writeback", 0)
    return CgroupMemory(int(limit), max(0, int(current) - max(0, clean)), path)


def _v2(root: str, rel: str) -> CgroupMemory | None:
    """The tightest ``memory.max`` from the process's cgroup up to the mount's root."""
    return _walk(root, rel, _v2_memory, key=lambda m: m.free)


def _v1(root: str, rel: str) -> CgroupMemory | None:
    for path in (os.path.join(root, "memory", rel.lstrip("/")), os.path.join(root, "memory")):
        stat = _stat(path)
        usage = _read(os.path.join(path, "memory.usage_in_bytes"))
        limit = stat.get("hierarchical_memory_limit")
        if limit is None:
            raw = _read(os.path.join(path, "memory.limit_in_bytes"))
            limit = int(raw) if raw and raw.isdigit() else None
        if limit is not None and usage and usage.isdigit():
            if limit >= _UNLIMITED:
                return None
            clean = stat.get("total_active_file", stat.get("active_file", 0)) + stat.get(
                "total_inactive_file", stat.get("inactive_file", 0)
            )  # clean file pages are reclaimed before anything is killed
            clean -= stat.get("total_dirty", stat.get("dirty", 0)) + stat.get(
                "total_writeback", stat.get("writeback", 0)
            )
            return CgroupMemory(limit, max(0, int(usage) - max(0, clean)), path)
    return None


def cgroup_memory(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> CgroupMemory | None:
    """The memory cgroup limiting this process (``proc``: its cgroup list; ``root``: where the
    cgroup file system is mounted), or None where none does (or none can be read)."""
    text = _read(proc)
    if text is None:
        return None
    for line in text.splitlines():
        hid, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            found = _v1(root, rel)
            if found is not None:
                return found
        if hid == "0" and controllers == "":
            found = _v2(root, rel)
            if found is not None:
                return found
    return None


_COLLECTED = float("-inf")


def available_memory() -> tuple[int, str]:
    """(bytes this process may still take, where that figure comes from, in words). What an
    earlier run of this process left to the cycle collector (a closed Trainer's parts hold each
    other) is collected first: a budget sized without it took half of what that run still held."""
    global _COLLECTED
    if time.monotonic() - _COLLECTED > 5:  # (once a plan: it asks several times, 80 ms a collection)
        gc.collect()
        _COLLECTED = time.monotonic()
    avail = psutil.virtual_memory().available
    cg = cgroup_memory()
    if cg is not None and cg.free < avail:
        return cg.free, (
            f"available now within its memory cgroup's limit of {cg.limit / 2**30:.1f} GiB ({cg.where}; "
            f"{cg.used / 2**30:.2f} GiB held)"
        )
    return avail, "available now"


def cpu_quota(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """Cores' worth of CPU time a cgroup's quota gives this process (the tightest from its cgroup
    up to the mount's root), or None where none limits it."""
    text = _read(proc)
    if text is None:
        return None
    best: float | None = None
    for line in text.splitlines():
        hid, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if "cpu" in controllers.split(","):
            for base in (os.path.join(root, "cpu"), os.path.join(root, "cpu,cpuacct")):
                q = _walk(base, rel, _v1_quota)
                if q is not None:
                    best = q if best is None else min(best, q)
                    break
        elif hid == "0" and controllers == "":
            q = _walk(root, rel, _v2_quota)
            if q is not None:
                best = q if best is None else min(best, q)
    return best


def _v1_quota(path: str) -> float | None:
    quota, period = _read(os.path.join(path, "cpu.cfs_quota_us")), _read(os.path.join(path, "cpu.cfs_period_us"))
    if quota and period and quota.lstrip("-").isdigit() and period.isdigit() and int(quota) > 0 < int(period):
        return int(quota) / int(period)
    return None


def _v2_quota(path: str) -> float | None:
    text = _read(os.path.join(path, "cpu.max"))
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota.isdigit() and period.strip().isdigit() and int(period) > 0:
        return int(quota) / int(period)
    return None


def _walk(root: str, rel: str, read, key=lambda x: x):
    """The least (by ``key``) of ``read(dir)`` from ``root/rel`` up to ``root`` (None where no
    directory has one: every ancestor's limit applies, the tightest binds)."""
    if not os.path.isdir(root):
        return None
    path, best = os.path.normpath(os.path.join(root, rel.lstrip("/"))), None
    while True:
        found = read(path)
        if found is not None and (best is None or key(found) < key(best)):
            best = found
        if path == os.path.normpath(root) or os.path.dirname(path) == path:
            return best
        path = os.path.dirname(path)


def affinity_cores() -> int:
    """The cores this process may run on (a container's cpuset, a taskset's): torch's default
    thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
