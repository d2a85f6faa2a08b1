"""Careless inputs and full disks that ended in a traceback or in misleading advice: each is
one line naming the value or file and the fix, found before any work where it can be (issue
49, round three). The helpers are ``test_errors``'."""

import os
import re

import pytest
from reference import tiny_flags
from test_errors import one_line_error

from tiertrain.cli import main


def test_a_full_run_directory_is_one_line_naming_metrics_jsonl(tmp_path, capsys, tmpfs):
    """ENOSPC appending a step record: two tracebacks (the write's, then the close's), no file named."""
    full = tmpfs("full", 16)
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--train.run_dir={full / 'run'}", steps=40)], 1)
    assert f"writing the step records to {full / 'run' / 'metrics.jsonl'} failed: No space left on device" in line
    assert "free space on its filesystem or give the run another --train.run_dir" in line


def _state_bytes(flags):
    """Bytes of the states' files a run of ``flags`` claims (checksum sidecars not counted), as planned."""
    from tiertrain.config import load_config
    from tiertrain.runtime import Runtime
    from tiertrain.state.decl import SpacePlan
    from tiertrain.training.plan import plan_run

    cfg = load_config(None, flags).absolute()
    rt = Runtime(cfg)
    try:
        return SpacePlan(plan_run(cfg, rt).states).total
    finally:
        rt.close()


@pytest.mark.slow  # the engines are processes
def test_the_space_claimed_at_start_covers_the_checksum_sidecars(tmp_path, capsys, tmpfs):
    """A disk with room for the engines' files and not their .crc sidecars: the run started, and
    the engine's first save of a sidecar killed it with an OSError naming no file."""
    flags = tiny_flags(tmp_path, "--update.mode=engines")
    need = _state_bytes(flags)
    disk = tmpfs("disk", need // 1024 + 8)  # the files, the lock file and one 4 KiB block more
    line = one_line_error(capsys, ["train", *flags, f"--io.paths={disk / 'ssd'}"], 1)
    assert line.startswith(f"tiertrain: not enough space on the filesystem of {disk / 'ssd'}"), line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


def test_a_checksum_table_that_does_not_fit_is_named(tmp_path, tmpfs):
    from tiertrain.io import OutOfSpaceError
    from tiertrain.io.checksum import ChecksumTable

    disk = tmpfs("disk", 8)
    (disk / "filler").write_bytes(bytes(4096) * 2)  # the disk full
    with pytest.raises(OutOfSpaceError, match=rf"filesystem of {disk}/x\.crc: .*checksum table"):
        ChecksumTable(1 << 20, 4096).save(str(disk / "x.crc"))
    assert os.listdir(disk) == ["filler"]  # no temporary copy left


@pytest.mark.slow  # the engines are processes
def test_a_dead_engine_says_resume_only_where_a_checkpoint_exists(tmp_path, capsys, monkeypatch):
    """The engine's error said "resume from the last checkpoint" where there was none; the
    command line's hint names the checkpoint where there is one."""
    import tiertrain.faults  # noqa: F401 - read its environment now: the engines (new processes) are the ones killed

    monkeypatch.setenv("TIERTRAIN_KILL_AT", "update:1")
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, "--update.mode=engines")], 1)
    assert "update engine 0" in line and "died" in line and "last checkpoint" not in line, line
    assert (
        "stopped before its first checkpoint: there is nothing to resume; start it over with --train.overwrite" in line
    )
    monkeypatch.setenv("TIERTRAIN_KILL_AT", "update:30")  # after step 1 and its checkpoint
    flags = tiny_flags(tmp_path, "--update.mode=engines", "--checkpoint.every=1", "--train.overwrite=true", steps=4)
    line = one_line_error(capsys, ["train", *flags], 1)
    run = tmp_path / "run"
    assert re.search(
        rf"\(the last checkpoint is {run}/checkpoints/step-0000000[1-3]: `tiertrain train --resume {run}`\)$", line
    ), line


def test_a_run_killed_before_its_first_checkpoint_is_not_sent_in_a_circle(tmp_path, capsys):
    """A fresh start said "use --resume", --resume said "no complete checkpoint": each now says
    there is nothing to resume and how to start over, and that works."""
    import shutil

    assert main(["train", *tiny_flags(tmp_path)]) == 0
    run = tmp_path / "run"
    shutil.rmtree(run / "checkpoints")  # as a run killed before its first checkpoint leaves it
    advice = (
        "stopped before its first checkpoint: there is nothing to resume; start it over with --train.overwrite=true"
    )
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path)], 1)
    assert f"train.run_dir {run} already holds a run (metrics.jsonl, config.json); the run in {run} {advice}" in line
    assert "--resume" not in line.split(advice)[0], line
    for where, named in ((run, run), ("latest", run / "checkpoints"), (run / "checkpoints", run / "checkpoints")):
        line = one_line_error(capsys, ["train", *tiny_flags(tmp_path), f"--resume={where}"], 1)
        assert f"--resume {named}: no checkpoint there; the run in {run} {advice}" in line, line
    assert main(["train", *tiny_flags(tmp_path, "--train.overwrite=true")]) == 0
