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
    capsys.readouterr()
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 1
    err = capsys.readouterr().err
    assert (
        f"tiertrain: train.run_dir {run} already holds a run (step-00000002, metrics.jsonl, config.json); "
        f"continue it with `tiertrain train --resume {run}`, start over with --train.overwrite=true" in err
    )
    assert "probing" not in err and "memory budget" not in err  # refused at once, not after the plan's probes
    assert steps_in(run) == [1, 2] and names(run / "checkpoints") == ["step-00000002"]  # untouched
    # the earlier run on more ranks left ranks/1 and ranks/2 (their metrics, config, lock): gone
    # with it; a file of another name is left, with its directory
    for r in (1, 2):
        (run / "ranks" / str(r)).mkdir(parents=True)
        for name in ("metrics.jsonl", "config.json", ".tiertrain.lock"):
            (run / "ranks" / str(r) / name).write_bytes((run / "config.json").read_bytes())
    (run / "ranks" / "2" / "notes.txt").write_text("mine")
    assert main(["train", *tiny_flags(tmp_path, "--train.overwrite=true", steps=1)]) == 0
    assert steps_in(run) == [1] and names(run / "checkpoints") == ["step-00000001"]  # the old run is gone, not mixed in
    assert os.listdir(run / "ranks") == ["2"] and os.listdir(run / "ranks" / "2") == ["notes.txt"]


