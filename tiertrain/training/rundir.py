"""The run directory: a run's config, metrics and (by default) checkpoints.

A run directory belongs to one run at a time (a ``DirLock``: a second run started into it
is refused, naming the holder). A new run into a directory that holds another run's work
is refused unless asked: ``--resume`` continues that run, ``train.overwrite`` deletes its
checkpoints and metrics first. After a resume, ``metrics.jsonl`` keeps the records up to
the checkpoint's step and continues from there, so no step appears twice; what it drops (a
later course's records, a damaged line) is moved to ``metrics.dropped.jsonl``, never lost.

A resumed run writes where its checkpoint now is, never where the checkpoint's stored
(absolute) paths point: a run directory that was copied or moved is continued in its new
place (``resumed_tree``), and a run resumed into another directory (``--train.run_dir``)
that holds a run of its own is refused (``RunDir.take_over``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil

from ..checkpoint import list_checkpoints, set_aside_dirs
from ..errors import ConfigError
from ..io.errors import run_dir_write_failed
from ..io.scratch import LOCK, DirInUseError, DirLock, held_by
from ..paths import fsync_path

__all__ = [
    "RunDir",
    "RunDirError",
    "METRICS",
    "CONFIG",
    "DROPPED",
    "resumed_tree",
    "same_heads",
    "abandoned_scratch",
    "no_checkpoint_advice",
    "missing_checkpoint_dir",
    "mark_saved_elsewhere",
    "refuse_a_held_run",
    "others_checkpoints",
    "stored_checkpoint_root",
    "clean_leftovers",
]

log = logging.getLogger("tiertrain")
METRICS = "metrics.jsonl"
CONFIG = "config.json"
DROPPED = "metrics.dropped.jsonl"  # what a resume took out of metrics.jsonl


class RunDirError(DirInUseError):
    """The run directory is in use, or holds another run's work."""


SAVED_ELSEWHERE = ".checkpoints-saved"  # in a run directory whose run saved a checkpoint in its checkpoint.dir


def mark_saved_elsewhere(run_dir: str, root: str) -> None:
    """A checkpoint was saved in ``root``: where that is outside run directory ``run_dir``, its
    mark (what tells a checkpoint.dir gone missing from one that never held a checkpoint)."""
    if _under(root, run_dir) is None and not os.path.exists(os.path.join(run_dir, SAVED_ELSEWHERE)):
        with contextlib.suppress(OSError):
            open(os.path.join(run_dir, SAVED_ELSEWHERE), "w").close()


def missing_checkpoint_dir(run_dir: str) -> str:
    """Where run directory ``run_dir``'s run keeps its checkpoints outside it (its checkpoint.dir)
    and that directory is missing (a disk not mounted), what to say ('' otherwise): it was called
    a run that stopped before its first checkpoint, with advice that deleted its metrics."""
    kept = stored_checkpoint_root(run_dir)
    if kept is None or os.path.isdir(kept) or not os.path.exists(os.path.join(run_dir, SAVED_ELSEWHERE)):
        return ""  # (without the mark, the run saved none there: its first save failed, or it stopped before)
    return (
        f"its checkpoints are kept in {kept} (checkpoint.dir, in {os.path.join(run_dir, CONFIG)}), which is "
        "missing (a disk not mounted?): put it back"
    )


def no_checkpoint_advice(run_dir: str) -> str:
    """A run directory whose run stopped before its first checkpoint: nothing to resume."""
    missing = missing_checkpoint_dir(run_dir)
    if missing:
        return f"{missing} and continue it with `tiertrain train --resume {run_dir}`, or give another --train.run_dir"
    return (
        f"the run in {run_dir} stopped before its first checkpoint: there is nothing to resume; start it over "
        "with --train.overwrite=true, without --resume (deletes its metrics), or give another --train.run_dir"
    )


def _busy(path: str, who: str) -> RunDirError:
    return RunDirError(
        f"train.run_dir {path} is in use by another tiertrain run ({who}); wait for it to finish, stop it, "
        "or give this run another --train.run_dir"
    )


