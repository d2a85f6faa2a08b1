"""The configuration tree: one kw-only dataclass per component (``sections.py``, ``memory.py``), loaded from
TOML and overridden by ``--section.field=value`` flags (``values.py``). Every field has a doc
string (shown by ``tiertrain config``) and is validated when the section is made, with errors
that name the field, the value and what would be accepted.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import ConfigError
from .adapter import AdapterConfig, with_peft_settings
from .memory import MemoryConfig
from .sections import (
    TOKENIZER_MARKERS,
    CheckpointConfig,
    DataConfig,
    IOConfig,
    ModelConfig,
    OptimConfig,
    RanksConfig,
    Section,
    TrainConfig,
    UpdateConfig,
    env_checks,
    has_tokenizer,
    without_environment_checks,
)
from .values import coerce, suggest
from .values import parse_overrides as _parse_overrides

__all__ = [
    "Config",
    "ConfigError",
    "without_environment_checks",
    "IOConfig",
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "MemoryConfig",
    "AdapterConfig",
    "TrainConfig",
    "RanksConfig",
    "UpdateConfig",
    "CheckpointConfig",
    "Section",
    "has_tokenizer",
    "TOKENIZER_MARKERS",
    "load_config",
    "ineffective_settings",
    "as_config",
    "read_toml",
    "read_sections",
    "parse_overrides",
    "config_reference",
]


@dataclass(kw_only=True)
class Config:
    """The whole tree. ``Config()`` is the default main job."""

    io: IOConfig = field(default_factory=IOConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ranks: RanksConfig = field(default_factory=RanksConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)

    def __post_init__(self) -> None:
        speculate = self.update.speculate == "on"
        if self.update.eager and (self.update.mode == "baseline" or (self.optim.grad_clip > 0 and not speculate)):
            raise ConfigError(
                f"update.eager = true needs update.mode = 'auto', 'overlap' or 'engines' and optim.grad_clip = 0 (got mode "
                f"{self.update.mode!r}, grad_clip {self.optim.grad_clip}): the global gradient norm is only known "
                "after the whole backward; with clipping, update.speculate = 'on' updates under the backward and "
                "redoes a step where the clip acts"
            )
        if speculate and (
            self.update.mode not in ("auto", "overlap", "baseline", "engines")
            or self.optim.grad_clip == 0
            or self.adapter.on
        ):
            why = (
                "the adapters update in the trainer (adapter.kind is set)"
                if self.adapter.on
                else "with optim.grad_clip = 0 nothing is validated: use update.eager = true"
                if self.optim.grad_clip == 0
                else f"it runs on the paths that update the model (overlap, baseline, engines), not update.mode = "
                f"{self.update.mode!r}: set update.mode = 'overlap'"
            )
            raise ConfigError(f"update.speculate = 'on': {why}")
        if (self.update.topk > 0 or self.update.error_feedback) and self.update.mode != "engines":
            raise ConfigError(
                f"update.topk = {self.update.topk} / update.error_feedback = {self.update.error_feedback} compress what "
                "is sent to the update engines: set update.mode = 'engines'"
            )
        if self.update.error_feedback and self.update.topk == 0:
            raise ConfigError("update.error_feedback = true needs update.topk > 0")
        if self.adapter.on and (self.update.mode not in ("auto", "frozen") or self.update.eager):
            raise ConfigError(
                f"update.mode = {self.update.mode!r}{' with update.eager' if self.update.eager else ''} and adapter.kind = "
                f"{self.adapter.kind!r}: the model is frozen, no unit of it is updated (the adapters update in the "
                "trainer); leave update.mode = 'auto' and update.eager = false"
            )
        if self.update.mode == "frozen" and not self.adapter.on:
            raise ConfigError(
                "update.mode = 'frozen' is chosen for adapter runs (adapter.kind = 'lora'), where nothing of the model "
                "is updated; use 'auto', 'baseline', 'overlap' or 'engines'"
            )
        if self.model.base_dtype is not None and not self.adapter.on:
            raise ConfigError(
                f"model.base_dtype = {self.model.base_dtype!r} is for a frozen model under adapters (adapter.kind = "
                "'lora'); a trained model keeps its parameters in train.param_dtype: unset it"
            )
        if self.adapter.on and self.train.freeze:
            raise ConfigError(
                f"train.freeze = {self.train.freeze!r} with adapter.kind = {self.adapter.kind!r}: adapters freeze the "
                "whole model already; leave train.freeze empty"
            )
        if self.train.eval_every and self.data.eval_corpus is None:
            raise ConfigError(
                f"train.eval_every = {self.train.eval_every} needs data.eval_corpus (the held-out text "
                "the validation loss is taken on); set it, or train.eval_every = 0"
            )
        if self.model.hf_dir is None and self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len = {self.data.seq_len} is longer than model.max_seq_len = {self.model.max_seq_len}; "
                "lower one or raise the other"
            )
        if (
            self.data.tokenizer is None
            and self.model.hf_dir is not None
            and env_checks()
            and has_tokenizer(self.model.hf_dir)
        ):
            self.data.tokenizer = self.model.hf_dir  # the model's own: never its text in another tokenizer's ids
        limit = self.model.position_limit() if self.model.hf_dir is not None and env_checks() else None
        if limit is not None and self.data.seq_len > limit[0]:
            raise ConfigError(
                f"data.seq_len = {self.data.seq_len} is longer than the model in {self.model.hf_dir} supports "
                f"({limit[1]} = {limit[0]} in its config.json); lower data.seq_len to at most {limit[0]}"
            )

    @property
    def checkpoint_root(self) -> str:
        """Where checkpoints go: checkpoint.dir, else <train.run_dir>/checkpoints."""
        return self.checkpoint.dir or os.path.join(self.train.run_dir, "checkpoints")

    def check_writable(self) -> None:
        """Every directory the run writes is one (or can be made one) and is writable. Made
        before any work, so a bad path is one line, not a traceback half-way through."""
        from ..paths import check_writable_dir

        for p in self.io.paths:
            check_writable_dir("io.paths", p)
        check_writable_dir("train.run_dir", self.train.run_dir)
        if self.checkpoint.dir is not None:
            check_writable_dir("checkpoint.dir", self.checkpoint.dir)

    def absolute(self) -> "Config":
        """A copy, validated again (fields may have been set after it was made), with every
        path absolute, as stored in checkpoints: a run resumed or exported from another
        working directory finds the same files and the same run directory."""
        ab = os.path.abspath
        out = Config.from_dict(self.to_dict())
        out.io.paths = [ab(p) for p in out.io.paths]
        out.train.run_dir = ab(out.train.run_dir)
        for sec, name in (
            ("model", "hf_dir"),
            ("model", "init_from"),
            ("data", "tokenizer"),
            ("checkpoint", "dir"),
            ("adapter", "init_from"),
        ):
            value = getattr(getattr(out, sec), name)
            if value is not None and (sec, value) != ("data", "bytes"):
                setattr(getattr(out, sec), name, ab(value))
        for name in ("corpus", "eval_corpus"):  # (a relative eval corpus resumed elsewhere: not found, or another)
            value = getattr(out.data, name)
            if value is not None and value != "bundled":
                setattr(out.data, name, ab(value))
        return out

    def validate(self) -> "Config":
        """Check the tree again, as a file or flags would be (fields set on the objects after they
        were made skip their section's checks otherwise); ``self``, unchanged."""
        Config.from_dict(self.to_dict())
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, tree: dict[str, Any], *, environment: bool = True) -> "Config":
        """The config of ``tree`` (sections of fields). ``environment=False`` skips the checks
        that look at files (for a stored config whose files may have moved)."""
        if not environment:
            with without_environment_checks():
                return cls.from_dict(tree)
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        kw = {}
        for name, values in tree.items():
            if name not in sections and not isinstance(values, dict):  # `steps = 3` above every table
                raise ConfigError(_outside_any_section(name, values))
            if name not in sections:
                raise ConfigError(f"unknown config section [{name}]{suggest(name, sections)}")
            if not isinstance(values, dict):
                raise ConfigError(f"[{name}] must be a table of fields, got {values!r}")
            if name == "adapter":  # an adapter directory to apply: what the table leaves unset is its own
                values = with_peft_settings(values)
            kw[name] = _make_section(_section_class(name), values)
        return cls(**kw)


