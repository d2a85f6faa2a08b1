"""Config values from text: a TOML value or a ``--section.field=value`` flag turned into the
type its field declares, or a ``ConfigError`` naming the field, the value and what is expected."""

from __future__ import annotations

import difflib
import math
import numbers
import tomllib
import types
import typing
from typing import Any, Sequence

from ..errors import ConfigError

__all__ = ["coerce", "parse_overrides", "suggest"]


def suggest(name: str, choices: Any) -> str:
    """The end of an unknown-name error: the closest known name, else all of them."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(choices))}"


def coerce(name: str, value: Any, typ: Any) -> Any:
    """Turn ``value`` (from TOML or a flag) into ``typ``, or say why it cannot be."""
    args = typing.get_args(typ)
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return coerce(name, value, inner[0])
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{name} = {value!r}: expected a list")
        return [coerce(name, v, args[0]) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{name} = {value!r}: expected true or false")
    if typ is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)  # (numpy's integers too)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{name} = {value!r}: expected an integer")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{name} = {value!r}: expected an integer") from None
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):  # (true was lr = 1.0)
            raise ConfigError(f"{name} = {value!r}: expected a number")
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "on", "off"):
            raise ConfigError(f"{name} = {value!r}: expected a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} = {value!r}: expected a number") from None
        if not math.isfinite(number):  # nan passes every range check (each comparison is False)
            raise ConfigError(f"{name} = {value!r}: expected a finite number")
        return number
    if typ is str:
        if isinstance(value, (list, dict, bool)) or value is None:  # (a list became the directory "['a', 'b']")
            raise ConfigError(f"{name} = {value!r}: expected text")
        return str(value)
    return value


def parse_overrides(flags: Sequence[str], field_type: Any = None) -> dict[str, dict[str, Any]]:
    """``["--optim.lr=1e-3", "--io.paths", "/a,/b"]`` -> ``{"optim": {"lr": "1e-3"}, ...}``.
    ``field_type(section, name)``: the field's type (None: unknown), by which a text field keeps
    the flag's own text (``--train.run_dir=1e-3`` was the directory '0.001', ``2024#1`` '2024')."""
    tree: dict[str, dict[str, Any]] = {}
    it = iter(flags)
    for flag in it:
        if not isinstance(flag, str):  # the Python API: train(cfg, ["--a=1"]) or train(cfg, 5)
            raise TypeError(
                f"overrides are strings such as '--train.steps=3', each its own argument (train(cfg, '--a.b=1', "
                f"'--c.d=2'), or *a_list), not {type(flag).__name__} {flag!r}"
            )
        if not flag.startswith("--") or "." not in flag:
            raise ConfigError(f"unexpected argument {flag!r}: overrides look like --section.field=value")
        key, eq, value = flag[2:].partition("=")
        if not eq:
            following = next(it, None)
            if following is None or following.startswith("--"):  # a flag: not this one's value
                raise ConfigError(f"{flag} needs a value: {flag}=VALUE")
            value = following
        section, _, name = key.partition(".")
        parsed = _literal(value)
        if field_type is not None and not isinstance(parsed, str) and _is_text(field_type(section, name)):
            parsed = value  # (a quoted TOML string still loses its quotes: it parses as a str)
        tree.setdefault(section, {})[name] = parsed
    return tree


def _is_text(typ: Any) -> bool:
    """A ``str`` or ``str | None`` field."""
    if typ is str:
        return True
    args = typing.get_args(typ)
    return typing.get_origin(typ) in (typing.Union, types.UnionType) and set(args) == {str, type(None)}


def _literal(text: str) -> Any:
    """A flag's text as a TOML value where it parses as one (1e-3, true, [1, 2]), else the text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
