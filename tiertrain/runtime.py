"""The runtime: what every driver (training, evaluation, generation) builds on.

It owns the compute device and the parameters' dtype, the model skeleton (no weight
memory) with the source of its initial weights, the flat layout of its units, and the
storage tier (directories and I/O threads; files are made by the parts that declare them).
Given a ``ParamSource`` (the update path's backing copy of the parameters in training), it
makes the parameter store that units are fetched through.

What it may call: ``models`` (build the skeleton), ``state`` (layout, device, parameter
store), ``io`` (storage). It knows nothing of gradients, optimizers or checkpoints.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from .config import Config, ConfigError
from .config.peft_names import resolve
from .device.core import Device, base_dtype_of, make_device, resolve_dtype
from .dist.shard import ShardLayout
from .errors import one_line
from .io import Storage
from .io.storage import record_align
from .memlimit import affinity_cores, cpu_quota
from .models import WeightSource, build_model
from .models.freeze import apply_freeze, freeze_all
from .state.layout import PARAM_ALIGN, FlatLayout, chunk_align
from .state.quant import quant_spec, require_bitsandbytes
from .state.scales import BLOCK, MIN_8BIT, param_align
from .state.store import ParamStore

__all__ = ["Runtime", "align_of", "hidden_size_of"]


def align_of(cfg: Config) -> int:
    """Bytes every unit's record starts on in state files (known before any file exists)."""
    return record_align(cfg.io.checksum, cfg.io.checksum_block_kib << 10)


def layout_aligns(cfg: Config, dtype: torch.dtype) -> tuple[int, int]:
    """(unit, parameter) alignment of the flat layout, in elements, for a model whose narrowest
    kept dtype is ``dtype``: units on whole checksum blocks of every state file of 2- or 4-byte
    elements, parameters on 64 elements (8-bit moments: their 256-element blocks). 8-bit
    moments' files (1-byte codes) are not padded to whole blocks a unit: a unit's record starts on
    one (``regions.place``) and its last chunk's end is patched through the bounce buffer."""
    trained = not cfg.adapter.on
    return chunk_align(align_of(cfg), dtype), param_align(cfg.optim) if trained else PARAM_ALIGN


def hidden_size_of(model, cfg: Config) -> int:
    return model.hf_config.hidden_size if model.hf_config is not None else cfg.model.d_model


log = logging.getLogger("tiertrain")
_QUOTA_SAID = False


def fit_threads_to_quota(world: int = 1) -> int | None:
    """Torch's compute threads lowered to the cores' worth a cgroup's CPU quota gives (shared by
    this machine's ``world`` ranks), where torch would take more, its count is still its default
    (not set by the caller) and ``OMP_NUM_THREADS`` does not choose; said once. Returns the count set, or None where nothing changed."""
    global _QUOTA_SAID
    quota = cpu_quota()
    if quota is None or os.environ.get("OMP_NUM_THREADS"):
        return None
    want = max(1, int(quota / max(1, world)))
    have = torch.get_num_threads()
    if have <= want or have != affinity_cores():
        return None  # fewer already, or chosen by the caller (torch.set_num_threads): left alone
    torch.set_num_threads(want)
    if not _QUOTA_SAID:
        _QUOTA_SAID = True
        log.info(
            "compute threads: %d, the %.1f cores' worth of this cgroup's CPU quota%s (torch would take %d, each "
            "throttled in turn; OMP_NUM_THREADS chooses)",
            want,
            quota,
            f" shared by {world} ranks" if world > 1 else "",
            have,
        )
    return want