def _checkpoints_busy(path: str, who: str) -> RunDirError:
    return RunDirError(
        f"checkpoint.dir {path} is in use by another tiertrain run ({who}): runs sharing one save their "
        "checkpoints over each other's; give this run a checkpoint.dir of its own"
    )


class RunDir:
    """Run directory ``path`` (checkpoints under ``checkpoint_root``), locked for this run."""

    def __init__(self, path: str, checkpoint_root: str, owner: str | None = None) -> None:
        """``owner``: the run directory the user gave, where ``path`` is a rank's subdirectory."""
        self.path, self.checkpoint_root = os.path.abspath(path), os.path.abspath(checkpoint_root)
        self.owner = os.path.abspath(owner or path)
        self.lock = DirLock(self.path, _busy)
        # a checkpoint.dir outside the run directory is locked too (rank 0's, for the ranks): two live
        # runs sharing one saved the same step-N names over each other's (one run's all lost)
        self.checkpoint_lock: DirLock | None = None
        if self.path == self.owner and _under(self.checkpoint_root, self.path) is None:
            try:
                self.checkpoint_lock = DirLock(self.checkpoint_root, _checkpoints_busy)
            except BaseException:
                self.lock.release(remove=not self.holds_a_run())
                raise
        self.metrics_path = os.path.join(self.path, METRICS)
        self.config_path = os.path.join(self.path, CONFIG)

    def holds_a_run(self) -> list[str]:
        """What of an earlier run is here (empty: nothing)."""
        return _held(self.path, list_checkpoints(self.checkpoint_root))

    def start_fresh(self, overwrite: bool, world: int = 1) -> None:
        """Before a new (not resumed) run: refuse a directory with another run's work unless
        ``overwrite``, which deletes it (rank 0's, of a run on ``world`` ranks: with the
        subdirectories of the ranks beyond them, ``ranks/N``, that the earlier run had)."""
        if not refuse_a_held_run(self.path, self.checkpoint_root, overwrite, self.owner):
            return
        gone: list[str] = []
        if self.path == self.owner:  # rank 0 (or one rank): the checkpoints, every rank's, are its to delete
            self._drop_ranks_from(world)
            # (and a later course a resume set aside, superseded-step-N: the run's too)
            gone = list_checkpoints(self.checkpoint_root) + set_aside_dirs(self.checkpoint_root, "superseded")
        if gone:  # asked for (train.overwrite), said: they cannot be had back
            log.warning(
                "train.overwrite: deleting %d checkpoint(s) of the earlier run in %s (%s)",
                len(gone),
                self.checkpoint_root,
                ", ".join(os.path.basename(c) for c in gone[:4]) + (", ..." if len(gone) > 4 else ""),
            )
        for ck in gone:  # (ranks sharing a checkpoint.dir delete the same ones at once: gone is gone)
            shutil.rmtree(ck, onerror=_gone_is_fine)
        for name in (METRICS, CONFIG, SAVED_ELSEWHERE):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.path, name))

    def _drop_ranks_from(self, world: int) -> None:
        """The metrics and config of ranks ``world`` and up (``ranks/N``: an earlier run's, on more
        ranks) deleted with train.overwrite, and their directories where that leaves them empty;
        a rank directory a live process holds, or a file of another name, is left."""
        ranks = os.path.join(self.path, "ranks")
        names = os.listdir(ranks) if os.path.isdir(ranks) else []
        for d in (os.path.join(ranks, n) for n in names if n.isdigit() and int(n) >= world):
            if not os.path.isdir(d) or held_by(d) is not None:
                continue
            for name in (METRICS, CONFIG, DROPPED, LOCK):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(d, name))
            with contextlib.suppress(OSError):
                os.rmdir(d)
        with contextlib.suppress(OSError):
            os.rmdir(ranks)  # where nothing is left in it

    def continue_metrics(self, step: int) -> int:
        """Keep the metrics of steps up to ``step`` (a resumed checkpoint's); move the rest (a
        later course of the run, a damaged line, one cut short by a crash) to ``DROPPED``,
        saying so. Return how many records were kept."""
        if not os.path.exists(self.metrics_path):
            return 0
        kept, later, damaged = [], [], []
        with open(self.metrics_path, "rb") as f:
            for n, raw in enumerate(f, 1):
                line = raw.rstrip(b"\n") + b"\n"
                try:
                    rec = json.loads(raw)
                except ValueError:
                    rec = None
                if not (isinstance(rec, dict) and isinstance(rec.get("step"), int)):
                    damaged.append((n, line))
                elif rec["step"] <= step:
                    kept.append(line)
                else:
                    later.append(line)
        if later or damaged:
            self._set_aside(step, later, damaged)
        _replace(self.metrics_path, kept, "the step records")  # after the dropped lines are safe in DROPPED
        return len(kept)

    def _set_aside(self, step: int, later: list[bytes], damaged: list[tuple[int, bytes]]) -> None:
        path = os.path.join(self.path, DROPPED)
        try:
            with open(path, "ab") as f:
                f.writelines([*later, *(line for _, line in damaged)])
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # the metrics as they were: nothing is lost, the run does not start
            raise run_dir_write_failed(path, "the step records a resume sets aside", exc) from None
        if damaged:
            lines = ", ".join(str(n) for n, _ in damaged[:5]) + (", ..." if len(damaged) > 5 else "")
            log.warning(
                "%s: %d damaged line(s) (line %s) are not step records; moved to %s",
                self.metrics_path,
                len(damaged),
                lines,
                path,
            )
        if later:
            log.info(
                "%s: the %d record(s) of steps after %d (a later course of the run) moved to %s",
                self.metrics_path,
                len(later),
                step,
                path,
            )

    def take_over(self, checkpoint: str, overwrite: bool, world: int = 1) -> None:
        """Before a run resumed from ``checkpoint``: where the checkpoint is not one of this run
        directory's own, the directory must hold no other run (``overwrite``: delete it; a run on
        ``world`` ranks)."""
        if _same(os.path.dirname(os.path.normpath(checkpoint)), self.checkpoint_root):
            return  # the run continues in its own directory
        log.info("resuming %s into run directory %s", checkpoint, self.path)
        self.start_fresh(overwrite, world)

    def write_config(self, tree: dict) -> None:
        _replace(self.config_path, [json.dumps(tree, indent=1).encode()], "the run's config")

    def release(self, *, remove_if_empty: bool = False) -> None:
        """Give up the lock; ``remove_if_empty``: a run that stopped before writing anything
        leaves no directory behind (when it made it)."""
        # nothing of a run here (a model directory refused as one: no lock file left in it either)
        empty = remove_if_empty and (not self.holds_a_run() or bool(_not_a_runs_config(self.config_path)))
        self.lock.release(remove=empty)
        if self.checkpoint_lock is not None:
            self.checkpoint_lock.release(remove=True)  # (its directory too where this run made it and left it empty)
            self.checkpoint_lock = None


