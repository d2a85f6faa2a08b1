"""Run directories, resume and paths: runs never clobber or lose each other's work."""

import json
import os

import pytest
from reference import small_config, tiny_flags

from tiertrain.checkpoint import Manifest, list_checkpoints
from tiertrain.cli import main
from tiertrain.training.rundir import RunDirError
from tiertrain.training.trainer import Trainer


def steps_in(run):
    return [json.loads(line)["step"] for line in open(run / "metrics.jsonl")]


def names(root):
    return [os.path.basename(p) for p in list_checkpoints(str(root))]


def test_a_new_run_into_a_used_run_dir_is_refused_unless_overwrite(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path)]) == 0
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 1
    err = capsys.readouterr().err
    assert (
        f"tiertrain: train.run_dir {run} already holds a run (step-00000002, metrics.jsonl, config.json); "
        f"continue it with `tiertrain train --resume {run}`, start over with --train.overwrite=true" in err
    )
    assert steps_in(run) == [1, 2] and names(run / "checkpoints") == ["step-00000002"]  # untouched
    assert main(["train", *tiny_flags(tmp_path, "--train.overwrite=true", steps=1)]) == 0
    assert steps_in(run) == [1] and names(run / "checkpoints") == ["step-00000001"]  # the old run is gone, not mixed in


def test_two_runs_into_one_run_dir_at_once(tmp_path):
    a = small_config(tmp_path / "a", steps=1)
    b = small_config(tmp_path / "b", steps=1)
    b.train.run_dir = a.train.run_dir
    with Trainer(a):
        with pytest.raises(
            RunDirError,
            match=rf"train.run_dir {a.train.run_dir} is in use by another tiertrain run "
            rf"\(pid {os.getpid()}, started .*\); wait for it to finish, stop it, or give this run "
            "another --train.run_dir",
        ):
            Trainer(b)
    with Trainer(b):  # released on close
        pass


def test_resume_past_rotation_then_a_finished_run(tmp_path, capsys):
    """Resumed from step 3 with checkpoints every 3 steps and keep = 2: the checkpoint it
    resumed from is rotated away, and the run still ends with its final checkpoint and summary.
    Resuming a finished run says how to train further."""
    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, steps=3)]) == 0
    assert main(["train", f"--resume={run}", "--train.steps=12", "--checkpoint.every=3"]) == 0
    err = capsys.readouterr().err
    assert "done: 9 steps" in err
    assert names(run / "checkpoints") == ["step-00000009", "step-00000012"]
    assert steps_in(run) == list(range(1, 13))
    assert main(["train", f"--resume={run}"]) == 0
    err = capsys.readouterr().err
    assert (
        f"already at step 12 of train.steps = 12: nothing to train; to train further, raise it: tiertrain train "
        f"--resume {run} --train.steps=24" in err
    )


def test_metrics_continue_without_duplicates_and_a_later_course_is_replaced(tmp_path, capsys):
    """A run to step 4 (checkpoints at 2 and 4) resumed from step 2 with train.steps = 3 and
    keep = 1: metrics hold steps 1..3 once each, and the run's own step-3 checkpoint is what
    remains (not the abandoned step 4, which `--resume latest` would otherwise pick)."""
    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=2", steps=4)]) == 0
    assert steps_in(run) == [1, 2, 3, 4]
    ck2 = run / "checkpoints" / "step-00000002"
    assert main(["train", f"--resume={ck2}", "--train.steps=3", "--checkpoint.keep=1"]) == 0
    assert "step-00000004 hold(s) a later course of this run than step 2" in capsys.readouterr().err
    assert steps_in(run) == [1, 2, 3]
    assert names(run / "checkpoints") == ["step-00000003"]


def test_relative_paths_resume_and_export_from_another_directory(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    monkeypatch.chdir(a)
    flags = [f for f in tiny_flags(tmp_path) if not f.startswith(("--io.paths", "--train.run_dir"))]
    assert main(["train", "--io.paths=ssd", "--train.run_dir=run", *flags]) == 0
    man = Manifest.read(str(a / "run" / "checkpoints" / "step-00000002"))
    assert man.config["io"]["paths"] == [str(a / "ssd")] and man.config["train"]["run_dir"] == str(a / "run")
    monkeypatch.chdir(b)
    assert main(["train", f"--resume={a / 'run'}", "--train.steps=3"]) == 0
    assert names(a / "run" / "checkpoints") == ["step-00000002", "step-00000003"]  # the original run directory
    assert not (b / "runs").exists() and not (b / "run").exists()
    assert main(["export", f"--checkpoint={a / 'run'}", "--out=exported"]) == 0  # a run directory, like --resume
    assert json.load(open(b / "exported" / "tiertrain.json"))["step"] == 3


def test_a_failed_start_leaves_nothing_behind(tmp_path, capsys):
    """The run directory and scratch it would have made are not left behind."""
    flags = tiny_flags(tmp_path, f"--data.corpus={tmp_path / 'none.tokens'}")
    (tmp_path / "none.tokens").write_bytes(b"\0" * 10)
    assert main(["train", *flags]) == 1
    assert "is not a tiertrain token file" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["none.tokens"]
