"""``tiertrain export``: a checkpoint's weights as sharded safetensors, one unit per shard.

For Hugging Face models the output is a model directory (``config.json``, shards with the
model's own names, ``model.safetensors.index.json``, and the tokenizer files of the
directory the model came from) that ``from_pretrained`` and ``model.hf_dir`` load; for the
built-in GPT, shards with tiertrain's names that ``model.init_from`` loads. Memory: one
unit at a time. What is exported is the weights state the run declared (``StateDecl.weights``),
which the checkpoint's manifest names: fp32 master weights where the run kept them, else the
parameters in their own precision.

Complete or absent: everything is written into a hidden directory beside ``out`` and
renamed into place once every shard is written and the checkpoint's checksum has matched;
a failure leaves ``out`` as it was. ``out`` must be new or empty, or with ``overwrite`` an
earlier export (only files an export writes); never the checkpoint or a directory that holds it.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass

import torch
from safetensors import SafetensorError

from ..config import Config, ConfigError
from ..data.loader import TOKENIZER_FILES
from ..errors import one_line
from ..io import FileHandle, OutOfSpaceError, check_space
from ..io.checksum import crc32c
from ..io.errors import StorageError, human_bytes
from ..models import _hf_names, build_model
from ..models.base import LayeredModel
from ..models.buffers import persistent_buffers
from ..models.convert import to_checkpoint
from ..models.pieces import WholeTensors
from ..paths import MADE_FOR_OUTPUT, check_writable_dir, fsync_path, missing_dirs, mode_as_created, pid_alive
from ..runtime import align_of, layout_aligns
from ..state.layout import FlatLayout
from ..state.quant import QuantLayout, base_storage
from .manifest import CheckpointError, FileEntry, Manifest, find_checkpoint
from .saver import _replace_dir

__all__ = ["export_checkpoint", "export", "moved_model_dir", "relocate_model_dir", "weights_file", "WeightsFile"]

log = logging.getLogger("tiertrain")


def export_checkpoint(
    path: str, out: str, *, overwrite: bool = False, merge: bool = False, hf_dir: str | None = None
) -> str:
    """Export checkpoint ``path`` (or a run directory's latest) into directory ``out``. A run
    with adapters: a peft adapter directory (``adapters/peft_io.py``), or with ``merge`` the
    base's weights with the adapters merged in (peft's ``merge_and_unload``). ``hf_dir``: where
    the model directory its run read has moved (``moved_model_dir``)."""
    path = find_checkpoint(path, "export --checkpoint")
    if not out:  # ("" is the working directory: an export into it, said nowhere)
        raise CheckpointError("export --out is empty; give the directory to export into")
    out = os.path.abspath(out)
    check_writable_dir("export --out", out, CheckpointError)
    _clean_leftovers(out)
    _check_out(path, out, overwrite)
    man = Manifest.read(path)
    moved = moved_model_dir(man.config, hf_dir, "export --checkpoint")
    if moved is not None:
        relocate_model_dir(man.config, moved)
    _refuse_read(man.config, out)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}{_TMP}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    MADE_FOR_OUTPUT.extend(missing_dirs(os.path.dirname(out)))  # removed again where the export fails (``cli.main``)
    os.makedirs(tmp)
    try:
        adapters = _adapters(path, man)
        if adapters is not None and not merge:
            _write_adapter(path, man, tmp, adapters)
        else:
            if merge and adapters is None:
                raise CheckpointError(f"export --merge: checkpoint {path} holds no adapters (adapter.kind = 'none')")
            _check_space(man, tmp, out)
            _write(path, man, tmp, adapters)
        _fsync_tree(tmp)  # durable before it replaces an earlier export (which goes once it is in place)
        _replace_dir(tmp, out)
    except (OSError, SafetensorError) as exc:
        placed = not os.path.exists(tmp) and os.path.isdir(out)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, StorageError) and not placed:  # reading the checkpoint: it names its file
            raise
        raise CheckpointError(_write_failed(out, exc, placed)) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


_TMP = ".tmp-export-"  # the hidden work directory beside ``out``: .OUT.tmp-export-PID


def export(
    checkpoint: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False, merge: bool = False
) -> str:
    """The Python API's ``tiertrain export``: checkpoint ``checkpoint`` (or a run directory's
    latest) as a Hugging Face model directory (a run with adapters: a peft adapter directory,
    or with ``merge`` the model with them merged in) in ``out``; ``out`` returned."""
    return export_checkpoint(os.fspath(checkpoint), os.fspath(out), overwrite=overwrite, merge=merge)


def _check_space(man: Manifest, tmp: str, out: str) -> None:
    """Refuse before writing where ``out``'s filesystem cannot hold the weights (at least the
    checkpoint's weights file: a 4-bit base is exported dequantized, larger)."""
    entry = man.entry(man.weights) if man.weights else man.entry("master.bin") or man.entry("params.bin")
    if entry is None:
        return
    try:
        check_space([(os.path.join(tmp, "weights"), entry.size)])
    except OutOfSpaceError as exc:
        raise CheckpointError(
            f"export --out {out}: not enough space on its filesystem: the weights need at least "
            f"{human_bytes(entry.size)}, {human_bytes(exc.free)} are free; free space there or export elsewhere"
        ) from None


