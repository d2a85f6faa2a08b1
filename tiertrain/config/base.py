"""The base of the config's sections: ``opt`` (a field with its documentation) and ``Section``
(every field turned into its declared type, then the section's own checks, each error naming
``section.field``, the value and what would be accepted)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import field
from typing import Any, ClassVar, Sequence

from ..errors import ConfigError

__all__ = ["Section", "opt"]


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """A section's fields' types, resolved once (``from __future__ import annotations``: text)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def opt(default: Any, doc: str, *, factory: Any = None) -> Any:
    """A config field with its documentation."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


class Section:
    """Base of config sections: validation helpers that name ``section.field``. Every field is
    turned into the type it declares before a section's own checks (``coerce``), so a section
    made in Python (``ModelConfig(n_layers="2")``, a ``pathlib.Path``, a numpy integer) is
    checked as one read from TOML: a ``ConfigError`` naming the field, not a ``TypeError`` from
    a comparison inside the checks."""

    SECTION: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        checks = cls.__dict__.get("__post_init__")
        if checks is None:
            return

        @functools.wraps(checks)
        def post_init(self: Section) -> None:
            self._coerce_fields()
            checks(self)

        cls.__post_init__ = post_init  # type: ignore[attr-defined]

    def _coerce_fields(self) -> None:
        from .values import coerce  # (values imports nothing of ours but errors)

        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            setattr(self, f.name, coerce(f"{self.SECTION}.{f.name}", value, hints[f.name]))

    def _fail(self, name: str, why: str) -> None:
        raise ConfigError(f"{self.SECTION}.{name} = {getattr(self, name)!r}: {why}")

    def _at_least(self, name: str, low: float) -> None:
        value = getattr(self, name)
        if isinstance(value, float) and not math.isfinite(value):  # nan < low is False: caught here
            self._fail(name, "must be a finite number")
        if value < low:
            self._fail(name, f"must be >= {low}")

    def _in_range(self, name: str, low: float, high: float) -> None:
        if not low <= getattr(self, name) <= high:
            self._fail(name, f"must be between {low} and {high}")

    def _one_of(self, name: str, choices: Sequence[Any]) -> None:
        if getattr(self, name) not in choices:
            self._fail(name, f"must be one of {', '.join(map(repr, choices))}")
