"""Checkpoint manifests: what a complete checkpoint holds, with sizes and checksums.

A checkpoint is a directory ``step-NNNNNNNN`` that is either complete or absent: it is
written as ``.tmp-step-...``, every file fsynced, the manifest written last, then renamed.
A directory without a readable manifest is not a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field

__all__ = ["Manifest", "FileEntry", "CheckpointError", "list_checkpoints", "latest_checkpoint", "clean_incomplete", "MANIFEST"]

MANIFEST = "manifest.json"
VERSION = 1
_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit this run."""


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
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def entry(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)

    def write(self, directory: str) -> None:
        path = os.path.join(directory, MANIFEST)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)
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
        try:
            if d["version"] != VERSION:
                raise CheckpointError(f"{path}: checkpoint format version {d['version']}, this tiertrain reads {VERSION}")
            d["files"] = [FileEntry(**e) for e in d["files"]]
            return cls(**d)
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{path} is corrupt (missing or bad field {exc}); use an earlier checkpoint") from None


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


def clean_incomplete(root: str) -> list[str]:
    """Remove what interrupted saves left under ``root`` (``.tmp-*`` directories); return them."""
    import shutil

    if not os.path.isdir(root):
        return []
    gone = [os.path.join(root, n) for n in os.listdir(root) if n.startswith(".tmp-step-") or ".old-" in n]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def latest_checkpoint(root: str) -> str | None:
    found = list_checkpoints(root)
    return found[-1] if found else None