def refuse_a_held_run(
    path: str, checkpoint_root: str, overwrite: bool, owner: str | None = None, *, probe: bool = False
) -> bool:
    """Raise ``RunDirError`` where run directory ``path`` holds another run's work (or a
    config.json not a run's) and ``overwrite`` is off, or where ``checkpoint_root`` (a
    checkpoint.dir outside it) holds another live run's checkpoints, whatever ``overwrite``; True
    where it holds a run to delete (``overwrite``). ``owner``: the run directory the user gave
    (a rank's ``path`` is its subdirectory). Reads only: the CLI asks it (``probe``: a live
    run's directory refused as in use) before the run's plan, whose probes take seconds."""
    checkpoints = list_checkpoints(checkpoint_root)
    found = _held(path, checkpoints)
    if not found:
        return False
    who = held_by(path) if probe else None  # (``probe``: the CLI's, before this run holds the lock)
    if who is not None:  # a live run's: said as such (not advice to resume or overwrite it)
        raise _busy(path, who)
    others = others_checkpoints(checkpoint_root, checkpoints, owner or path)
    if others:  # a checkpoint.dir shared with another run: its checkpoints are never this run's to delete
        run, names = others
        raise RunDirError(
            f"checkpoint.dir {checkpoint_root} holds checkpoints of run {run} ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}), not of train.run_dir {owner or path}: give this run a "
            "checkpoint.dir of its own (runs sharing one delete and resume each other's checkpoints)"
        )
    config_path = os.path.join(path, CONFIG)
    foreign = _not_a_runs_config(config_path)
    if foreign:  # a model directory's (say): never "a run", never deleted by train.overwrite
        raise RunDirError(
            f"train.run_dir {path} holds a config.json that is not a tiertrain run's ({foreign}): a run "
            "writes its own config.json there; give another --train.run_dir (a model directory is read "
            "through --model.hf_dir, never trained into)"
        )
    if overwrite:
        return True
    metrics = os.path.join(path, METRICS)
    if not checkpoints and (not os.path.exists(metrics) or not os.path.getsize(metrics)):
        # a run that stopped before its first step (a rank that failed at start): nothing of it to keep
        if not probe:  # (the trainer says it)
            log.info("train.run_dir %s holds a run that stopped before its first step (%s): started over", path,
                     ", ".join(found))  # fmt: skip
        return True
    shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    if not checkpoints:  # --resume would be refused: not offered
        raise RunDirError(f"train.run_dir {path} already holds a run ({shown}); {no_checkpoint_advice(path)}")
    raise RunDirError(
        f"train.run_dir {path} already holds a run ({shown}); continue it with "
        f"`tiertrain train --resume {owner or path}`, start over with --train.overwrite=true "
        "(deletes its checkpoints and metrics), or give another --train.run_dir"
    )


