"""Whether ``train --nproc N`` fits this machine, checked before any rank starts (64 ranks on 2
cores started, each importing torch, and failed or crawled): a core per rank at least, and the
memory of every rank's process and budget. Without torch: the launcher never imports it."""

from __future__ import annotations

from .errors import ConfigError, UsageError
from .memlimit import affinity_cores, available_memory, cpu_quota

__all__ = ["check_ranks_fit", "RANK_PROCESS_MIB", "LAUNCHER_MIB"]

# A rank's process before any state: the interpreter, torch, transformers and tiertrain imported
# (measured 342 MiB on CPU with transformers' model code, 225 without), its I/O threads' arenas;
# the least a rank needs whatever its budget. The launcher's own process beside them (measured
# 224 MiB: it imports torch's launcher). Found from outside: 256 a rank and no launcher counted
# 1,512 MiB where the ranks took 1,925.
RANK_PROCESS_MIB = 384
LAUNCHER_MIB = 256


def _cores() -> int:
    cores = affinity_cores()
    quota = cpu_quota()  # a CPU quota (docker --cpus) leaves the affinity at the machine's cores
    return cores if quota is None else max(1, min(cores, int(quota)))


def check_ranks_fit(nproc: int, host_mib: int | None) -> None:
    """Refuse ``nproc`` ranks (``host_mib``: each rank's ``memory.host_mib``, None: a share of
    the available memory) where this machine has fewer cores, or less memory available than
    their processes and budgets take."""
    cores = _cores()
    if nproc > cores:
        raise UsageError(
            f"--nproc {nproc}: this machine has {cores} cores for this process; each rank computes on one at "
            f"least (ranks sharing a core wait on each other at every collective): use --nproc {cores} or fewer"
        )
    each = RANK_PROCESS_MIB + (host_mib or 0)
    avail_bytes, where = available_memory()  # a container's limit, where tighter than the machine
    avail = avail_bytes >> 20
    if LAUNCHER_MIB + nproc * each > avail:
        budget = f" and memory.host_mib = {host_mib:,} MiB" if host_mib else ""
        fit = max(1, (avail - LAUNCHER_MIB) // each)
        raise UsageError(
            f"--nproc {nproc}: {nproc} ranks need {nproc * each:,} MiB (each {RANK_PROCESS_MIB} MiB for its "
            f"process{budget}) and their launcher {LAUNCHER_MIB} MiB, this machine has {avail:,} MiB {where}; use "
            f"--nproc {fit} or fewer{', or lower memory.host_mib' if host_mib else ''}"
        )


def refuse_nccl(backend: str, world: int) -> None:
    """``ranks.backend = 'nccl'`` refused, before any process group forms (NCCL's own error there,
    on a machine without it, read as a group that did not form in time)."""
    if backend == "nccl":
        raise ConfigError(
            f"ranks.backend = 'nccl' with {world} ranks: the ranks' collectives run on host memory (a unit "
            "gathered into its staging buffer, then uploaded), which NCCL does not serve; gathering straight "
            "into device memory is not built. Set ranks.backend = 'gloo' or 'auto'"
        )
