"""Nothing left behind: what a failed, interrupted or finished command made and no longer needs
is gone (or, where it belongs to a dead run, removed and said by the next one)."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from reference import llama_rank_flags, tiny_flags

from tiertrain.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prepared_dirs(cache):
    d = cache / "tiertrain" / "prepared"
    return sorted(os.listdir(d)) if d.exists() else []


def test_a_data_error_while_preparing_rows_leaves_no_cache_entry(tmp_path, capsys, monkeypatch):
    """Bad rows, and rows that hold no example, prepared for training into the cache: the error,
    and no `prepared/<key>/` (it left an empty directory, or an ids.tokens while saying nothing
    was written)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"text": "two"\n')
    assert main(["train", *tiny_flags(tmp_path / "a"), f"--data.corpus={bad}"]) == 1
    assert "bad.jsonl, line 2: invalid JSON" in capsys.readouterr().err
    assert _prepared_dirs(tmp_path / "cache") == []
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert main(["train", *tiny_flags(tmp_path / "b"), f"--data.corpus={empty}"]) != 0
    assert f"data.corpus = {empty} holds no example; give rows" in capsys.readouterr().err
    assert _prepared_dirs(tmp_path / "cache") == []


def test_an_interrupted_preparation_leaves_nothing(tmp_path):
    """Ctrl-C while examples are written (`tiertrain prepare`, or training preparing its rows):
    the output directory it made is gone."""
    from tiertrain.data.examples import Example, write_examples

    def examples():
        for i in range(5):
            if i == 3:
                raise KeyboardInterrupt
            yield Example(np.array([1, 2, 3], dtype=np.int64), np.array([0, 1, 1], dtype=bool))

    out = tmp_path / "sub" / "dir" / "out"
    with pytest.raises(KeyboardInterrupt):
        write_examples(str(out), examples(), vocab_size=256, eos=0, describe=dict)
    assert os.listdir(tmp_path) == []  # nor the parents made for it (sub/dir stayed)


def test_a_failed_prepare_leaves_no_directory_it_made(tmp_path, capsys):
    """`tiertrain prepare` of rows into directories that are not there yet, failing on bad rows:
    neither the output nor the parents made for it stay; of text that is not UTF-8 (into a
    directory that must exist): no token file, whole or partial."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"text": "two"\n')
    assert main(["prepare", "--input", str(bad), "--output", str(tmp_path / "rows" / "dir" / "out")]) == 1
    assert "bad.jsonl, line 2: invalid JSON" in capsys.readouterr().err
    text = tmp_path / "bad.txt"
    text.write_bytes(b"fine\n\xff\xfe not utf-8\n")
    assert main(["prepare", "--input", str(text), "--output", str(tmp_path / "out.tokens")]) == 1
    assert "is not UTF-8 text" in capsys.readouterr().err
    # an empty text: a token file of no tokens was made, which train refused later
    (tmp_path / "empty.txt").write_text("")
    assert main(["prepare", "--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "out.tokens")]) == 1
    assert "empty.txt: no text to tokenize (0 tokens)" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "bad.txt", "empty.txt"]


@pytest.mark.slow
def test_plan_leaves_no_scratch_directory(tmp_path, monkeypatch):
    """`tiertrain plan` with the default io.paths (./tiertrain-scratch), and with a path whose
    parents are not there: the probe's directories, made for it, are gone after (they stayed,
    empty)."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--probe-mib=1", "--model.n_layers=2", "--memory.host_mib=300"]) == 0
    assert not (tmp_path / "tiertrain-scratch").exists()
    assert main(["plan", "--probe-mib=1", "--model.n_layers=2", "--memory.host_mib=300", "--io.paths=a/b/c"]) == 0
    assert os.listdir(tmp_path) == []  # nor the parents made for it (a/b stayed)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_kv_cache_file_goes_after_a_checksum_error_and_a_stale_one_is_said(tmp_path, monkeypatch):
    """A read of the spilled key/value cache that fails its checksum: the error, and neither
    kv.bin nor the directory made for it left (kv.bin stayed). A kv.bin a killed generation
    left is replaced with a word (it was reused silently)."""
    from test_generate_tiers import PROMPTS, _cfg, _llama_dir

    from tiertrain.inference.generate import Sampling, generate
    from tiertrain.inference.kvcache import NAME, TieredKV
    from tiertrain.io import ChecksumError
    from tiertrain.io.scratch import LOCK, ScratchInUseError

    cfg = _cfg(tmp_path, _llama_dir(tmp_path))
    cfg.memory.kv_host_mib, cfg.io.paths = 0, [str(tmp_path / "fresh")]
    real = TieredKV.send

    def send_and_damage(self, layer, m, new):
        real(self, layer, m, new)
        p = self.pairs[layer, m]
        if p.write is not None:  # else already done: send reclaims a finished write (a race with the disk)
            p.write.get()
        with open(self.file.path, "r+b") as f:  # the bytes just written, flipped on the disk
            f.seek(p.offset)
            b = f.read(1)
            f.seek(p.offset)
            f.write(bytes([b[0] ^ 0xFF]))

    monkeypatch.setattr(TieredKV, "send", send_and_damage)
    with pytest.raises(ChecksumError):
        generate(cfg, PROMPTS, Sampling(max_new_tokens=4))
    assert not (tmp_path / "fresh").exists()
    monkeypatch.undo()
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / NAME).write_bytes(b"\0" * 4096)
    # with no lock record of a tiertrain run there, a kv.bin is the user's: refused, kept
    with pytest.raises(ScratchInUseError, match=r"fresh holds kv.bin, which no tiertrain run there recorded making"):
        generate(cfg, PROMPTS, Sampling(max_new_tokens=3))
    assert os.listdir(tmp_path / "fresh") == [NAME]
    # a killed generation's: its lock record names the file it made
    (tmp_path / "fresh" / LOCK).write_text(json.dumps({"pid": 2**22 + 7, "state": "running", "files": [NAME]}))
    lines = _Lines()
    logging.getLogger("tiertrain").addHandler(lines)
    try:
        assert generate(cfg, PROMPTS, Sampling(max_new_tokens=3))
    finally:
        logging.getLogger("tiertrain").removeHandler(lines)
    assert any(
        f"replacing {tmp_path / 'fresh' / NAME}, left by a generation that did not finish" in ln for ln in lines.lines
    ), lines.lines
    assert os.listdir(tmp_path / "fresh") == []