def others_checkpoints(checkpoint_root: str, checkpoints: list[str], run_dir: str) -> tuple[str, list[str]] | None:
    """(another run directory, its checkpoints' names) where ``checkpoint_root``, outside run
    directory ``run_dir``, holds ``checkpoints`` whose run (their config's ``train.run_dir``) is
    another that still holds a run; None where every one is this run's, or its run is gone (a
    run directory moved: its checkpoints are the moved run's)."""
    from ..checkpoint import CheckpointError, Manifest

    if _under(checkpoint_root, run_dir) is not None:
        return None  # checkpoints inside the run directory (copied or moved with it) are its own
    theirs: dict[str, list[str]] = {}
    for ck in checkpoints:
        try:
            run = (Manifest.read(ck).config.get("train") or {}).get("run_dir")
        except CheckpointError:
            continue  # (a damaged one is said where it is resumed)
        if isinstance(run, str) and not _same(run, run_dir) and os.path.exists(os.path.join(run, CONFIG)):
            theirs.setdefault(run, []).append(os.path.basename(ck))
    return next(iter(theirs.items()), None)


def run_dir_of(path: str) -> str | None:
    """The ``train.run_dir`` the config.json in ``path`` names (None: no run's config there)."""
    try:
        with open(os.path.join(path, CONFIG)) as f:
            run = (json.load(f).get("train") or {}).get("run_dir")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def resumed_run_dir(where: str, checkpoint: str, stored: dict) -> str | None:
    """``--resume RUN_DIR`` whose checkpoints lie outside it (checkpoint.dir): the run directory
    to continue in where its run was moved (RUN_DIR; None: nothing to change). Refused where
    ``checkpoint`` (found in that checkpoint.dir, ``stored`` its config) is the latest of
    another run that still writes there: a copy of a run directory shares its checkpoint.dir
    with the original (continuing it wrote the original's metrics and pruned its checkpoints),
    and runs given one checkpoint.dir find each other's checkpoints there."""
    root = stored_checkpoint_root(where)
    if root is None or _under(checkpoint, root) is None or _under(root, where) is not None:
        return None  # (checkpoints inside the run directory move with it: ``resumed_tree``)
    theirs = (stored.get("train") or {}).get("run_dir")
    if not isinstance(theirs, str) or _same(theirs, where):
        return None
    their_root = stored_checkpoint_root(theirs) if os.path.exists(os.path.join(theirs, CONFIG)) else None
    if their_root is None or not _same(their_root, root):
        return os.path.abspath(where)  # its run directory moved here (nothing there writes into root)
    copy = _same(run_dir_of(where) or where, theirs)  # this directory's config names the other: a copy of it
    raise RunDirError(
        f"--resume {where}: its checkpoint.dir {root} is shared with run {theirs}, whose checkpoint "
        f"{os.path.basename(checkpoint)} is the latest there"
        + (f" ({where} is a copy of it)" if copy else "")
        + f"; continuing it would write {theirs}'s metrics and prune its checkpoints. To branch from it: "
        f"tiertrain train --resume {checkpoint} --train.run_dir=NEW_DIR --checkpoint.dir=NEW_DIR/checkpoints"
    )