def _write_failed(out: str, exc: BaseException, placed: bool) -> str:
    """What an export's write, sync or rename failing (``exc``) means for ``out``."""
    err = getattr(exc, "errno", None) or (errno.ENOSPC if "os error 28" in str(exc) else None)
    what = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename else one_line(exc)
    if placed:  # renamed into place: only its directory's sync failed
        return f"export --out {out}: the export is in place, but making it durable failed ({what}); check the disk"
    if err in (errno.ENOSPC, errno.EDQUOT):
        return f"export --out {out}: its filesystem is full ({what}); free space there or export elsewhere; {out} is as it was"
    return f"export --out {out}: writing the export failed ({what}); {out} is as it was"


def _clean_leftovers(out: str) -> None:
    """What a killed export into ``out`` left beside it: its hidden work directory (removed) and
    an earlier export set aside while being replaced, ``OUT.old-PID`` (put back where ``out`` is
    missing: the kill came between the two renames; else removed). Those of a process still
    running are left."""
    parent, base = os.path.split(out)
    left = re.compile(rf"^(?:\.{re.escape(base)}{re.escape(_TMP)}|{re.escape(base)}\.old-)(\d+)$")
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(parent)):
            m = left.match(name)
            path = os.path.join(parent, name)
            if m is None or pid_alive(int(m.group(1)), path):
                continue
            if not name.startswith(".") and not os.path.exists(out):
                os.rename(path, out)
                log.warning("export --out %s: an export that replaced it was killed; the earlier one put back", out)
                continue
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s, left by an export that was killed", path)


def _fsync_tree(path: str) -> None:
    """Every file under ``path`` and the directories holding them on the disk (a power loss after
    an export replaced the earlier one left shards of zero length)."""
    for d, _, names in os.walk(path):
        for n in names:
            fsync_path(os.path.join(d, n))
        fsync_path(d)


def moved_model_dir(stored: dict, given: str | None, flag: str) -> str | None:
    """The model directory a checkpoint's run read (``stored``: its config) where it has moved:
    ``given`` (``--model.hf_dir``), taken only where the recorded one is gone (else the model is
    the checkpoint's: refused where it names another); a directory gone and none given is
    refused, naming the flag (it failed as a model directory without config.json)."""
    had = (stored.get("model") or {}).get("hf_dir")
    if not had or os.path.isdir(had):
        if given is not None and (not had or os.path.realpath(given) != os.path.realpath(had)):
            instead = "" if flag.startswith("export") else f", or leave out {flag} to run the model it names"
            raise ConfigError(
                f"model.hf_dir = {given!r} with {flag}: the model is the checkpoint's ({had or 'built in'}"
                f"{', which is still there' if had else ''}); drop model.hf_dir{instead}"
            )
        return had
    if given is None:
        raise ConfigError(
            f"the model directory the checkpoint's run read, {had} (model.hf_dir), is gone: where it has moved, "
            f"give its new place with --model.hf_dir=DIR"
        )
    return os.path.abspath(given)


def relocate_model_dir(stored: dict, new: str) -> None:
    """Point checkpoint config ``stored`` at model directory ``new`` (where its recorded one
    moved: ``moved_model_dir``): ``model.hf_dir``, and what its run took from inside the old
    one (the tokenizer the config found there, ``data.tokenizer``; ``model.init_from``)."""
    model = stored.setdefault("model", {})
    old, model["hf_dir"] = model.get("hf_dir"), new
    if not old or os.path.normpath(old) == os.path.normpath(new):
        return
    old = os.path.normpath(old)
    for section, field in (("data", "tokenizer"), ("model", "init_from")):
        value = (stored.get(section) or {}).get(field)
        if isinstance(value, str) and value:
            v = os.path.normpath(value)
            if v == old or v.startswith(old + os.sep):
                stored[section][field] = os.path.join(new, os.path.relpath(v, old)) if v != old else new