def test_a_generation_does_not_take_the_kv_cache_of_a_live_one(tmp_path):
    """Two generations spilling their key/value caches into one directory: the second is
    refused, naming the directory and the holder, and the live one's kv.bin is left alone (it
    was replaced as a killed one's, and both failed their checksums)."""
    from test_generate_tiers import PROMPTS, _cfg, _llama_dir

    from tiertrain.inference.generate import Sampling, generate
    from tiertrain.inference.kvcache import NAME
    from tiertrain.io.scratch import ScratchInUseError, ScratchLock

    cfg = _cfg(tmp_path, _llama_dir(tmp_path))
    shared = tmp_path / "kvs"
    cfg.memory.kv_host_mib, cfg.io.paths = 0, [str(shared)]
    live = ScratchLock([str(shared)])  # the first generation, running
    (shared / NAME).write_bytes(b"\1" * 4096)
    try:
        with pytest.raises(
            ScratchInUseError, match=rf"scratch directory {shared} is in use .*this very process, since .*: a Trainer"
        ):
            generate(cfg, PROMPTS, Sampling(max_new_tokens=2))
        assert (shared / NAME).read_bytes() == b"\1" * 4096
    finally:
        live.release(remove=True)
    (shared / NAME).unlink()
    assert generate(cfg, PROMPTS, Sampling(max_new_tokens=2))  # once it is done: the directory is free
    assert os.listdir(shared) == []  # its file and lock gone (the directory was there before it)