def test_two_runs_into_one_run_dir_at_once(tmp_path):
    a = small_config(tmp_path / "a", steps=1)
    b = small_config(tmp_path / "b", steps=1)
    b.train.run_dir = a.train.run_dir
    with Trainer(a):
        with pytest.raises(
            RunDirError,
            match=rf"train.run_dir {a.train.run_dir} is in use by another tiertrain run "
            r"\(this very process, since .*: a Trainer \(or a generation\) of it not closed; close\(\) it, .*\); "
            r"wait for it to finish, stop it, or give this run "
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
    again = [f"--io.paths={tmp_path / 'ssd'}/", "--train.progress=false"]  # as they were (a trailing '/')
    assert main(["train", f"--resume={run}", "--train.steps=12", "--checkpoint.every=3", *again]) == 0
    err = capsys.readouterr().err
    assert "done: 9 steps" in err
    assert "resume: settings changed from the checkpoint's config: checkpoint.every 0 -> 3" in err, err
    assert "io.paths" not in err and "train.progress" not in err  # given again as they were: not "changed"
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


def test_a_run_resumed_from_an_earlier_step_that_fails_before_saving_resumes_that_step(tmp_path, capsys, monkeypatch):
    """Resumed from step 2 of a run with checkpoints at 2 and 4, failing in step 4 before any save:
    the hint and `--resume RUN_DIR` took step 4, the course the user had abandoned (its metrics
    moved out by the resume), and the metrics then mixed the two courses (1 2 3 _ 5). The later
    course is set aside at once (superseded-step-...); the resume takes step 2 again."""
    import errno

    from tiertrain.io.errors import StorageError
    from tiertrain.training.trainer import Trainer

    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=2", steps=4)]) == 0
    ck2 = run / "checkpoints" / "step-00000002"
    step = Trainer.train_step

    def fails_at_4(self):
        if self.step == 3:
            raise StorageError(errno.EIO, str(tmp_path / "ssd"), "the drive went away (a stand-in)")
        return step(self)

    # nothing to train from step 2: the later course is left as it is (it was set aside, its metrics moved)
    assert main(["train", f"--resume={ck2}", "--train.steps=2"]) == 0
    assert names(run / "checkpoints") == ["step-00000002", "step-00000004"] and steps_in(run) == [1, 2, 3, 4]
    monkeypatch.setattr(Trainer, "train_step", fails_at_4)
    capsys.readouterr()
    assert main(["train", f"--resume={ck2}", "--train.steps=6", "--checkpoint.every=100"]) == 1
    err = capsys.readouterr().err
    assert "step-00000004 hold(s) a later course of this run than step 2: set aside as superseded-step-00000004" in err
    assert f"the last checkpoint is {ck2}: `tiertrain train --resume {run}`" in err, err
    assert names(run / "checkpoints") == ["step-00000002"] and steps_in(run) == [1, 2, 3]
    monkeypatch.undo()
    assert main(["train", f"--resume={run}", "--train.steps=5"]) == 0
    assert steps_in(run) == [1, 2, 3, 4, 5]
    # (checkpoint.every = 2, as step 2 was saved with) the set-aside course deleted by the first save
    assert sorted(os.listdir(run / "checkpoints")) == ["step-00000004", "step-00000005"]
    # a live run's directory is said to be in use (it was told to resume or overwrite it)
    from tiertrain.io.scratch import DirLock
    from tiertrain.training.rundir import _busy

    live = DirLock(str(run), _busy)
    try:
        capsys.readouterr()
        assert main(["train", *tiny_flags(tmp_path)]) == 1
        err = capsys.readouterr().err
    finally:
        live.release()
    assert f"train.run_dir {run} is in use by another tiertrain run (this very process, since" in err, err
    # train.overwrite deletes a set-aside course too (a whole checkpoint's space, unlisted)
    import shutil

    shutil.copytree(run / "checkpoints" / "step-00000004", run / "checkpoints" / "superseded-step-00000009")
    assert main(["train", *tiny_flags(tmp_path, "--train.overwrite=true", steps=1)]) == 0
    assert sorted(os.listdir(run / "checkpoints")) == ["step-00000001"]


def test_relative_paths_resume_and_export_from_another_directory(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    monkeypatch.chdir(a)
    flags = [f for f in tiny_flags(tmp_path) if not f.startswith(("--io.paths", "--train.run_dir"))]
    (a / "val.txt").write_text("in the beginning was the word " * 40)  # (a relative eval corpus stayed relative)
    ev = ["--data.eval_corpus=val.txt", "--train.eval_every=1", "--data.eval_micro_batches=1"]
    assert main(["train", "--io.paths=ssd", "--train.run_dir=run", *flags, *ev]) == 0
    man = Manifest.read(str(a / "run" / "checkpoints" / "step-00000002"))
    assert man.config["io"]["paths"] == [str(a / "ssd")] and man.config["train"]["run_dir"] == str(a / "run")
    assert man.config["data"]["eval_corpus"] == str(a / "val.txt")
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


# -- round three (issue 49): nothing of another run is ever written over ------------------------------------


def tree_bytes(root):
    """Every file under ``root`` by relative path, with its bytes (the lock file aside: a run
    that releases a directory rewrites its record)."""
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            if n != ".tiertrain.lock":
                p = os.path.join(d, n)
                out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def test_a_copied_run_resumes_into_the_copy_and_leaves_the_original_byte_identical(tmp_path, capsys):
    """`cp -a runs/A runs/B; --resume runs/B/checkpoints/step-2`: B continues (its later course
    replaced, its metrics continued), A is byte-identical. A run directory moved whole resumes
    in its new place too, by the API as by the command."""
    import shutil

    import tiertrain

    a, b = tmp_path / "A", tmp_path / "B"
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=2", f"--train.run_dir={a}", steps=4)]) == 0
    shutil.copytree(a, b, symlinks=True)
    before = tree_bytes(a)
    assert main(["train", f"--resume={b / 'checkpoints' / 'step-00000002'}", "--optim.lr=1e-3"]) == 0
    err = capsys.readouterr().err
    assert tree_bytes(a) == before
    assert f"the run directory {a} was copied or moved to {b}: the resumed run writes there" in err, err
    assert steps_in(b) == [1, 2, 3, 4] and names(b / "checkpoints") == ["step-00000002", "step-00000004"]
    assert Manifest.read(str(b / "checkpoints" / "step-00000004")).config["train"]["run_dir"] == str(b)
    assert Manifest.read(str(b / "checkpoints" / "step-00000004")).config["optim"]["lr"] == 1e-3
    c = tmp_path / "C"
    shutil.move(b, c)
    before_b = tree_bytes(c)
    tiertrain.train(None, "--train.steps=5", resume=str(c))  # the API: the same placement
    assert not b.exists() and tree_bytes(a) == before
    assert steps_in(c) == [1, 2, 3, 4, 5] and names(c / "checkpoints") == ["step-00000004", "step-00000005"]
    gone = before_b.keys() - tree_bytes(c).keys()
    assert gone == {k for k in before_b if k.startswith("checkpoints/step-00000002/")}  # keep = 2: no other loss


def test_a_run_resumed_into_another_run_directory_is_refused_where_that_holds_a_run(tmp_path, capsys):
    """--train.run_dir names where a resumed run writes: refused where it holds another run
    (that run untouched), taken where it is new. A stored train.overwrite is never inherited.
    Checkpoints kept outside the run directory (checkpoint.dir) and moved: the run directory
    must be named (never the stored one)."""
    a, d, e = tmp_path / "A", tmp_path / "D", tmp_path / "E"
    flags = tiny_flags(tmp_path, f"--train.run_dir={a}", "--train.overwrite=true", steps=2)
    assert main(["train", *flags]) == 0
    assert main(["train", *tiny_flags(tmp_path, f"--train.run_dir={d}", steps=1)]) == 0
    capsys.readouterr()
    before_a, before_d = tree_bytes(a), tree_bytes(d)
    assert main(["train", f"--resume={a}", f"--train.run_dir={d}", "--train.steps=3"]) == 1
    err = capsys.readouterr().err
    assert f"tiertrain: train.run_dir {d} already holds a run (step-00000001, metrics.jsonl, config.json)" in err, err
    assert tree_bytes(a) == before_a and tree_bytes(d) == before_d
    assert main(["train", f"--resume={a}", f"--train.run_dir={e}", "--train.steps=3"]) == 0
    assert tree_bytes(a) == before_a and names(e / "checkpoints") == ["step-00000003"] and steps_in(e) == [3]
    # checkpoints in a directory of their own, moved: the run directory is not guessed
    ck, moved = tmp_path / "ck", tmp_path / "ck-moved"
    flags = tiny_flags(tmp_path, f"--train.run_dir={tmp_path / 'F'}", f"--checkpoint.dir={ck}", steps=2)
    assert main(["train", *flags]) == 0
    os.rename(ck, moved)
    capsys.readouterr()
    assert main(["train", f"--resume={moved}", "--train.steps=3"]) == 1
    err = capsys.readouterr().err
    assert f"checkpoint directory {moved} is not where its run wrote it ({ck})" in err and "--train.run_dir" in err
    assert main(["train", f"--resume={moved}", f"--train.run_dir={tmp_path / 'G'}", "--train.steps=3"]) == 0
    assert names(moved) == ["step-00000002", "step-00000003"] and not ck.exists()


def test_damaged_metrics_lines_and_a_checkpoint_without_manifest_are_kept_and_named(tmp_path, capsys):
    """A damaged line of metrics.jsonl and the records of a later course are moved to
    metrics.dropped.jsonl, not dropped; a newest step directory without a manifest is moved
    aside (damaged-step-...) with a warning, never overwritten by the save of its step."""
    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=2", "--checkpoint.keep=3", steps=6)]) == 0
    lines = open(run / "metrics.jsonl", "rb").read().splitlines(keepends=True)
    lines[1] = b'{"step": 2, "loss": 5.1, "tok\x00\xff garbage\n'
    open(run / "metrics.jsonl", "wb").writelines(lines)
    newest = run / "checkpoints" / "step-00000006"
    os.remove(newest / "manifest.json")
    kept = {n: (newest / n).read_bytes() for n in os.listdir(newest)}
    capsys.readouterr()
    assert main(["train", f"--resume={run}", "--train.steps=7"]) == 0
    err = capsys.readouterr().err
    aside = run / "checkpoints" / "damaged-step-00000006"
    assert f"{newest} has no manifest (a damaged checkpoint, never loaded): moved to {aside}" in err, err
    assert {n: (aside / n).read_bytes() for n in os.listdir(aside)} == kept
    assert f"{run / 'metrics.jsonl'}: 1 damaged line(s) (line 2) are not step records; moved to" in err, err
    dropped = open(run / "metrics.dropped.jsonl", "rb").read().splitlines(keepends=True)
    assert dropped == [lines[4], lines[5], lines[1]]  # steps 5 and 6 (a later course than step 4), the damaged line
    assert steps_in(run) == [1, 3, 4, 5, 6, 7]
    assert names(run / "checkpoints") == ["step-00000004", "step-00000006", "step-00000007"]


def test_export_overwrite_replaces_only_an_earlier_export(tmp_path, capsys, monkeypatch):
    """--out naming the run, its checkpoint or a directory that holds them is refused, with or
    without --overwrite; --overwrite into a directory holding files an export did not write
    (the working directory) is refused, everything left as it was; into an earlier export it
    replaces that export."""
    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0
    ck = run / "checkpoints" / "step-00000001"
    (tmp_path / "notes.txt").write_text("mine")
    before = tree_bytes(tmp_path)
    capsys.readouterr()
    for out in (run, ck, tmp_path, run / "checkpoints"):
        rc = main(["export", f"--checkpoint={run}", f"--out={out}", "--overwrite"])
        err = capsys.readouterr().err
        assert rc == 1 and f"tiertrain: export --out {out} is or holds the checkpoint being exported" in err, err
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # not the source: a directory of other files
    (tmp_path / "work" / "mine.bin").write_bytes(b"x")
    before = tree_bytes(tmp_path)
    assert main(["export", f"--checkpoint={run}", "--out=.", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert f"tiertrain: export --out {tmp_path / 'work'} is not an earlier export (mine.bin)" in err, err
    assert tree_bytes(tmp_path) == before
    out = tmp_path / "exported"
    assert main(["export", f"--checkpoint={run}", f"--out={out}"]) == 0
    (out / "model-00007-of-00007.safetensors").write_bytes(b"stale")
    assert main(["export", f"--checkpoint={run}", f"--out={out}", "--overwrite"]) == 0
    assert not (out / "model-00007-of-00007.safetensors").exists() and (out / "tiertrain.json").exists()
    assert tree_bytes(run) == {k[len("run/") :]: v for k, v in before.items() if k.startswith("run/")}
    # a run started from that export: exporting it over the export it reads lost its base
    second = tmp_path / "second"
    assert main(["train", *tiny_flags(second, f"--model.init_from={out}", steps=1)]) == 0
    capsys.readouterr()
    before = tree_bytes(out)
    assert main(["export", f"--checkpoint={second / 'run'}", f"--out={out}", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert f"tiertrain: export --out {out} is or holds model.init_from = {out}, which the checkpoint's run reads" in err
    assert tree_bytes(out) == before


def test_a_run_keeping_its_checkpoints_elsewhere_resumes_from_its_run_directory(tmp_path, capsys):
    """With checkpoint.dir outside the run directory, `--resume RUN_DIR` (the command a stopped
    run prints) finds them through the run's config; it said "stopped before its first
    checkpoint" and offered --train.overwrite, which then deleted them without a word."""
    run, ck = tmp_path / "run", tmp_path / "elsewhere"
    assert main(["train", *tiny_flags(tmp_path, f"--checkpoint.dir={ck}", steps=3)]) == 0
    assert names(ck) == ["step-00000003"] and not (run / "checkpoints").exists()
    capsys.readouterr()
    assert main(["train", f"--resume={run}", "--train.steps=5"]) == 0
    assert "done: 2 steps" in capsys.readouterr().err
    assert names(ck) == ["step-00000003", "step-00000005"] and steps_in(run) == [1, 2, 3, 4, 5]
    assert main(["train", *tiny_flags(tmp_path, f"--checkpoint.dir={ck}", "--train.overwrite=true", steps=1)]) == 0
    err = capsys.readouterr().err
    assert f"train.overwrite: deleting 2 checkpoint(s) of the earlier run in {ck} (step-00000003, step-00000005)" in err


def test_a_resume_with_another_precision_names_what_it_was_made_with_and_nothing_else(tmp_path, capsys, monkeypatch):
    """An intact checkpoint made with another precision or cut: the refusal names the settings it
    was made with; no earlier checkpoint (it fails alike) nor --train.overwrite (it deletes the
    run) is offered."""
    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=1", steps=2)]) == 0
    capsys.readouterr()
    assert main(["train", f"--resume={run}", "--train.param_dtype=bfloat16", "--train.steps=3"]) != 0
    err = capsys.readouterr().err
    assert "was written for another model or precision" in err and "train.param_dtype = 'float32'" in err, err
    assert "newest intact" not in err and "overwrite" not in err, err
    assert names(run / "checkpoints") == ["step-00000001", "step-00000002"]
    # the checksum block pads the units too: another one is named with the settings, as it was
    assert main(["train", f"--resume={run}", "--io.checksum=false", "--train.steps=3"]) != 0
    err = capsys.readouterr().err
    assert "io.checksum = True, io.checksum_block_kib = 64, io.chunk_kib = 256" in err, err
    # given again as it was, relative to here: not "changed"
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"--resume={run}", "--train.run_dir=run", "--train.steps=3"]) == 0
    assert "train.run_dir" not in capsys.readouterr().err.split("resume: settings changed")[-1].split("\n")[0]


def test_another_adapter_kind_on_resume_is_refused_for_the_kind_and_options_alone_mean_train(tmp_path, capsys):
    """A full fine-tune on the engines resumed with --adapter.kind=lora was first refused for its
    update mode (which suits the checkpoint's kind), not for the kind; and `tiertrain --resume
    RUN` (no command, as no command runs the main job) took the run directory for a command."""
    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, "--update.mode=engines", steps=1)]) == 0
    capsys.readouterr()
    assert main(["train", f"--resume={run}", "--adapter.kind=lora", "--train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "was made with adapter kind 'none'; this run has kind 'lora'" in err and "update.mode" not in err, err
    assert main(["--resume", str(run), "--train.steps=2"]) == 0
    assert "done: 1 step" in capsys.readouterr().err and steps_in(run) == [1, 2]


def test_a_checkpoint_resumed_on_other_ranks_says_the_global_batch_it_now_takes(tmp_path):
    """Each rank takes its own micro-batches: a 1-rank checkpoint resumed on 2 ranks doubles the
    global batch. --nproc is no config setting, so the changed-settings line never said it. The
    checkpoint records its ranks (a 2-rank run's: tests/test_dist_train.py)."""
    from tiertrain.training.checkpoints import other_ranks_note

    cfg = small_config(tmp_path, steps=1)
    with Trainer(cfg) as t:
        t.run()
    assert Manifest.read(list_checkpoints(str(tmp_path / "run" / "checkpoints"))[-1]).ranks == 1
    assert other_ranks_note(1, (4, 2), 2, (4, 2)) == (
        "was trained on 1 rank(s), this run has 2: each rank takes 4 micro-batches of 2 sequences, so a step now "
        "takes 16 sequences (the checkpoint's steps took 8); --data.micro_batches=2 keeps the checkpoint's"
    )
    assert other_ranks_note(2, (3, 1), 1, (3, 1)).endswith("took 6); --data.micro_batches=6 keeps the checkpoint's")
    assert other_ranks_note(1, (3, 1), 2, (3, 1)).endswith("no whole data.micro_batches keeps the checkpoint's")
    assert other_ranks_note(1, (4, 2), 2, (2, 2)) is None  # the global batch kept by hand: nothing to say
    assert other_ranks_note(2, (3, 1), 2, (3, 1)) is None and other_ranks_note(0, (3, 1), 2, (3, 1)) is None  # 0: older
    # the same ranks, other micro-batches: no word of ranks (the changed-settings line names data.micro_batches)
    assert other_ranks_note(1, (4, 2), 1, (2, 2)) is None and other_ranks_note(2, (4, 2), 2, (4, 1)) is None


def test_a_model_directory_is_never_taken_for_a_run_nor_overwritten(tmp_path, capsys):
    """A run directory holding a transformers model's config.json was "a run" whose start-over
    (--train.overwrite=true, as the refusal advised) replaced that config.json with the run's:
    the model no longer loaded. Empty paths meant the current directory, unnamed."""
    model = tmp_path / "run"  # where tiny_flags trains
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    for overwrite in ("false", "true"):
        assert main(["train", *tiny_flags(tmp_path, f"--train.overwrite={overwrite}", steps=1)]) == 1
        err = capsys.readouterr().err
        assert "holds a config.json that is not a tiertrain run's (a transformers model's, model_type 'llama')" in err
        assert "--resume" not in err and "overwrite" not in err, err
    assert (model / "config.json").read_text() == '{"model_type": "llama", "hidden_size": 8}'
    assert sorted(os.listdir(model)) == ["config.json"]
    (model / "config.json").write_text('{"train": {"steps": 2}, "model": {"kin')  # a run's, cut short: a run's still
    # a run's, cut short, that took no step (no metrics, no checkpoint): started over, nothing of it to keep
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 1  # now a run with a step: "holds a run"
    assert main(["train", *tiny_flags(tmp_path, "--train.overwrite=true", steps=1)]) == 0
    assert json.loads((model / "config.json").read_text())["train"]["steps"] == 1
    capsys.readouterr()
    for flag in ("--train.run_dir=", "--model.hf_dir= ", "--model.init_from="):
        assert main(["train", *tiny_flags(tmp_path / "b", flag, steps=1)]) == 2
        assert f"{flag.split('=')[0][2:]} = {flag.split('=')[1]!r}: empty: name a" in capsys.readouterr().err, flag


def test_one_directory_as_run_dir_and_scratch_is_named_as_such(tmp_path, capsys):
    """io.paths equal to train.run_dir: the run's second lock on the directory said it was "in
    use by another tiertrain run (pid N)", N being the run itself."""
    d = tmp_path / "d"
    assert main(["train", *tiny_flags(tmp_path, f"--io.paths={d}", f"--train.run_dir={d}", steps=1)]) == 2
    err = capsys.readouterr().err
    assert f"{d} is named as train.run_dir and io.paths: give each its own directory" in err and "another" not in err
    assert not d.exists()
    assert main(["train", *tiny_flags(tmp_path, f"--io.paths={d / 'scratch'}", f"--train.run_dir={d}", steps=1)]) == 0


def test_a_start_over_that_fails_before_it_begins_offers_no_resume_of_the_earlier_run(tmp_path, capsys):
    """--train.overwrite=true over an earlier run, stopped by a data error before it began: the
    error pointed at the earlier run's checkpoint (`--resume`), another run than the one asked."""
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"text": "two"\n')
    capsys.readouterr()
    assert main(["train", *tiny_flags(tmp_path, "--train.overwrite=true", f"--data.corpus={bad}", steps=1)]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "--resume" not in err and "last checkpoint" not in err, err
    assert names(tmp_path / "run" / "checkpoints") == ["step-00000001"]  # (the start over never began)


def test_more_steps_on_resume_say_the_schedule_they_now_follow(tmp_path, capsys):
    """`--resume RUN --train.steps=9` after 3 cosine steps: the schedule spans the 9, so the rate
    jumped from its final 0.1 x lr back up, with nothing said (the changed-settings line leaves
    train.steps out). Said now, with the setting that keeps the checkpoint's rate; a constant
    schedule says nothing, and its rates are the flag's."""
    flags = tiny_flags(tmp_path, "--optim.warmup_steps=0", "--optim.lr=1e-2", steps=3)
    assert main(["train", *flags]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "run"), "--train.steps=9"]) == 0
    err = capsys.readouterr().err
    assert "was trained for train.steps = 3, now 9: the cosine learning-rate schedule spans the 9" in err, err
    assert "step 4 takes 0.00628 where step 3 took 0.001" in err and "--optim.schedule=constant --optim.lr=0.001" in err
    lrs = [json.loads(line)["lr"] for line in open(tmp_path / "run" / "metrics.jsonl") if '"lr"' in line]
    assert lrs[2] == pytest.approx(1e-3) and lrs[3] == pytest.approx(6.28e-3, rel=1e-3)
    more = ["train", "--resume", str(tmp_path / "run"), "--train.steps=11", "--optim.schedule=constant"]
    assert main([*more, "--optim.lr=0.001"]) == 0
    assert "learning-rate schedule" not in capsys.readouterr().err
    # the rate the checkpoint took is its own settings', not the resuming run's (--optim.lr=1e-3
    # made it say 0.0001 for a step that took 0.001, and advise that)
    assert main(["train", *tiny_flags(tmp_path / "b", "--optim.warmup_steps=0", "--optim.lr=1e-2", steps=3)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "b" / "run"), "--train.steps=9", "--optim.lr=1e-3"]) == 0
    err = capsys.readouterr().err
    assert "step 4 takes 0.000628 where step 3 took 0.001" in err and "--optim.lr=0.001" in err, err


def test_overwrite_takes_checkpoints_another_rank_deleted_first(tmp_path, monkeypatch):
    """Ranks sharing a checkpoint.dir each delete the earlier run's checkpoints under
    train.overwrite, at once: the one that came second failed with a FileNotFoundError
    traceback. Gone is gone."""
    import tiertrain.training.rundir as rundir

    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=1", "--checkpoint.keep=2")]) == 0
    root = tmp_path / "run" / "checkpoints"
    real = rundir.list_checkpoints(str(root))
    monkeypatch.setattr(rundir, "list_checkpoints", lambda r: [*real, str(root / "step-00000009")])  # (deleted)
    rundir.RunDir(str(tmp_path / "run"), str(root)).start_fresh(overwrite=True)
    assert not list(root.iterdir()) and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_runs_sharing_a_checkpoint_dir_never_delete_or_continue_each_others_checkpoints(tmp_path, capsys):
    """checkpoint.dir outside the run directory, shared: train.overwrite of run B deleted run A's
    checkpoints there, and `--resume A` then continued B's checkpoint (writing B's metrics);
    a copy of a run directory shares the original's checkpoint.dir, and resuming the copy wrote the
    original's metrics and pruned the checkpoints it was branched from. Both refused, by name, with
    a branch command that works; a run directory moved (its original gone) continues where it is."""
    ck = tmp_path / "ck"
    a, b = tmp_path / "A", tmp_path / "B"

    def flag(run, *x, steps=2):
        return tiny_flags(tmp_path, f"--train.run_dir={run}", f"--checkpoint.dir={ck}", *x, steps=steps)

    assert main(["train", *flag(a)]) == 0
    capsys.readouterr()
    before = tree_bytes(ck)
    for extra in ((), ("--train.overwrite=true",)):
        assert main(["train", *flag(b, *extra, steps=3)]) == 1
        err = capsys.readouterr().err
        assert (
            f"tiertrain: checkpoint.dir {ck} holds checkpoints of run {a} (step-00000002), not of train.run_dir {b}"
            in err
        ), err
        assert tree_bytes(ck) == before and not (b / "metrics.jsonl").exists()
    # B's checkpoint, the latest in A's checkpoint.dir (as a run before this check left it)
    assert (
        main(["train", *tiny_flags(tmp_path, f"--train.run_dir={b}", f"--checkpoint.dir={tmp_path / 'ckb'}", steps=3)])
        == 0
    )
    os.rename(tmp_path / "ckb" / "step-00000003", ck / "step-00000003")
    tree = json.loads((b / "config.json").read_text())
    tree["checkpoint"]["dir"] = str(ck)  # B writes into A's checkpoint.dir
    (b / "config.json").write_text(json.dumps(tree))
    capsys.readouterr()
    assert main(["train", f"--resume={a}", "--train.steps=4"]) == 1
    err = capsys.readouterr().err
    assert (
        f"--resume {a}: its checkpoint.dir {ck} is shared with run {b}, whose checkpoint step-00000003 is the latest there;"
        in err
    ), err
    assert steps_in(a) == [1, 2] and steps_in(b) == [1, 2, 3]
    os.rename(ck / "step-00000003", tmp_path / "ckb" / "step-00000003")
    # a copy of A: refused, the branch command it gives works and leaves A's checkpoints alone
    import shutil

    shutil.copytree(a, tmp_path / "A2")
    before = tree_bytes(ck)
    assert main(["train", f"--resume={tmp_path / 'A2'}", "--train.steps=4"]) == 1
    err = capsys.readouterr().err
    assert (
        f"is shared with run {a}, whose checkpoint step-00000002 is the latest there ({tmp_path / 'A2'} is a copy of it)"
        in err
    )
    import tiertrain

    with pytest.raises(RunDirError, match=r"is a copy of it\)"):  # the Python API alike
        tiertrain.train(resume=str(tmp_path / "A2"), progress=False)
    branch = err.split("To branch from it: ")[1].split()[1:]  # (after "tiertrain")
    branch = [x.replace("NEW_DIR", str(tmp_path / "branch")) for x in branch] + ["--train.steps=3"]
    assert main(branch) == 0 and tree_bytes(ck) == before and steps_in(a) == [1, 2]
    assert steps_in(tmp_path / "branch") == [3] and names(tmp_path / "branch" / "checkpoints") == ["step-00000003"]
    # A moved (not copied): it continues where it is now, with its checkpoint.dir, even where a new
    # run of its own checkpoints took its old place; a scratch directory inside it moves with it
    os.rename(a, tmp_path / "A3")
    assert main(["train", *tiny_flags(tmp_path, f"--train.run_dir={a}", f"--io.paths={a / 'ssd'}", steps=1)]) == 0
    capsys.readouterr()
    assert main(["train", f"--resume={tmp_path / 'A3'}", "--train.steps=3"]) == 0
    err = capsys.readouterr().err
    assert steps_in(tmp_path / "A3") == [1, 2, 3] and steps_in(a) == [1] and names(ck)[-1] == "step-00000003"
    assert f"the run directory {a} was copied or moved to {tmp_path / 'A3'}" in err and "settings changed" not in err
    # checkpoints in a checkpoint.dir within the run directory: a copy resumes its own, a moved one too
    inner = tmp_path / "I"
    assert main(["train", *tiny_flags(tmp_path, f"--train.run_dir={inner}", f"--checkpoint.dir={inner / 'ck'}",
                                      f"--io.paths={inner / 'ssd'}")]) == 0  # fmt: skip
    shutil.copytree(inner, tmp_path / "I2")
    before = tree_bytes(inner)
    assert main(["train", f"--resume={tmp_path / 'I2'}", "--train.steps=3"]) == 0
    assert tree_bytes(inner) == before and names(tmp_path / "I2" / "ck")[-1] == "step-00000003"
    os.rename(inner, tmp_path / "I3")
    assert main(["train", f"--resume={tmp_path / 'I3'}", "--train.steps=3"]) == 0
    assert steps_in(tmp_path / "I3") == [1, 2, 3] and not inner.exists()


@pytest.mark.slow  # a process holds the lock
def test_a_directory_held_by_a_stopped_process_says_how_to_let_it_end(tmp_path):
    """A rank stopped (SIGSTOP, Ctrl-Z) outlives its launcher: its lock refused the next run
    naming a pid, not that the process was stopped and how to let it end."""
    import signal
    import subprocess
    import sys
    import time

    from tiertrain.io.scratch import DirInUseError, DirLock, _scratch_busy

    code = (
        "import sys, time; from tiertrain.io.scratch import DirLock, _scratch_busy; "
        f"lock = DirLock({str(tmp_path / 'held')!r}, _scratch_busy); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirInUseError) as running:
            DirLock(str(tmp_path / "held"), _scratch_busy)
        assert "stopped" not in str(running.value)
        os.kill(holder.pid, signal.SIGSTOP)
        time.sleep(0.2)
        with pytest.raises(DirInUseError, match=rf"it is stopped \(SIGSTOP or Ctrl-Z\): `kill -CONT {holder.pid}`"):
            DirLock(str(tmp_path / "held"), _scratch_busy)
    finally:
        holder.kill()
        holder.wait()


def test_a_live_run_holds_its_checkpoint_dir_against_a_second(tmp_path):
    """Found from outside: two live runs given one checkpoint.dir (outside their run
    directories) both saved step-N there, each over the other's: with checkpoint.every = 0 the
    check at start found nothing, and one run's checkpoints were all lost. The second is refused
    while the first holds it, and takes it once the first has ended."""
    from reference import small_config

    from tiertrain.training.trainer import Trainer

    def cfg(name):
        c = small_config(tmp_path / name, steps=1)
        c.checkpoint.dir = str(tmp_path / "ck")
        return c

    with Trainer(cfg("a")) as first:
        first.initialize(progress=False)
        with pytest.raises(RunDirError, match=rf"checkpoint.dir {tmp_path / 'ck'} is in use by another tiertrain run "
                           r"\(this very process.*give this run a checkpoint.dir of its own"):  # fmt: skip
            Trainer(cfg("b"))
        assert not (tmp_path / "b" / "run").exists()  # (the refused run leaves no directory)
        first.train_step()
        first.save_checkpoint()
    with Trainer(cfg("b")) as second:  # (and a run never takes another's checkpoints: its own test)
        assert second.rundir.checkpoint_lock is not None
    assert sorted(os.listdir(tmp_path / "ck")) == ["step-00000001"]  # the lock file gone with its run


def test_a_resume_under_other_heads_is_refused(tmp_path, capsys):
    """Found from outside: `--resume RUN --model.n_heads=4` over a model of 8 heads (the same
    weights' shapes) went on as another model, said only as a changed setting; the Python API's
    restore() into a Trainer of other heads alike. Both refused by name; the same heads given
    (n_kv_heads spelt out) go on."""
    from test_errors import one_line_error

    from tiertrain.config import ConfigError

    assert main(["train", *tiny_flags(tmp_path, "--model.n_heads=8")]) == 0
    run = str(tmp_path / "run")
    capsys.readouterr()
    line = one_line_error(capsys, ["train", "--resume", run, "--train.steps=3", "--model.n_heads=4"], 2)
    assert "model.n_heads 4, n_kv_heads 4 where the checkpoint's model has 8 and 8" in line, line
    cfg = small_config(tmp_path / "api", heads=4)
    with Trainer(cfg) as tr, pytest.raises(ConfigError, match=r"the same weights under other heads"):
        tr.restore(run)
    assert main(["train", "--resume", run, "--train.steps=3", "--model.n_heads=8", "--model.n_kv_heads=8"]) == 0
