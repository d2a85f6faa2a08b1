"""Fixtures shared by the test files."""

import os
import subprocess

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One compute thread per test worker (make test runs one worker per core): two workers'
    # OpenMP pools of a thread per core each would spin against each other on the same cores.
    # The processes a test starts inherit it. Results do not change (each test compares runs
    # made with the same thread count); the serial tests, run alone, keep every core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


# transformers gives its logger a handler on the sys.stderr of its first use: made here, that is
# the session's; made inside a test with capsys, a later test's warning went to that test's closed
# stream ("--- Logging error --- ... I/O operation on closed file" in the next one's stderr)
from transformers.utils import logging as _hf_logging  # noqa: E402

_hf_logging.get_logger("transformers")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Every test prepares rows into a cache of its own (tests run in parallel: two preparing
    the same rows into one cache entry at once would race)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(name, size_kib, readonly=False)``: a small tmpfs mounted at ``tmp_path/name``
    (full disks, read-only filesystems), unmounted after the test; the test is skipped, with
    the reason, where this process may not mount one."""
    mounted = []

    def make(name: str, size_kib: int, readonly: bool = False):
        mnt = tmp_path / name
        mnt.mkdir()
        opts = f"{'ro,' if readonly else ''}size={size_kib}k"
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)])