class Runtime:
    def __init__(
        self,
        cfg: Config,
        *,
        weights: WeightSource | None = None,
        device: Device | None = None,
        rank: int = 0,
        world: int = 1,
        resuming: bool = False,
    ) -> None:
        """``rank`` of ``world`` data-parallel ranks: units are padded to ``world`` equal aligned
        shards and ``state_layout`` is this rank's (the whole layout with one rank). ``resuming``:
        a checkpoint's adapters come next (``adapter.init_from``, what the run began from, is not
        read again: it may be gone, or refused since)."""
        if device is not None and not isinstance(device, Device):  # ('tpu', 'cuda': an AttributeError deep inside)
            raise ConfigError(
                f"device = {device!r}: give a tiertrain Device (tiertrain.device.make_device) or leave it unset; "
                "the compute device is the config's train.device"
            )
        self.cfg, self.rank, self.world = cfg.validate(), rank, world  # one validation path: objects as flags
        self.dev = device if device is not None else make_device(cfg.train.device, cfg.io.gds, world=world)
        fit_threads_to_quota(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # this machine's ranks share the quota
        self.dtype: torch.dtype = resolve_dtype(cfg.train.param_dtype, self.dev.device)
        self.base_dtype = base_dtype_of(cfg.model.base_dtype, self.dtype)
        if self.base_dtype.itemsize > self.dtype.itemsize:
            raise ConfigError(
                f"model.base_dtype = {cfg.model.base_dtype!r} is wider than the compute dtype ({self.dtype}): it would "
                "read more and compute nothing finer; leave it unset or use a narrower dtype"
            )
        self._given_weights, self._resuming = weights, resuming
        self._build_model(cfg)
        self.storage: Storage | None = None
        self.params: ParamStore | None = None

    def _build_model(self, cfg: Config) -> None:
        try:
            self.model, source = build_model(cfg.model, param_dtype=self.dtype, seed=cfg.train.seed)
        except (RuntimeError, MemoryError) as exc:  # (a vocabulary of 1e11 was torch's allocator's traceback)
            if not isinstance(exc, MemoryError) and "allocate" not in str(exc):
                raise
            m = cfg.model
            sizes = ", ".join(f"model.{k} = {getattr(m, k)}" for k in ("n_layers", "d_model", "d_ff", "vocab_size"))
            raise ConfigError(
                f"the model cannot be built: one of its tensors does not fit in this machine's memory "
                f"({one_line(exc)[:160]}); {'its model directory' if m.hf_dir else sizes}: give smaller sizes"
            ) from None
        self.weights = self._given_weights or source
        self.adapters = None
        if cfg.adapter.on:  # the base frozen whole, the adapters beside it on the compute device
            from .adapters import LoRA

            experts = resolve(cfg.adapter, self.model.hf_config).parameters  # (as peft reads adapter.target)
            if self.model.cut_params and experts:
                raise ConfigError(
                    f"adapter.target_parameters = {experts!r} with the experts cut into ranges "
                    f"(model.layer_pieces = {cfg.model.layer_pieces}) is not supported: adapters on the experts need "
                    "them whole; use model.layer_pieces = 2 (or unset), or adapters on the attention only"
                )

            self.frozen = freeze_all(self.model)
            self.adapters = LoRA(self.model, cfg.adapter, seed=cfg.train.seed, device=self.dev.device)
            # continue a peft adapter (not where a checkpoint's adapters replace it)
            if cfg.adapter.init_from is not None and not self._resuming and self.weights.adapters is None:
                from .adapters.peft_io import load_peft

                load_peft(self.model, self.adapters, cfg.adapter.init_from)
            if self.weights.adapters is not None:  # a checkpoint's: evaluation and generation with them
                self.adapters.load_named(self.weights.adapters)
        else:
            self.frozen = apply_freeze(self.model, cfg.train.freeze)  # before the layouts: they record it
        # units start where a record of the narrowest dtype kept starts (the frozen model's may be narrower)
        align, p_align = layout_aligns(cfg, self.base_dtype)
        world, rank = self.world, self.rank
        self.layout = FlatLayout(self.model, unit_align=world * align, param_align=p_align)
        # the layout of one rank: what checkpoints are written in, whatever the world
        self.canonical_layout = (
            self.layout if world == 1 else FlatLayout(self.model, unit_align=align, param_align=p_align)
        )
        self.state_layout = (
            self.layout if world == 1 else ShardLayout(self.layout, rank, world, align, self.canonical_layout)
        )
        if self.dev.separate:
            _buffers_to(self.model, self.dev.device)
        self._check_quantized(cfg)
        self._check_optim(cfg)

    def _check_quantized(self, cfg: Config) -> None:
        """A quantized base (``model.base_dtype``): bitsandbytes present, something to quantize."""
        spec = quant_spec(cfg.model)
        if spec is None:
            return
        what = f"model.base_dtype = {spec.kind!r}"
        require_bitsandbytes(what)
        if not self.layout.quantizable:
            raise ConfigError(
                f"{what}: this model's blocks have no nn.Linear layer to quantize (GPT-2's are Conv1D); use "
                "model.base_dtype = 'bfloat16' to halve its bytes, or leave it unset"
            )

    def _check_optim(self, cfg: Config) -> None:
        """8-bit optimizer states (``optim.name = 'adamw8bit'``): bitsandbytes present (>= 0.50); row
        pieces (vocabulary pieces, ranges of experts) starting on its blocks, which count from the
        whole matrix's start."""
        if cfg.optim.name != "adamw8bit":
            return
        what = "optim.name = 'adamw8bit'"
        require_bitsandbytes(what)
        import bitsandbytes

        if tuple(int(x) for x in bitsandbytes.__version__.split(".")[:2]) < (0, 50):
            raise ConfigError(
                f"{what} needs bitsandbytes >= 0.50 (its CPU kernels), and {bitsandbytes.__version__} is installed: "
                "pip install -U 'bitsandbytes>=0.50'"
            )
        if cfg.adapter.on:
            return  # the adapters' optimizer: bitsandbytes' own AdamW8bit, in memory
        for name, piece in self.model.row_pieces.items():
            row = math.prod(piece.whole_shape[1:])
            if math.prod(piece.whole_shape) >= MIN_8BIT and piece.start * row % BLOCK:
                raise ConfigError(
                    f"{what}: the row piece {name} starts at element {piece.start * row} of {piece.whole}, not on one of "
                    f"bitsandbytes' {BLOCK}-element blocks (counted from the whole matrix's start); cut it otherwise "
                    "(model.vocab_pieces, model.layer_pieces) or leave them unset, or use optim.name = 'adamw'"
                )

    def recut(self, cfg: Config) -> None:
        """The model built again for ``cfg`` (another ``model.vocab_pieces``), on the same device,
        before anything was sized from it. Weights given by the caller are tied to the first
        model's units: refused."""
        if self._given_weights is not None:
            raise ConfigError(
                "the model must be cut to fit the memory budget, but this run's weights were given for the "
                "uncut model: set model.vocab_pieces and model.layer_pieces (or raise memory.host_mib)"
            )
        self.cfg = cfg
        self._build_model(cfg)

    @property
    def align(self) -> int:
        return align_of(self.cfg)

    @property
    def hidden_size(self) -> int:
        return hidden_size_of(self.model, self.cfg)

    @property
    def update_writes_slots(self) -> bool:
        """Whether an update path may write new parameters straight into the parameter slots:
        where device memory is host memory and the update's units are the slots' (with ranks a
        rank updates its shard of a unit, a slot holds the whole unit)."""
        return not self.dev.separate and self.state_layout is self.layout

    def open_storage(self, io=None) -> Storage:
        """The storage tier as ``io`` (the planned config's ``[io]``; default: the runtime's) says."""
        self.storage = Storage.from_config(io or self.cfg.io)
        return self.storage

    def bind_params(
        self, source, *, slots: int | None = None, slot_tensors: list[torch.Tensor] | None = None
    ) -> ParamStore:
        """The parameter store over ``source`` (a ``ParamSource``) with ``slots`` slots (default:
        the configured ``memory.device_slots``)."""
        self.params = ParamStore(
            self.layout, source, self.dev, slots=slots or self.cfg.memory.device_slots, slot_tensors=slot_tensors
        )
        return self.params

    def close(self) -> None:
        try:
            if self.params is not None:
                self.params.close()
        finally:
            self.params = None
            if self.storage is not None:
                self.storage.close()
                self.storage = None
            self.dev.close()


def _buffers_to(model, device: torch.device) -> None:
    """The skeleton's buffers (rotary tables' ``inv_freq``: real tensors, not parameters) on
    the compute device once, instead of an upload at every call."""
    roots = [model] + ([model.hf_model] if model.hf_model is not None else [])
    for root in roots:
        for module in root.modules():
            for name, b in module._buffers.items():
                if b is not None and b.device != device:
                    module._buffers[name] = b.to(device)
