"""Benchmarks work in a folder of their own inside ``--scratch`` and remove only that: a user may
point ``--scratch`` at a folder with their own work in it (an earlier version of
bench/vs_deepspeed.py removed the folder it was given, a whole checkout with it)."""

from __future__ import annotations

import glob
import os
import re

import pytest

from tiertrain.bench.output import scratch_dir

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")


def _users_folder(tmp_path):
    parent = tmp_path / "users-work"
    (parent / "src").mkdir(parents=True)
    (parent / "notes.txt").write_text("mine")
    (parent / "src" / "model.py").write_text("x = 1")
    return parent


def test_scratch_dir_removes_only_its_own_folder(tmp_path):
    parent = _users_folder(tmp_path)
    with scratch_dir(str(parent), "bench-x") as work:
        assert os.path.dirname(work) == str(parent) and os.path.basename(work).startswith("tiertrain-bench-x-")
        os.makedirs(os.path.join(work, "ssd"))
        open(os.path.join(work, "ssd", "params.bin"), "wb").write(b"\0" * 4096)
    assert not os.path.exists(work)
    assert sorted(os.listdir(parent)) == ["notes.txt", "src"] and (parent / "src" / "model.py").read_text() == "x = 1"


def test_scratch_dir_cleans_up_on_error_and_makes_a_missing_parent(tmp_path):
    parent = tmp_path / "new" / "parent"
    with pytest.raises(RuntimeError, match="boom"):
        with scratch_dir(str(parent), "y") as work:
            raise RuntimeError("boom")
    assert parent.is_dir() and not os.path.exists(work) and os.listdir(parent) == []


def test_scratch_dir_defaults_to_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with scratch_dir(None, "z") as work:
        assert os.path.dirname(work) == str(tmp_path)


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(BENCH, "*.py"))), ids=os.path.basename)
def test_no_benchmark_removes_the_folder_it_is_given(script):
    """Every benchmark with ``--scratch`` takes its folder from ``scratch_dir`` and never removes
    ``args.scratch`` itself, unless it first rebound it to that folder (``as args.scratch``)."""
    src = open(script).read()
    if '"--scratch"' not in src:
        pytest.skip("no --scratch")
    uses = re.findall(r"scratch_dir\(args\.scratch, ", src)
    assert uses, f"{script}: --scratch not taken through scratch_dir"
    if re.search(r"rmtree\(args\.scratch", src):
        assert "as args.scratch" in src, f"{script} removes --scratch itself"