def _section_class(name: str) -> type:
    return typing.get_type_hints(Config)[name]


def _field_type(section: str, name: str) -> Any:
    """The type of field ``section.name`` (None where there is no such field)."""
    try:
        return typing.get_type_hints(_section_class(section)).get(name)
    except KeyError:
        return None


def parse_overrides(flags: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--section.field=value`` flags as a tree of sections (``values.parse_overrides``), text
    fields keeping the flag's own text."""
    return _parse_overrides(flags, _field_type)


def _make_section(cls: Any, values: dict[str, Any]) -> Any:  # a Section's dataclass
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"unknown field {cls.SECTION}.{key}{suggest(key, names)}")
        kw[key] = coerce(f"{cls.SECTION}.{key}", value, hints[key])
    return cls(**kw)


def read_sections(path: str) -> dict[str, dict[str, Any]]:
    """Config file ``path`` as sections of fields, each a table (``read_toml``, its shape checked:
    a field above every table, or a section that is not one, is one line; read raw by the commands
    that lay a file over a checkpoint's config, they were tracebacks)."""
    tree = read_toml(path)
    sections = {f.name for f in dataclasses.fields(Config)}
    for name, values in tree.items():
        if isinstance(values, dict):
            continue
        if name in sections:
            raise ConfigError(f"[{name}] in {path} must be a table of fields, got {values!r}")
        raise ConfigError(_outside_any_section(name, values, f" in {path}"))
    return tree