# what an export writes (and so what --overwrite may replace): besides these, the shards and
# the tokenizer's files (TOKENIZER_FILES)
_EXPORT_FILES = {"tiertrain.json", "config.json", "generation_config.json", "model.safetensors.index.json"}
_EXPORT_FILES |= {"adapter_config.json", "adapter_model.safetensors", "README.md"}
GENERATION_CONFIG = "generation_config.json"
BUFFERS = "model-buffers.safetensors"  # the model's persistent buffers (models/buffers.py)
_EXPORT_FILES.add(BUFFERS)
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _check_out(checkpoint: str, out: str, overwrite: bool) -> None:
    """``out`` may take the export: new or empty, or (``overwrite``) an earlier export, and
    never the checkpoint, its run or anything holding them: ``--overwrite`` replaces only
    what an export wrote."""
    src, dst = os.path.realpath(checkpoint), os.path.realpath(out)
    if src == dst or src.startswith(dst + os.sep) or dst.startswith(src + os.sep):
        raise CheckpointError(
            f"export --out {out} is or holds the checkpoint being exported ({checkpoint}); give another directory"
        )
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if not overwrite:
        raise CheckpointError(
            f"export --out {out} is not empty; give a new directory, or --overwrite to replace an earlier export there"
        )
    foreign = sorted(n for n in os.listdir(out) if not _exported(n))
    if foreign or not os.path.isfile(os.path.join(out, "tiertrain.json")):
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "") if foreign else "no tiertrain.json"
        raise CheckpointError(
            f"export --out {out} is not an earlier export ({shown}); --overwrite replaces only what an export "
            "wrote: give a new or empty directory"
        )


# the settings naming what an export reads (the model directory, its tokenizer, an adapter)
_READS = (("model", "hf_dir"), ("model", "init_from"), ("data", "tokenizer"), ("adapter", "init_from"))


def _refuse_read(config: dict, out: str) -> None:
    """``out`` is none of the directories the export reads (an earlier export trained on, its
    tokenizer): replacing it lost the base the run's adapters and config stand on."""
    dst = os.path.realpath(out)
    for section, field in _READS:
        value = (config.get(section) or {}).get(field)
        if not isinstance(value, str) or value in ("", "none", "bytes") or not os.path.exists(value):
            continue
        src = os.path.realpath(value)
        if src == dst or src.startswith(dst + os.sep):
            raise CheckpointError(
                f"export --out {out} is or holds {section}.{field} = {value}, which the checkpoint's run reads; "
                "give another directory"
            )


def _exported(name: str) -> bool:
    return name in _EXPORT_FILES or name in TOKENIZER_FILES or bool(_SHARD.match(name))


@dataclass
class WeightsFile:
    """A checkpoint's weights as its manifest names them: the model its config describes (a
    skeleton: no weight memory), the layout of one rank, the file, its dtype and manifest entry."""

    cfg: Config
    model: LayeredModel
    layout: FlatLayout
    path: str
    dtype: torch.dtype
    entry: FileEntry
    quant: QuantLayout | None = None  # a 4-bit base's layout (``dtype`` is then uint8): read it through ``unit``

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype of the weights ``unit`` gives."""
        return self.quant.dtype if self.quant is not None else self.dtype

    def unit_bytes(self, u: int) -> tuple[int, int]:
        """(offset, length) in bytes of unit ``u``'s record in the file."""
        if self.quant is not None:
            q = self.quant.units[u]
            return q.offset, q.numel
        unit, e = self.layout.units[u], self.dtype.itemsize
        return unit.offset * e, unit.numel * e

    @property
    def max_unit_bytes(self) -> int:
        return max(self.unit_bytes(u)[1] for u in range(len(self.layout.units)))

    def unit(self, raw: torch.Tensor, u: int, out: torch.Tensor) -> torch.Tensor:
        """Unit ``u``'s flat weights (``weights_dtype``) from its record's bytes ``raw``: ``raw``
        itself, or a 4-bit base dequantized into ``out``."""
        if self.quant is None:
            return raw.view(self.dtype)
        self.quant.dequantize_into(u, raw, out)
        return out[: self.layout.units[u].numel]


