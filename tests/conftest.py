"""Fixtures shared by the test files."""

import subprocess

import pytest


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