def stored_checkpoint_root(run_dir: str) -> str | None:
    """Where run directory ``run_dir``'s run writes checkpoints when that is not under it (its
    config.json's ``checkpoint.dir``, made absolute as the run made it; None: under it, or no
    run there)."""
    try:
        with open(os.path.join(run_dir, CONFIG)) as f:
            tree = json.load(f)
    except (OSError, ValueError):
        return None
    ck = (tree.get("checkpoint") or {}).get("dir") if isinstance(tree, dict) else None
    if not isinstance(ck, str) or not ck:
        return None
    if not os.path.isabs(ck):
        return os.path.join(run_dir, ck)
    ran = (tree.get("train") or {}).get("run_dir")  # a checkpoint.dir within the run directory moves with it
    inside = _under(ck, ran) if isinstance(ran, str) and os.path.isabs(ran) else None
    return os.path.normpath(os.path.join(run_dir, inside)) if inside is not None else ck


def _held(path: str, checkpoints: list[str]) -> list[str]:
    """What of an earlier run is in run directory ``path`` with its ``checkpoints`` (empty: nothing)."""
    found = [os.path.basename(p) for p in checkpoints]
    for name in (METRICS, CONFIG):
        if os.path.exists(os.path.join(path, name)):
            found.append(name)
    return found


def _replace(path: str, chunks: list[bytes], what: str) -> None:
    """``path`` replaced whole by ``chunks`` (written aside, synced, renamed: the old file stays
    until the new one is complete); a failure (a full disk) is one line naming the file, no
    temporary file left."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.writelines(chunks)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(os.path.dirname(os.path.abspath(path)))  # the rename itself on the disk
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise run_dir_write_failed(path, what, exc) from None


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _under(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` where it lies within it ('.' for ``root`` itself), else None."""
    rel = os.path.relpath(path, root)
    return None if rel == ".." or rel.startswith(".." + os.sep) else rel


def resumed_tree(stored: dict, checkpoint: str, given: dict, where: str | None = None) -> dict:
    """The config a run resumed from ``checkpoint`` runs with: its ``stored`` config tree, the
    user's sections ``given`` (a file's and flags') on top, and its run directory where the
    checkpoint now is. A checkpoint whose run directory was copied or moved continues in the
    new place (checkpoints, metrics, and a scratch directory that lay inside the run directory
    move with it); one that cannot be placed so needs ``--train.run_dir``. ``train.overwrite``
    is never taken from the stored config (it would delete the work of whatever directory the
    resumed run names)."""
    tree = {section: dict(values) for section, values in stored.items() if isinstance(values, dict)}
    train, ck = tree.setdefault("train", {}), tree.setdefault("checkpoint", {})
    train["overwrite"] = False
    run_dir, ck_dir = train.get("run_dir"), ck.get("dir")
    # ``where``: what --resume named (a run directory whose checkpoints lie outside it: another run's
    # refused, a moved one's continued where it is now); a --train.run_dir given decides alone
    moved = resumed_run_dir(where, checkpoint, stored) if where and "run_dir" not in given.get("train", {}) else None
    if run_dir and moved is not None:
        _relocate(tree, run_dir, moved)
    elif run_dir:
        root = ck_dir or os.path.join(run_dir, "checkpoints")
        here = os.path.dirname(os.path.abspath(os.path.normpath(checkpoint)))
        if not _same(root, here):
            _move(tree, run_dir, root, here, "run_dir" in given.get("train", {}))
    changed = [
        f"{section}.{k} {tree.get(section, {}).get(k)!r} -> {v!r}"
        for section, values in given.items()
        for k, v in values.items()
        if _differs(tree.get(section, {}).get(k), v) and (section, k) != ("train", "steps")
    ]
    if changed:  # said: a resumed run that trains otherwise than it began is the user's choice, never silent
        log.info("resume: settings changed from the checkpoint's config: %s", ", ".join(changed))
    _same_adapter_kind(stored, given, checkpoint)
    same_heads(
        {**(stored.get("model") or {}), **given.get("model", {})}, stored.get("model") or {}, f"--resume {checkpoint}"
    )
    for section, values in given.items():
        tree.setdefault(section, {}).update(values)
    return tree