def _outside_any_section(name: str, value: Any, where: str = "") -> str:
    """What to say of field ``name`` given above every table (``where``: the file, said)."""
    sections = [f.name for f in dataclasses.fields(Config)]
    owner = next((s for s in sections if name in {f.name for f in dataclasses.fields(_section_class(s))}), None)
    hint = f"; it is [{owner}]'s: put it under [{owner}]" if owner else ""
    return f"{name} = {value!r}{where} is outside any section: every field belongs to a table{hint}"


def read_toml(path: str) -> dict:
    """Config file ``path`` as a tree; what keeps it from being read is one line naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; give a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    if data.startswith(b"\xef\xbb\xbf"):
        raise ConfigError(
            f"config file {path} starts with a UTF-8 byte-order mark, which TOML forbids; save it without"
        )
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 ({exc.reason} at byte {exc.start}); TOML is UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a TOML file (optional), apply ``--section.field=value`` overrides, validate."""
    tree: dict[str, dict[str, Any]] = read_toml(path) if path is not None else {}
    for section, values in parse_overrides(overrides).items():
        if section not in tree:
            tree[section] = {}
        if not isinstance(tree[section], dict):
            raise ConfigError(f"[{section}] in {path} is not a table")
        tree[section].update(values)
    return Config.from_dict(tree)


def config_reference() -> str:
    """Markdown reference of every section and field: default and doc."""
    lines = []
    for f in dataclasses.fields(Config):
        cls = _section_class(f.name)
        lines += [
            f"### [{f.name}]",
            "",
            (cls.__doc__ or "").strip(),
            "",
            "| field | default | meaning |",
            "|---|---|---|",
        ]
        for sf in dataclasses.fields(cls):
            default = sf.default if sf.default is not dataclasses.MISSING else sf.default_factory()  # type: ignore[operator]
            lines.append(f"| `{sf.name}` | `{default!r}` | {sf.metadata.get('doc', '')} |")
        lines.append("")
    return "\n".join(lines)


def as_config(config: Config | dict | str | None = None, overrides: Sequence[str] = ()) -> Config:
    """A checked ``Config`` from any form the Python API takes (``tiertrain.train``,
    ``evaluate``, ``generate``): a ``Config``, a dict of sections, a TOML path (text or a
    ``pathlib.Path``) or None; ``overrides``: flags, or one flag."""
    if isinstance(overrides, (str, os.PathLike)):  # as_config(cfg, "--a.b=1"): "unexpected argument '-'"
        overrides = [os.fspath(overrides)]
    if isinstance(config, Config):
        if not overrides:
            return config
        config = config.to_dict()
    if isinstance(config, os.PathLike):  # a pathlib.Path of a TOML file, as a str is
        config = os.fspath(config)
    if config is None or isinstance(config, str):
        return load_config(config, overrides)
    if not isinstance(config, dict):
        raise TypeError(
            f"config must be a Config, a dict of sections, a TOML path or None, not {type(config).__name__}"
        )
    # copies of the sections (the caller's dict is left as it is); what is not a table is
    # refused by ``Config.from_dict`` as a TOML file's would be
    bad = next((k for k in config if not isinstance(k, str)), None)
    if bad is not None:  # (difflib's TypeError, suggesting a name for it)
        raise ConfigError(f"config section {bad!r}: section names are text, as a TOML file's tables are")
    tree: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for section, values in parse_overrides(overrides).items():
        if not isinstance(tree.setdefault(section, {}), dict):
            break  # refused below, naming the section
        tree[section].update(values)
    return Config.from_dict(tree)


def ineffective_settings(cfg: Config) -> list[str]:
    """Settings of a training run that have no effect as combined, each a line to say at start
    (valid, so not refused: the run may be meant as it is)."""
    out = []
    o, t = cfg.optim, cfg.train
    if o.warmup_steps >= t.steps > 0:
        reach = "never reaches" if o.warmup_steps > t.steps else "reaches only at the last step"
        out.append(
            f"optim.warmup_steps = {o.warmup_steps} is at least train.steps = {t.steps}: the learning rate {reach} "
            f"optim.lr = {o.lr:g} (it warms up through the whole run)"
        )
    if not cfg.checkpoint.every and not cfg.checkpoint.at_end:
        out.append(
            "checkpoint.every = 0 and checkpoint.at_end = false: this run keeps no checkpoint, so its trained "
            "weights are gone when it ends and it cannot be resumed; set checkpoint.at_end = true (or "
            "checkpoint.every = N) to keep them"
        )
    if cfg.data.eval_corpus is not None and not t.eval_every:
        out.append(
            f"data.eval_corpus = {cfg.data.eval_corpus!r} is set but train.eval_every = 0: no validation runs; "
            "set train.eval_every = N for a validation loss every N steps"
        )
    return out
