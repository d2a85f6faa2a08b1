"""Checkpoint manifests: what a complete checkpoint holds, with sizes and checksums.

A checkpoint is a directory ``step-NNNNNNNN`` that is either complete or absent: it is
written as ``.tmp-step-...``, every file fsynced, the manifest written last, then renamed.
A directory without a readable manifest is not a checkpoint.

The manifest carries a CRC32C of its own content (``checksum``: over the canonical JSON of
every other field), checked before any value in it is used: an edit or a flipped bit that
leaves valid JSON (``"step": 30`` -> ``20``) is refused, not trusted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from ..errors import TiertrainError
from ..io.checksum import crc32c
from ..paths import pid_alive

__all__ = [
    "Manifest",
    "FileEntry",
    "CheckpointError",
    "CheckpointMismatch",
    "list_checkpoints",
    "latest_checkpoint",
    "find_checkpoint",
    "step_of",
    "clean_incomplete",
    "set_aside",
    "set_aside_dirs",
    "verify_checkpoint",
    "intact_checkpoint",
    "MANIFEST",
]

log = logging.getLogger("tiertrain")
MANIFEST = "manifest.json"
# 3: the parameters' names and shapes recorded (``params``); 2: the manifest has a checksum of
# its own; 1 (read, with a warning): it has none
VERSION = 3
_NAME = re.compile(r"^step-(\d{8})$")


def _canonical_crc(body: dict) -> int:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return crc32c(np.frombuffer(text.encode(), dtype=np.uint8))


class CheckpointError(TiertrainError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit this run."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint made with another config than this run's (no earlier checkpoint, and
    no fresh start, is the remedy: the config it was made with is)."""


@dataclass
class FileEntry:
    name: str
    size: int
    crc32c: int