def weights_file(path: str, man: Manifest) -> WeightsFile:
    """The weights of checkpoint ``path``: the file its manifest names (older checkpoints: the
    fp32 master copy where it holds one, else the parameters). Checked: the layout, the file's
    presence and size (its checksum is the reader's to check)."""
    cfg = Config.from_dict(man.config, environment=False)
    pdtype = getattr(torch, man.param_dtype.removeprefix("torch."))  # a stored "auto" may have meant bf16 on a GPU
    quantized = pdtype == torch.uint8  # a 4-bit base: its units are bytes, its weights made in the compute dtype
    if quantized:
        pdtype = getattr(torch, man.compute_dtype.removeprefix("torch."))
    model, _ = build_model(cfg.model, param_dtype=pdtype, seed=0)
    unit_align, p_align = layout_aligns(cfg, pdtype)
    layout = FlatLayout(model, unit_align=unit_align, param_align=p_align)  # checkpoints: the one-rank layout
    if [u.numel for u in layout.units] != man.units:
        raise CheckpointError(f"checkpoint {path}: its layout does not match the model its config describes")
    if man.params and man.params != layout.fingerprint:  # units of the same padded sizes, other tensors
        where = (man.config.get("model") or {}).get("hf_dir")
        raise CheckpointError(
            f"checkpoint {path} holds a model with other parameters ({man.params}) than "
            f"{'model.hf_dir ' + str(where) if where else 'the model its config describes'} "
            f"({layout.fingerprint}): give the model directory its run trained (--model.hf_dir)"
        )
    name, dtype = man.weights, man.weights_dtype
    if not name:
        name, dtype = ("master.bin", "torch.float32") if man.entry("master.bin") else ("params.bin", man.param_dtype)
    entry = man.entry(name)
    if entry is None:
        raise CheckpointError(
            f"checkpoint {path} holds no weights file ({name}); it is damaged: use an earlier checkpoint"
        )
    file = os.path.join(path, name)
    if not os.path.exists(file):
        raise CheckpointError(f"checkpoint file {file} is missing; use an earlier checkpoint")
    if os.path.getsize(file) != entry.size:
        raise CheckpointError(
            f"checkpoint file {file} is truncated: {os.path.getsize(file)} bytes, the manifest says {entry.size}"
        )
    quant = base_storage(cfg, layout, pdtype, align_of(cfg))[0] if quantized and name == "params.bin" else None
    return WeightsFile(cfg, model, layout, file, getattr(torch, dtype.removeprefix("torch.")), entry, quant)


def _adapters(path: str, man: Manifest):
    """The checkpoint's adapters on its model's skeleton, (model, LoRA, config), or None without any."""
    from ..adapters import ADAPTER_FILE, LoRA
    from .saver import read_tensors

    entry = man.entry(ADAPTER_FILE)
    if entry is None:
        return None
    tensors, _ = read_tensors(path, ADAPTER_FILE, entry)
    cfg = Config.from_dict(man.config, environment=False)
    model, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    lora = LoRA(model, cfg.adapter, seed=0, device="cpu")
    lora.load_named(tensors)
    return model, lora, cfg


def _write_adapter(path: str, man: Manifest, out: str, adapters) -> None:
    from ..adapters.peft_io import export_peft

    model, lora, cfg = adapters
    export_peft(model, lora, out, base_path=cfg.model.hf_dir)
    with open(os.path.join(out, "tiertrain.json"), "w") as f:
        json.dump({"step": man.step, "config": man.config}, f, indent=1)
    _copy_tokenizer(cfg, out)


def _merged(adapters) -> dict[str, torch.Tensor]:
    """Per target weight name, the delta peft's merge adds: ``transpose(B @ A, fan_in_fan_out) * scaling``
    (an experts' parameter: its ``ParamWrapper``'s, per expert)."""
    if adapters is None:
        return {}
    from ..adapters.lora import expert_delta

    _, lora, _ = adapters
    out = {}
    for t, p in zip(lora.targets, lora.adapters):
        if t.param is not None:
            out[t.name] = expert_delta(t, p.lora_A.weight, p.lora_B.weight, lora.scaling)
            continue
        delta = p.lora_B.weight @ p.lora_A.weight
        if type(t.module).__name__ == "Conv1D":
            delta = delta.T
        out[f"{t.name}.weight"] = delta * lora.scaling
    return out


def _source_use_cache(cfg: Config) -> bool:
    """``use_cache`` as the model directory's config.json has it (transformers' default, True,
    where it has none, or for a built-in model): generation from the export keeps its cache."""
    found = cfg.model.hf_json().get("use_cache", True) if cfg.model.hf_dir else True
    return found if isinstance(found, bool) else True