def _cli(tmp_path, *extra, nproc=1, env=None):
    flags = llama_rank_flags(tmp_path, "--memory.host_param_mib=0", "--memory.optim_host_mib=0", *extra)
    return subprocess.run(
        [sys.executable, "-m", "tiertrain", "train", *(["--nproc", str(nproc)] if nproc > 1 else []), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_legs_on_other_rank_counts_leave_nothing_behind(tmp_path):
    """A run killed on one rank, resumed on 2 ranks with rank 1 killed, resumed again to the
    end: the one-rank leg's files in the scratch path are removed and said by the 2-rank leg
    (they stayed, unsaid), and the ranks' rank<r> directories are gone at the end (they stayed,
    empty, after a kill and a resume)."""
    run = str(tmp_path / "run")
    one = _cli(tmp_path, "--train.steps=3", env={"TIERTRAIN_KILL_AT": "backward:6"})  # in step 2's backward
    assert one.returncode != 0
    assert (tmp_path / "ssd" / "params.bin").exists()  # the killed run's files
    two = _cli(
        tmp_path,
        "--train.steps=4",
        "--resume",
        run,
        nproc=2,
        env={"TIERTRAIN_KILL_AT": "backward:6", "TIERTRAIN_KILL_RANK": "1"},
    )
    assert two.returncode != 0
    assert (
        "removed a file a leg of this run on another number of ranks left" in two.stderr and "params.bin" in two.stderr
    ), two.stderr[-3000:]
    assert not (tmp_path / "ssd" / "params.bin").exists()
    assert not (tmp_path / "ssd" / "rank1").exists()  # the killed rank's: removed by the launcher (it stayed)
    end = _cli(tmp_path, "--train.steps=4", "--resume", run, nproc=2)
    assert end.returncode == 0, end.stderr[-3000:]
    assert [n for n in os.listdir(tmp_path / "ssd") if n.startswith("rank")] == []


@pytest.mark.slow
def test_a_killed_run_resumed_with_other_io_paths_leaves_no_scratch_behind(tmp_path):
    """Found from outside: a run killed, then resumed with other io.paths, left its scratch (its
    states' size) in the old paths for good; the resume removes it and says so, and never
    touches the scratch of a run that finished or of a live one."""
    run = str(tmp_path / "run")
    killed = _cli(tmp_path, "--train.steps=3", env={"TIERTRAIN_KILL_AT": "backward:6"})  # in step 2's backward
    assert killed.returncode != 0 and (tmp_path / "ssd" / "params.bin").exists()
    resumed = _cli(tmp_path, "--train.steps=3", "--resume", run, f"--io.paths={tmp_path / 'ssd2'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"the checkpoint's run (it did not finish) left in {tmp_path / 'ssd'}" in resumed.stderr
    assert os.listdir(tmp_path / "ssd") == [] and not (tmp_path / "ssd2").exists()


@pytest.mark.slow
def test_a_failed_start_of_ranks_leaves_no_ranks_directory(tmp_path):
    """Ranks that fail at start (here: their shard of a model the budget cannot hold): no
    `<run_dir>/ranks/` (it stayed), no run directory, no scratch made for them; the error said
    once (every rank said it)."""
    r = _cli(tmp_path, "--train.steps=2", "--memory.host_mib=1", nproc=2)
    assert r.returncode == 2 and "memory.host_mib" in r.stderr, r.stderr[-3000:]  # a config error, as one process
    assert r.stderr.count("tiertrain: config error: memory.host_mib") == 1, r.stderr[-3000:]  # rank 0 says it
    assert not (tmp_path / "run").exists() and not (tmp_path / "ssd").exists(), os.listdir(tmp_path)


def test_a_socket_directory_left_by_a_killed_start_is_removed_by_the_next(monkeypatch):
    """A trainer SIGKILLed while its engines connect leaves its socket directory in the temp
    directory (nothing of it runs to remove it); the next start removes those whose trainer is
    gone, and leaves a running trainer's alone."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from tiertrain.update.engines.sockets import socket_dir

    tmp_path = Path(tempfile.mkdtemp(prefix="tt-", dir="/tmp"))  # short: a socket's path has 107 bytes at most
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / f"tiertrain-engines-{dead.pid}-abcdefgh"
    left.mkdir()
    (left / "socket").write_text("")
    running = tmp_path / f"tiertrain-engines-{os.getppid()}-abcdefgh"
    running.mkdir()
    other = tmp_path / "tiertrain-engines-notapid"
    other.mkdir()
    made = socket_dir()
    assert os.path.dirname(made) == str(tmp_path) and os.path.basename(made).startswith(
        f"tiertrain-engines-{os.getpid()}-"
    )
    assert not left.exists() and running.exists() and other.exists()
    shutil.rmtree(tmp_path)


def test_a_disk_probe_file_of_a_killed_run_is_removed_by_the_next(tmp_path):
    """A run killed while it measured the disk left `.tiertrain-probe-<pid>` (64 MiB) that no
    later run removed. The next run on the path removes one whose process is gone, and leaves a
    live process's probe alone."""
    from tiertrain.io.scratch import clean_stale

    dead = subprocess.Popen(["true"])
    dead.wait()
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    gone, live = ssd / f".tiertrain-probe-{dead.pid}", ssd / f".tiertrain-probe-{os.getppid()}"
    for f in (gone, live):
        f.write_bytes(b"x" * 4096)
    removed = clean_stale([str(ssd)], known=["params.bin"])
    assert removed == [(str(gone), 4096)] and live.exists() and not gone.exists()


def test_a_users_files_in_io_paths_are_never_replaced_or_removed(tmp_path, capsys):
    """Files in io.paths named as tiertrain's state files, which no tiertrain run there made (a
    user's, a checkpoint's when io.paths names a checkpoint directory): they were removed as
    "stale", or overwritten by the run's own. Now a run whose states are all in memory leaves
    them, and one that would write such a file is refused before opening any, naming them."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    for name in ("params.bin", "grads.bin", "exp_avg.bin", "exp_avg_sq.bin.crc"):
        (ssd / name).write_text(f"the user's {name}")
    in_memory = [f for f in tiny_flags(tmp_path, steps=1) if not f.startswith("--memory.host_param_mib")]
    in_memory = [f for f in in_memory if f.split("=")[0] not in ("--memory.grad_host_mib", "--memory.optim_host_mib")]
    assert main(["train", *in_memory, "--memory.host_mib=4000"]) == 0
    capsys.readouterr()
    assert main(["train", *tiny_flags(tmp_path, "--train.overwrite=true", steps=1)]) == 1
    err = capsys.readouterr().err
    assert f"{ssd} holds exp_avg.bin, exp_avg_sq.bin.crc, params.bin, which no tiertrain" in err, (
        err
    )  # grads: in memory
    assert "this run would overwrite them; give io.paths an empty directory" in err, err
    for name in ("params.bin", "grads.bin", "exp_avg.bin", "exp_avg_sq.bin.crc"):
        assert (ssd / name).read_text() == f"the user's {name}", name
    # a directory of tiertrain's own: a run killed there leaves files its next run takes over
    assert main(["train", *tiny_flags(tmp_path / "own", steps=1)]) == 0


def test_a_killed_runs_files_stay_known_through_failed_starts_and_generations(tmp_path, capsys):
    """A killed run's lock record names its files. A start that failed before taking them over
    (a refused budget) removed the lock file with that record, and a generation on the same
    io.paths replaced it: the next run then took the killed run's files for a user's and was
    refused, every time. The record now stays while any file it names does."""
    from tiertrain.io.scratch import LOCK

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    killed = ["params.bin", "exp_avg.bin", "exp_avg_sq.bin", "engine0.exp_avg.bin"]
    for name in killed:
        (ssd / name).write_bytes(b"\0" * 4096)
    # an older version's record names no files: its names then (engine*.bin a pattern) are the ones known
    (ssd / LOCK).write_text(json.dumps({"pid": 2**22 + 7, "state": "running"}))
    assert main(["train", *tiny_flags(tmp_path, "--memory.host_mib=1", steps=1)]) != 0  # refused before any file
    assert sorted(os.listdir(ssd)) == sorted([LOCK, *killed])
    assert json.loads((ssd / LOCK).read_text())["files"] == sorted(killed)  # named now, each
    assert (
        main(["generate", "--prompt", "hi", "--max-new-tokens", "2", "--memory.kv_host_mib=0", f"--io.paths={ssd}"])
        == 0
    )
    assert sorted(json.loads((ssd / LOCK).read_text())["files"]) == sorted(killed)  # still, after the generation
    capsys.readouterr()
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0  # takes them over
    err = capsys.readouterr().err
    assert "which no tiertrain run there recorded making" not in err, err
    assert os.listdir(ssd) == []  # its files and the killed run's gone, the lock file with them


def test_a_lock_taken_on_a_file_its_holder_just_removed_is_taken_again(tmp_path, monkeypatch):
    """A holder that releases its lock removes the lock file while holding it: a run that opened
    the file just before locked the removed one, while a third created and locked a new file:
    two live runs each believed they held the directory. The lock is taken on the file there."""
    import fcntl

    import tiertrain.io.scratch as scratch

    flock, calls = fcntl.flock, []

    def released_meanwhile(fd, op):
        if not calls and op & fcntl.LOCK_EX:  # the holder removed the file between our open and lock
            os.unlink(tmp_path / scratch.LOCK)
        calls.append(op)
        return flock(fd, op)

    monkeypatch.setattr(scratch.fcntl, "flock", released_meanwhile)
    lock = scratch.DirLock(str(tmp_path), RuntimeError)
    assert os.fstat(lock._fd).st_ino == os.stat(tmp_path / scratch.LOCK).st_ino
    lock.release()


def test_a_leftover_named_by_a_pid_another_process_took_since_is_removed(tmp_path):
    """Found from outside: a checkpoint's .tmp-step-N-PID (a checkpoint's size) whose pid had
    been taken by another process since (a reboot, a run directory copied from another machine)
    was kept for good, as a live save's. A process that started after the leftover was last
    written is not its maker; one that ran while it was written is, and its leftover stays."""
    import time

    from tiertrain.checkpoint.manifest import clean_incomplete

    other = subprocess.Popen(["sleep", "30"])
    try:
        old = tmp_path / f".tmp-step-00000003-{other.pid}"  # written before that process started
        old.mkdir()
        (old / "params.bin").write_bytes(b"x")
        past = time.time() - 3600
        os.utime(old, (past, past))
        live = tmp_path / f".tmp-step-00000004-{os.getppid()}"  # its pid's process ran while it was written
        live.mkdir()
        assert clean_incomplete(str(tmp_path)) == [str(old)]
        assert live.exists() and not old.exists()
    finally:
        other.kill()
        other.wait()