@dataclass
class Manifest:
    step: int
    files: list[FileEntry]
    config: dict
    units: list[int]  # element count of every unit, the layout fingerprint
    param_dtype: str
    version: int = VERSION
    weights: str = ""  # the file of the state that holds the weights ('' in older checkpoints)
    weights_dtype: str = ""
    # the compute dtype, where the weights file holds a 4-bit base (its dtype is then uint8)
    compute_dtype: str = ""
    # the ranks that trained it (0: not recorded, older checkpoints); each rank's micro-batches
    # are its own, so a run resumed on other ranks takes another global batch (said at resume)
    ranks: int = 0
    # every parameter's name, shape and place, summed up (``FlatLayout.fingerprint``): models whose
    # units pad to the same sizes (a tied head and an untied one) differ here ('' before version 3)
    params: str = ""
    # fine-tuning rows read by the end of its step (0: not recorded, or raw text: step x the
    # global batch); a run resumed with another global batch goes on from there (``ExampleBatches``)
    rows: int = 0
    # those rows' content (``PreparedExamples.identity``: counts and checksums): rows changed between
    # a checkpoint and its resume are said ('' for raw text, and before it was recorded)
    rows_of: str = ""
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def entry(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)

    def write(self, directory: str) -> None:
        path = os.path.join(directory, MANIFEST)
        body = asdict(self)
        if not body["compute_dtype"]:  # only a 4-bit base records it: other manifests stay as older readers know them
            del body["compute_dtype"]
        if not body["rows"]:  # only fine-tuning rows record it
            del body["rows"]
        if not body["rows_of"]:
            del body["rows_of"]
        body["version"] = VERSION
        body["checksum"] = _canonical_crc(body)
        with open(path, "w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, directory: str) -> "Manifest":
        path = os.path.join(directory, MANIFEST)
        if not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint {directory} does not exist")
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{directory} is not a complete checkpoint: it has no {MANIFEST}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} is corrupt ({exc}); use an earlier checkpoint") from None
        if not isinstance(d, dict):
            raise CheckpointError(f"{path} is corrupt (not a JSON object); use an earlier checkpoint")
        version = d.get("version")
        if version in (2, VERSION):
            stored = d.pop("checksum", None)
            if not isinstance(stored, int) or stored != _canonical_crc(d):
                raise CheckpointError(
                    f"{path} is corrupt (its content does not match its checksum); use an earlier checkpoint"
                )
        elif version == 1:
            log.warning(
                "%s was written by an older tiertrain and has no checksum of its own: its values are trusted", path
            )
        else:
            raise CheckpointError(
                f"{path}: checkpoint format version {version!r}, this tiertrain reads {VERSION}, 2 and 1 "
                "(a later tiertrain wrote it: upgrade tiertrain to read it)"
            )
        try:
            names = {f.name for f in fields(cls)}
            if set(d) - names:
                raise KeyError(", ".join(sorted(set(d) - names)))
            d["version"] = VERSION
            d["files"] = [FileEntry(**e) for e in d["files"]]
            man = cls(**d)
        except (KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{path} is corrupt (missing or bad field {exc}); use an earlier checkpoint"
            ) from None
        if not isinstance(man.step, int) or man.step < 0:
            raise CheckpointError(f"{path} is corrupt (step {man.step!r}); use an earlier checkpoint")
        m = _NAME.match(os.path.basename(os.path.normpath(directory)))
        if m and int(m.group(1)) != man.step:
            raise CheckpointError(
                f"{path} says step {man.step} but its directory is step {int(m.group(1))}; "
                "the checkpoint was renamed or edited: use an earlier checkpoint"
            )
        return man


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoints under ``root`` (those with a manifest), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and os.path.exists(os.path.join(root, name, MANIFEST)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return [p for _, p in sorted(found)]


# a save's own, its process id last: a checkpoint being written, the older copy of a step set
# aside while it is replaced, a checkpoint being deleted (pruned, or superseded)
_LEFT = re.compile(r"^(?:\.tmp-step-\d{8}|\.drop-(?:superseded-)?step-\d{8}(?:-\d+)?|(step-\d{8})\.old)-(\d+)$")


def clean_incomplete(root: str) -> list[str]:
    """Remove what interrupted saves left under ``root`` (``.tmp-step-*`` and ``.drop-step-*``
    directories, and the older copy of a step set aside while it was replaced:
    ``step-N.old-PID``); return them.
    Those of a process still alive (another run saving into the same directory) are left; a
    set-aside copy whose step is missing (the save died between its two renames) is put back,
    not removed: it is that step's only complete copy."""
    import shutil

    if not os.path.isdir(root):
        return []
    gone = []
    for name in sorted(os.listdir(root)):
        m = _LEFT.match(name)
        if m is None or (int(m.group(2)) != os.getpid() and pid_alive(int(m.group(2)), os.path.join(root, name))):
            continue
        path, step = os.path.join(root, name), m.group(1)
        if step and not os.path.exists(os.path.join(root, step)) and os.path.exists(os.path.join(path, MANIFEST)):
            os.rename(path, os.path.join(root, step))
            log.warning("%s: a save that replaced it was interrupted; its earlier copy %s put back", step, path)
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


def set_aside_damaged(root: str) -> list[tuple[str, str]]:
    """Move the directories under ``root`` named like checkpoints but without a manifest (a
    damaged checkpoint: ``list_checkpoints`` skips them, and a save of their step would replace
    them) to ``damaged-step-NNNNNNNN[-k]`` beside them; return (was, now) for each."""
    if not os.path.isdir(root):
        return []
    found = [
        os.path.join(root, name)
        for name in sorted(os.listdir(root))
        if _NAME.match(name)
        and os.path.isdir(os.path.join(root, name))
        and not os.path.exists(os.path.join(root, name, MANIFEST))
    ]
    return list(zip(found, set_aside(found, "damaged")))


def set_aside_dirs(root: str, why: str) -> list[str]:
    """The directories ``set_aside`` made under ``root`` for ``why``, oldest step first."""
    pattern = re.compile(rf"^{re.escape(why)}-step-\d{{8}}(-\d+)?$")
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [os.path.join(root, n) for n in names if pattern.match(n)]


def set_aside(paths: list[str], why: str) -> list[str]:
    """Rename checkpoint directories ``paths`` to ``<why>-step-NNNNNNNN[-k]`` beside them (a name
    no resume takes), durably; return the new paths."""
    from ..paths import fsync_path

    moved = []
    for path in paths:
        root, name = os.path.split(path)
        new, k = os.path.join(root, f"{why}-{name}"), 1
        while os.path.exists(new):
            k += 1
            new = os.path.join(root, f"{why}-{name}-{k}")
        os.rename(path, new)
        moved.append(new)
    if moved:
        fsync_path(os.path.dirname(moved[0]))
    return moved


def step_of(checkpoint: str) -> int:
    """The step a checkpoint directory ``step-NNNNNNNN`` holds, by its name."""
    m = _NAME.match(os.path.basename(os.path.normpath(checkpoint)))
    if m is None:
        raise ValueError(f"{checkpoint} is not named like a checkpoint (step-NNNNNNNN)")
    return int(m.group(1))


def latest_checkpoint(root: str) -> str | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def find_checkpoint(where: str, what: str = "checkpoint") -> str:
    """The checkpoint ``where`` names: a checkpoint directory, or a run directory or a
    checkpoints directory (their latest complete checkpoint)."""
    if os.path.exists(os.path.join(where, MANIFEST)):
        return where
    if os.path.isfile(where):  # a file of a checkpoint, say: its directory is what is meant
        inside = os.path.dirname(os.path.abspath(where))
        hint = f" (it is in the checkpoint {inside})" if os.path.exists(os.path.join(inside, MANIFEST)) else ""
        raise CheckpointError(f"{what} {where} is a file{hint}; give a checkpoint or run directory")
    if not os.path.isdir(where):
        raise CheckpointError(f"{what} {where}: no such directory; give a checkpoint or run directory")
    found = latest_checkpoint(os.path.join(where, "checkpoints")) or latest_checkpoint(where)
    if found is None:
        raise CheckpointError(
            f"{what} {where}: no complete checkpoint there (a checkpoint directory has a {MANIFEST}; "
            "a run directory has them under checkpoints/)"
        )
    return found


def verify_checkpoint(directory: str, chunk: int = 16 << 20) -> str:
    """Why ``directory`` is not an intact checkpoint ('' where it is): its manifest reads and
    checks, and every file it names is there with its size and CRC32C (every byte read)."""
    try:
        man = Manifest.read(directory)
    except CheckpointError as exc:
        return str(exc)
    for entry in man.files:
        path = os.path.join(directory, entry.name)
        try:
            if os.path.getsize(path) != entry.size:
                return f"{path} has {os.path.getsize(path)} bytes, the manifest says {entry.size}"
            crc = 0
            with open(path, "rb") as f:
                while block := f.read(chunk):
                    crc = crc32c(np.frombuffer(block, dtype=np.uint8), crc)
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
        if crc != entry.crc32c:
            return f"{path} is corrupt (crc32c {crc:#010x}, the manifest says {entry.crc32c:#010x})"
    return ""


def intact_checkpoint(root: str, *, before: int | None = None, skip: str | None = None) -> str | None:
    """The newest checkpoint under ``root`` (of a step below ``before``, other than ``skip``)
    that ``verify_checkpoint`` finds intact, or None."""
    for path in reversed(list_checkpoints(root)):
        if skip is not None and os.path.abspath(path) == os.path.abspath(skip):
            continue
        if before is not None and step_of(path) >= before:
            continue
        if not verify_checkpoint(path):
            return path
    return None
