"""The base of every error a user can cause and fix (a bad value, a missing file, a full
disk, a damaged checkpoint, a run directory in use). The command line prints such an error
as one line, ``tiertrain: <message>``, and exits non-zero; anything else is a bug and keeps
its traceback. Messages name the value, what is wrong with it and what to do.
"""

from __future__ import annotations

import os

__all__ = ["ConfigError", "TiertrainError", "UsageError", "one_line", "speaks_for_ranks"]


def speaks_for_ranks() -> bool:
    """This process is rank 0 (torchrun's ``RANK``, or ``--nproc``'s) or runs alone: a warning
    every rank would print alike (about the data, the model directory) is said by it alone."""
    return os.environ.get("RANK", "0") == "0"


class TiertrainError(Exception):
    """An error the user can act on; its message says how."""

    quiet = False  # with ranks: another rank of this machine reports the same, this one need not


class UsageError(TiertrainError, ValueError):
    """A command-line argument or an input file is not acceptable."""


class ConfigError(TiertrainError, ValueError):
    """A configuration value is not acceptable. The message names field, value and fix."""


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (details after the first line are dropped; an OSError's
    ``[Errno N]`` prefix too: the message says what happened)."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    text = text.strip() or type(exc).__name__
    return text.splitlines()[0]
