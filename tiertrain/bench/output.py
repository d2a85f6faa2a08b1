"""Where benchmarks write their reports: checked (and the directory made) before any work,
so that a bad ``--out`` costs a second, not the benchmark's minutes and its results."""

from __future__ import annotations

import sys

from ..errors import UsageError
from ..paths import prepare_output_file

__all__ = ["checked_out", "publish"]


def checked_out(path: str, what: str = "--out") -> str:
    """``path``, absolute, with its directory made and writable; else exit with one line."""
    try:
        return prepare_output_file(what, path)
    except UsageError as exc:
        raise SystemExit(f"{sys.argv[0]}: {exc}") from None


def publish(report: str, out: str | None) -> None:
    """Print ``report`` and, with ``out`` (already ``checked_out``), write it there."""
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report)