def _write(path: str, man: Manifest, out: str, adapters=None) -> None:
    w = weights_file(path, man)
    cfg, model, layout, file, entry = w.cfg, w.model, w.layout, w.path, w.entry
    names = _hf_names(model) if model.hf_model is not None else {}
    deltas = _merged(adapters)
    # a merge is written in float32, as a 4-bit base's is: a narrower base (model.base_dtype =
    # 'bfloat16') widened and the adapters' deltas added there (not rounded into bf16), every
    # tensor in the dtype config.json names
    wide = torch.float32 if adapters is not None else None
    weight_map, total, crc, dtypes = {}, 0, 0, set()
    n = len(layout.units)
    raw_buf = torch.empty(w.max_unit_bytes, dtype=torch.uint8)
    out_buf = torch.empty(layout.max_unit_numel, dtype=w.weights_dtype) if w.quant is not None else None
    from safetensors.torch import save_file

    whole = WholeTensors(model.row_pieces)
    with FileHandle(file, "r") as f:
        for unit in layout.units:
            offset, length = w.unit_bytes(unit.index)
            raw = raw_buf[:length]
            f.read(raw, length, offset)
            crc = crc32c(raw.numpy(), crc)
            view = w.unit(raw, unit.index, out_buf)  # a 4-bit base: dequantized (what training computed with)
            shard = f"model-{unit.index + 1:05d}-of-{n:05d}.safetensors"
            tensors = {}
            for r in unit.params:  # a vocabulary piece's rows go into its whole matrix, saved with its last rows
                for key, t in whole.add(r.name, view[r.offset : r.offset + r.numel].view(r.shape).clone()):
                    if wide is not None and t.is_floating_point():  # --merge: in the compute dtype, as trained
                        t = t.to(wide)
                    if key in deltas:  # --merge: the adapter folded into its base weight
                        t = (t + deltas[key].to(t.dtype)).contiguous()
                    tensors[names.get(key, key)] = t
            if not tensors:
                continue
            if model.hf_model is not None:  # the checkpoints' layout, as save_pretrained writes (experts one by one)
                tensors = to_checkpoint(model.hf_model, tensors)
            save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
            mode_as_created(os.path.join(out, shard))
            for key, t in tensors.items():
                weight_map[key] = shard
                total += t.numel() * t.element_size()
                if t.is_floating_point():
                    dtypes.add(t.dtype)
    kept = dict(persistent_buffers(model.hf_model)) if model.hf_model is not None else {}
    if kept:  # the model's constants (a router's correction bias), as the model directory holds them
        tensors = {k: b.detach().cpu().contiguous() for k, b in kept.items()}
        save_file(tensors, os.path.join(out, BUFFERS), metadata={"format": "pt"})
        mode_as_created(os.path.join(out, BUFFERS))
        weight_map.update(dict.fromkeys(tensors, BUFFERS))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if crc != entry.crc32c:
        raise CheckpointError(
            f"checkpoint file {file} is corrupt: crc32c {crc:#010x}, "
            f"the manifest says {entry.crc32c:#010x}; use an earlier checkpoint"
        )
    if model.hf_config is not None:
        _save_config(cfg, model.hf_config, out, dtypes)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out, "tiertrain.json"), "w") as f:
        json.dump({"step": man.step, "config": man.config}, f, indent=1)
    _copy_tokenizer(cfg, out)


def _save_config(cfg: Config, hf_config, out: str, dtypes: set[torch.dtype]) -> None:
    """config.json, its ``dtype`` the weights' as written (a full fine-tune of a bf16 directory
    writes its fp32 master weights: labelled bfloat16, transformers' default load would round
    them to bf16 without a word), ``use_cache`` the source's."""
    conf = copy.copy(hf_config)  # (the model's own is as tiertrain computes with it)
    conf.use_cache = _source_use_cache(cfg)  # off for the units' forward, not for the export's users
    if dtypes:
        conf.dtype = max(dtypes, key=lambda d: torch.finfo(d).bits)  # one dtype in practice: the widest
    conf.save_pretrained(out)


def _copy_tokenizer(cfg: Config, out: str) -> None:
    """The tokenizer files of the model's directory (else of data.tokenizer), so that the
    export loads with its tokenizer."""
    from ..config.sections import has_tokenizer

    # the model's generation_config.json (its end-of-sequence ids, its sampling) is the model
    # directory's whether or not the tokenizer is, never another directory's
    gen = os.path.join(cfg.model.hf_dir, GENERATION_CONFIG) if cfg.model.hf_dir else ""
    if os.path.isfile(gen):
        shutil.copy2(gen, os.path.join(out, GENERATION_CONFIG))
    for src in (cfg.model.hf_dir, None if cfg.data.tokenizer == "bytes" else cfg.data.tokenizer):
        # (a model directory with a generation_config.json and no tokenizer: the run's data.tokenizer's)
        if src and os.path.isdir(src) and has_tokenizer(src):
            for n in TOKENIZER_FILES:
                if n != GENERATION_CONFIG and os.path.isfile(os.path.join(src, n)):
                    shutil.copy2(os.path.join(src, n), os.path.join(out, n))
            return