def _differs(stored, given) -> bool:
    """Whether a flag's value ``given`` (text, or a file's value) is another than the stored
    one: a path with a trailing '/', a list given as 'a,b', 1e-3 for 0.001 are the same."""

    def norm(v):
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        text = str(v).strip()
        if text.lower() in ("true", "false", "none", "null"):
            return text.lower().replace("null", "none")
        try:
            return float(text)
        except ValueError:  # (a path as given: relative to here, as the config makes it absolute)
            return os.path.abspath(text) if os.sep in text else text

    if isinstance(stored, (list, tuple)) and isinstance(given, str):
        given = [x for x in given.split(",") if x]
    if isinstance(stored, str) and os.path.isabs(stored) and isinstance(given, str):  # a path, stored absolute
        return os.path.normpath(stored) != os.path.abspath(given)
    return norm(stored) != norm(given)


def _same_adapter_kind(stored: dict, given: dict, checkpoint: str) -> None:
    """A resumed run's adapter kind is its checkpoint's. Checked here, before the merged config
    is validated: a kind another than the run was made with would otherwise first be refused for
    the settings that suit the checkpoint's kind (its update mode), not for the kind itself."""
    kind = given.get("adapter", {}).get("kind")
    theirs = stored.get("adapter") or {}
    if kind is None or kind == theirs.get("kind", "none"):
        return
    from dataclasses import asdict

    from ..adapters.train import same_adapter_config
    from ..config import AdapterConfig

    ours = {**asdict(AdapterConfig()), **theirs, **given["adapter"]}
    same_adapter_config(ours, theirs, f"checkpoint {checkpoint}")


def abandoned_scratch(stored: dict, paths: list[str]) -> None:
    """The scratch files a checkpoint's run left in its io.paths (``stored``: its config) where
    the run resumed from it uses others (``paths``) and no run holds them: a run killed and
    resumed elsewhere left its states' size there for good."""
    from ..io.scratch import clean_abandoned

    theirs = (stored.get("io") or {}).get("paths") or []
    old = [p for p in theirs if isinstance(p, str) and not any(_same(p, q) for q in paths)]
    clean_abandoned(old, "the checkpoint's run (it did not finish)")


def same_heads(ours: dict, theirs: dict, where: str) -> None:
    """A built-in model's heads (``ours``: the model section a run resumes with) are its
    checkpoint's (``theirs``): other heads over weights of the same shapes are another model,
    which the checkpoint's parameter check cannot see (resumed with --model.n_heads=4 over a
    model of 8, the run went on with a note of a changed setting)."""
    if theirs.get("hf_dir") or ours.get("hf_dir"):
        return  # (a Hugging Face model's heads are its config.json's)

    def heads(m: dict) -> tuple[str, str]:
        n = str(m.get("n_heads", 4))
        kv = m.get("n_kv_heads")
        return n, n if kv is None or str(kv).lower() in ("none", "null") else str(kv)

    if heads(theirs) != heads(ours):
        (n, kv), (n2, kv2) = heads(theirs), heads(ours)
        raise ConfigError(
            f"{where}: model.n_heads {n2}, n_kv_heads {kv2} where the checkpoint's model has {n} and {kv}: the "
            "same weights under other heads are another model; resume with the checkpoint's heads, or start a "
            "new run from its export (model.init_from)"
        )


