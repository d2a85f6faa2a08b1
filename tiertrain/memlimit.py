"""The host memory this process may still take: the machine's available memory, or less where a
memory cgroup limits it (a container's ``--memory``, a Kubernetes limit, a Slurm job's
``--mem``, systemd's ``MemoryMax``).

``psutil.virtual_memory().available`` is the machine's: in a 2 GiB container on a 24 GiB host it
says about 20 GiB, and a budget taken from it has the kernel kill the run (SIGKILL: no
checkpoint, no message) once it grows past the container's limit. The cgroup's own figures are
read from ``/proc/self/cgroup`` and the cgroup file system: cgroup v2 (``memory.max``,
``memory.current``; every ancestor's ``memory.max`` counts) and v1 (``memory.stat``'s
``hierarchical_memory_limit``, ``memory.usage_in_bytes``). What the cgroup holds now is its
charge less the inactive page cache, which the kernel reclaims before it kills anything (the
working set, as Kubernetes counts it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

__all__ = ["CgroupMemory", "cgroup_memory", "available_memory"]

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


def _v2(root: str, rel: str) -> CgroupMemory | None:
    """The tightest ``memory.max`` from the process's cgroup up to the mount's root."""
    here = os.path.normpath(os.path.join(root, rel.lstrip("/")))
    best: CgroupMemory | None = None
    path = here
    while True:
        limit = _read(os.path.join(path, "memory.max"))
        current = _read(os.path.join(path, "memory.current"))
        if limit and limit != "max" and limit.isdigit() and current and current.isdigit():
            used = int(current) - _stat(path).get("inactive_file", 0)
            cand = CgroupMemory(int(limit), max(0, used), path)
            if best is None or cand.free < best.free:
                best = cand
        if os.path.normpath(path) == os.path.normpath(root):
            return best
        parent = os.path.dirname(path)
        if parent == path:
            return best
        path = parent


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
            inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
            return CgroupMemory(limit, max(0, int(usage) - inactive), path)
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


def available_memory() -> tuple[int, str]:
    """(bytes this process may still take, where that figure comes from, in words)."""
    avail = psutil.virtual_memory().available
    cg = cgroup_memory()
    if cg is not None and cg.free < avail:
        return cg.free, (
            f"available now within its memory cgroup's limit of {cg.limit / 2**30:.1f} GiB ({cg.where}; "
            f"{cg.used / 2**30:.2f} GiB held)"
        )
    return avail, "available now"
