"""Small state machines: an enum of states and the transitions allowed between them.

Used for the parameter store's slots and the update engines' lifecycle, so that a move the
design does not allow (a bound slot reloaded, an engine stepped while its files are handed
over) raises at once, naming both states, instead of corrupting data later.
"""

from __future__ import annotations

import enum
from typing import Generic, Mapping, TypeVar

__all__ = ["IllegalTransition", "Machine"]

S = TypeVar("S", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """A state machine was asked to move along an edge the design does not have (a bug)."""


class Machine(Generic[S]):
    """The allowed edges of one kind of state machine; ``move`` checks one step."""

    def __init__(self, what: str, edges: Mapping[S, set[S] | frozenset[S]]) -> None:
        self.what = what
        self.edges = {k: frozenset(v) for k, v in edges.items()}

    def move(self, old: S, new: S, who: str = "") -> S:
        """``new`` if ``old -> new`` is allowed, else raise ``IllegalTransition`` naming both."""
        if new not in self.edges.get(old, frozenset()):
            name = f"{self.what} {who}".strip()
            allowed = ", ".join(sorted(s.name for s in self.edges.get(old, ()))) or "none"
            raise IllegalTransition(f"{name}: {old.name} -> {new.name} is not allowed (from {old.name}: {allowed})")
        return new