def _not_a_runs_config(path: str) -> str:
    """Why the config.json at ``path`` is not a tiertrain run's ('' where it is one, or none is
    there): a run's is its config tree, a section per table, ``train`` and ``model`` among them."""
    if not os.path.exists(path):
        return ""
    try:
        with open(path, "rb") as f:
            tree = json.load(f)
    except (OSError, ValueError):
        return ""  # a run's, damaged (a model's config reads): the run's start-over may replace it
    if not isinstance(tree, dict):
        return "not a JSON object"
    if isinstance(tree.get("train"), dict) and isinstance(tree.get("model"), dict):
        return ""
    kind = tree.get("model_type")
    return f"a transformers model's, model_type {kind!r}" if kind else "it has no [train] and [model] sections"


def _move(tree: dict, run_dir: str, root: str, here: str, run_dir_given: bool) -> None:
    """The run's directories moved: its checkpoints were in ``root`` and are now in ``here``."""
    rel = _under(root, run_dir)  # where the checkpoints lay within the run directory ("checkpoints")
    new_run = None
    if rel == ".":
        new_run = here
    elif rel is not None and here.endswith(os.sep + rel):
        new_run = here[: -len(rel) - 1]
    if tree["checkpoint"].get("dir"):
        tree["checkpoint"]["dir"] = here  # next to the checkpoint resumed, never the old place
    if new_run is None:
        if not run_dir_given:
            raise RunDirError(
                f"checkpoint directory {here} is not where its run wrote it ({root}), and not within a run "
                f"directory as it was there; give the resumed run's directory with --train.run_dir (it is "
                f"never {run_dir} unless named)"
            )
        return
    _relocate(tree, run_dir, new_run)


def _relocate(tree: dict, run_dir: str, new_run: str) -> None:
    """The run's directory ``run_dir`` is now ``new_run``: the run writes there, and a scratch
    directory that lay within it moves with it."""
    for i, p in enumerate(paths := list(tree.get("io", {}).get("paths") or [])):
        inside = _under(p, run_dir)
        if inside is not None:
            paths[i] = os.path.normpath(os.path.join(new_run, inside))
    if paths:
        tree["io"]["paths"] = paths
    tree["train"]["run_dir"] = new_run
    log.info("the run directory %s was copied or moved to %s: the resumed run writes there", run_dir, new_run)


def _gone_is_fine(fn, path: str, exc_info) -> None:
    """``shutil.rmtree``'s error handler: a file or directory another process removed first is
    no error; anything else is."""
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


def clean_leftovers(
    user_paths: list[str], group, checkpoint_root: str, paths: list[str], lock, keep: list[str]
) -> None:
    """What an earlier run left in this run's directories, removed and said: a leg of this run on
    another number of ranks, an interrupted checkpoint, a damaged one (set aside; rank 0 for these
    shared ones), and the stale scratch files of the runs ``lock``'s record names (``keep``: this
    run's own, made again)."""
    from ..checkpoint import clean_incomplete, set_aside_damaged
    from ..io.scratch import clean_other_legs, clean_stale

    mib = 1 << 20
    if group.leader:
        for path, size in clean_other_legs(user_paths, group.world):
            log.info(
                "removed a file a leg of this run on another number of ranks left: %s (%.1f MiB)", path, size / mib
            )
        for path in clean_incomplete(checkpoint_root):
            log.warning("removed an incomplete checkpoint left by an interrupted save: %s", path)
        for was, now in set_aside_damaged(checkpoint_root):
            log.warning("%s has no manifest (a damaged checkpoint, never loaded): moved to %s", was, now)
    for path, size in clean_stale(paths, lock.previous_files(), keep=keep):
        log.info("removed a stale file of an earlier run: %s (%.1f MiB)", path, size / mib)
