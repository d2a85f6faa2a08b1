"""The configuration's sections: one kw-only dataclass per component, every field with its
documentation (``opt``) and checked when the section is made (``Section``: errors that name
``section.field``, the value and what would be accepted). The tree of them, loading and the
reference are in ``config/__init__.py``."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..errors import ConfigError
from .base import Section, opt

__all__ = [
    "Section",
    "IOConfig",
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "UpdateConfig",
    "CheckpointConfig",
    "TrainConfig",
    "RanksConfig",
    "without_environment_checks",
    "has_tokenizer",
    "TOKENIZER_MARKERS",
    "opt",
    "env_checks",
]


# Checks that look at the machine (files named by the config exist) run when a section is
# made, except inside ``without_environment_checks()``: exporting a checkpoint, say, must
# not fail because the corpus it was trained on has moved since.
_ENV_CHECKS = contextvars.ContextVar("tiertrain_config_env_checks", default=True)


@contextlib.contextmanager
def without_environment_checks() -> Iterator[None]:
    token = _ENV_CHECKS.set(False)
    try:
        yield
    finally:
        _ENV_CHECKS.reset(token)


def env_checks() -> bool:
    """Whether checks that look at the machine run now (not inside ``without_environment_checks``)."""
    return _ENV_CHECKS.get()


# What makes a directory a Hugging Face tokenizer's (one of them is enough).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")


def has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, n)) for n in TOKENIZER_MARKERS)


@dataclass(kw_only=True)
class IOConfig(Section):
    """The storage tier: where states live on SSD and how they are read and written."""

    SECTION: ClassVar[str] = "io"
    paths: list[str] = opt(
        None,
        "Scratch directories, one per SSD; files are striped over all of them.",
        factory=lambda: ["./tiertrain-scratch"],
    )
    threads: int = opt(8, "I/O threads per path (measured here: 4-8 reach the disk's limit).")
    chunk_kib: int = opt(
        16384,
        "Largest single request, KiB (a multiple of 4; 16 MiB measured best here). Left at this default, a memory.host_mib too small for the fixed pools lowers it, down to 4096, and says so.",
    )
    stripe_kib: int = opt(4096, "Stripe size over several paths, KiB (a multiple of checksum_block_kib).")
    direct: bool = opt(True, "Use O_DIRECT (falls back to buffered I/O, with a warning, where unsupported).")
    checksum: bool = opt(True, "Keep a CRC32C per block beside every state file and verify it on read.")
    checksum_block_kib: int = opt(1024, "Bytes covered by one checksum, KiB (a multiple of 4 dividing chunk_kib).")
    weights: str = opt(
        "source",
        "Forward-only commands (eval, generate): 'source' reads each unit from the model's "
        "own files (safetensors, a checkpoint) through the page cache; 'tier' converts them once, unit "
        "by unit, into weights-<key>.bin on the first io.paths entry (the compute dtype, or a 4-bit "
        "base's 4 bits; checksummed, kept for later runs) and reads units from it with O_DIRECT. A "
        "QLoRA checkpoint's 4-bit base is read as it is stored either way.",
    )
    routed_experts: bool = opt(
        True,
        "Forward-only commands with io.weights = 'tier', on a mixture of experts: read a block "
        "without its experts and each expert when the routing first reaches it in the block's "
        "pass (exact: the experts not reached are never computed with). false: read blocks whole, "
        "ahead of the compute (faster where nearly every expert is reached: a long prefill).",
    )
    guess_experts: bool = opt(
        True,
        "Routed reads: read a block's experts its last pass reached ahead, with the block, once "
        "the passes show that the next pass reaches at least half of them again (eval and long "
        "prompts: nearly every expert, read ahead of the compute instead of after the router); "
        "exact either way (an expert read and not reached is never computed with). false: experts "
        "are read only after the router names them.",
    )
    gds: str = opt(
        "auto",
        "GPUDirect Storage on CUDA: parameters read from SSD straight into GPU memory through "
        "kvikio (checksums verified on the GPU). 'auto' (when kvikio is installed), 'on' (refuse to "
        "start without it), 'off' (through pinned host buffers). With ranks the reads go through "
        "host memory, where the ranks gather ('on' is refused).",
    )

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if not self.paths or any(not isinstance(p, str) or not p for p in self.paths):
            self._fail("paths", "give at least one directory, e.g. --io.paths=/nvme0/tt,/nvme1/tt")
        if len(set(map(os.path.realpath, self.paths))) != len(self.paths):  # (a symlink to another: the same)
            self._fail("paths", "paths must be distinct directories")
        self._in_range("threads", 1, 256)
        self._one_of("gds", ("auto", "on", "off"))
        self._one_of("weights", ("source", "tier"))
        for name in ("chunk_kib", "stripe_kib", "checksum_block_kib"):
            if getattr(self, name) < 4 or getattr(self, name) % 4:
                self._fail(name, "must be a positive multiple of 4 (KiB), the O_DIRECT alignment")
        if self.chunk_kib % self.checksum_block_kib:
            self._fail("checksum_block_kib", f"must divide io.chunk_kib ({self.chunk_kib})")
        if self.stripe_kib % self.checksum_block_kib:
            self._fail("stripe_kib", f"must be a multiple of io.checksum_block_kib ({self.checksum_block_kib})")


@dataclass(kw_only=True)
class ModelConfig(Section):
    """Which model to train. Sizes apply to a model built from scratch (random weights)."""

    SECTION: ClassVar[str] = "model"
    kind: str = opt(
        "auto",
        "'auto' (read from hf_dir's config.json, else 'gpt'), 'gpt' (built-in), 'llama' "
        "(transformers LlamaForCausalLM without hf_dir; with it, any decoder-only family tiertrain runs: "
        "Mistral, Qwen2/3, Phi-3, OLMo 2, Gemma 1-3, Phi, Granite) or 'gpt2'.",
    )
    hf_dir: str | None = opt(None, "Local Hugging Face model directory (config.json + safetensors); never downloads.")
    from_scratch: bool = opt(False, "With hf_dir: use its config.json but start from random weights.")
    init_from: str | None = opt(
        None, "Initial weights from safetensors (a file, or a directory written by `tiertrain export`)."
    )
    n_layers: int = opt(4, "Transformer blocks (from-scratch models).")
    d_model: int = opt(256, "Hidden size (from-scratch models).")
    n_heads: int = opt(4, "Attention heads (from-scratch models).")
    n_kv_heads: int | None = opt(None, "Key/value heads for llama (None: same as n_heads).")
    d_ff: int | None = opt(None, "MLP inner size (None: 4*d_model for gpt/gpt2, ~8/3*d_model for llama).")
    vocab_size: int = opt(256, "Vocabulary size (from-scratch models; 256 fits the byte tokenizer).")
    max_seq_len: int = opt(1024, "Longest sequence the model supports (position table size).")
    tie_embeddings: bool = opt(False, "Share the input embedding with the output head (gpt2 ties by default).")
    init_std: float = opt(0.02, "Standard deviation of the random initial weights.")
    dropout: float = opt(
        0.0,
        "Dropout probability of the built-in gpt (embedding, attention, residuals); recomputed "
        "blocks replay the forward's random draws, so every activation path gives the same masks.",
    )
    vocab_pieces: int | None = opt(
        None,
        "Pieces (row ranges) the token embedding and the output head are cut "
        "into, each its own unit, so that slots and buffers are sized by a block, not by "
        "a vocabulary-sized matrix. None: whole (exact), unless the memory budget cannot "
        "hold whole vocabulary units: then the fewest pieces no larger than a block, said "
        "at start; 1: never cut. A cut head's cross-entropy is an online log-sum-exp over "
        "pieces: equal to the whole one up to rounding (docs/DESIGN.md).",
    )
    layer_pieces: int | None = opt(
        None,
        "Sub-layer units each decoder layer is cut into, between whole modules, so that slots and "
        "buffers are sized by a piece, not by a block (a 70 B layer is 3.4 GB in fp32): 2 (attention | "
        "MLP), 3 (attention | norm, gate and up | down), 4 (attention | norm and gate | up | down); a "
        "mixture of experts' layer (Qwen3-MoE's, OLMoE's, Mixtral's form) into attention | its MoE block (2), or attention and "
        "N - 1 ranges of whole experts. Exact: losses and gradients are the whole layer's bit for bit (ranges "
        "of experts with clipping on: the clip's global norm by rounding, 3e-4 to 5e-4 relative measured). None: whole, unless the memory budget "
        "cannot hold a whole block: then the fewest pieces that fit, said at start; 1: never cut. Pre-norm "
        "Llama-layout layers (Llama, Mistral, Qwen2, Qwen3, Gemma, ...) only.",
    )

    base_dtype: str | None = opt(
        None,
        "With adapters: the dtype the frozen model's weights are kept in on the storage tier and in "
        "memory ('bfloat16' or 'float16' halve the bytes a step reads); each unit is upcast to the compute "
        "dtype (train.param_dtype) as it is loaded. 'nf4' or 'fp4': QLoRA's 4-bit base, bitsandbytes' "
        "formats, as BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=...) quantizes it (the "
        "blocks' linear weights, in blocks of 64; about 0.56 bytes a weight), dequantized per unit as it "
        "is loaded; needs bitsandbytes. 'int8': LLM.int8()'s base, as BitsAndBytesConfig(load_in_8bit=True) "
        "quantizes it (each output row's weights to int8 with one scale; about 1 byte a weight), computed as "
        "bitsandbytes' Linear8bitLt trains (the dequantized weight; its eval-mode kernel, which quantizes the "
        "activations too, differs by about 0.6% relative). None: the compute dtype.",
    )

    base_double_quant: bool = opt(
        False,
        "With model.base_dtype 'nf4' or 'fp4': the blocks' scales quantized to 8 bits too "
        "(bitsandbytes' bnb_4bit_use_double_quant; about 0.4 bits a weight fewer).",
    )

    def __post_init__(self) -> None:
        for name in ("hf_dir", "init_from"):  # '' would read the current directory, unnamed
            if getattr(self, name) is not None and not getattr(self, name).strip():
                self._fail(name, "empty: name a model directory or file ('.' for the current directory)")
        if self.base_dtype is not None:
            self._one_of("base_dtype", ("float32", "bfloat16", "float16", "nf4", "fp4", "int8"))
        if self.base_double_quant and self.base_dtype not in ("nf4", "fp4"):
            self._fail("base_double_quant", "quantizes a 4-bit base's scales: set model.base_dtype = 'nf4' or 'fp4'")
        self._one_of("kind", ("auto", "gpt", "llama", "gpt2"))
        if self.vocab_pieces is not None:
            self._at_least("vocab_pieces", 1)
        if self.layer_pieces is not None:
            self._at_least("layer_pieces", 1)
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len"):
            self._at_least(name, 1)
        if self.d_model % self.n_heads:
            self._fail("d_model", f"must be divisible by model.n_heads ({self.n_heads})")
        if self.kind == "llama" and self.d_model // self.n_heads % 2:  # rotary pairs a head's dimensions
            hd = self.d_model // self.n_heads
            self._fail(
                "d_model", f"gives heads of {hd} (/ model.n_heads): a Llama's rotary embeddings need an even size"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            self._fail("n_kv_heads", f"must divide model.n_heads ({self.n_heads})")
        if self.d_ff is not None:
            self._at_least("d_ff", 1)
        self._in_range("init_std", 0.0, 1.0)
        self._in_range("dropout", 0.0, 0.9)
        if self.dropout and self.kind not in ("auto", "gpt"):
            self._fail(
                "dropout",
                f"applies to the built-in gpt only (model.kind = {self.kind!r}); set it in the "
                "model's config.json instead",
            )
        if self.hf_dir is None:
            if self.kind == "auto":
                self.kind = "gpt"
        elif self.kind == "gpt":
            self._fail(
                "kind",
                f"the built-in model does not read model.hf_dir ({self.hf_dir}); leave model.kind at "
                "'auto' (the kind is read from config.json) or set 'llama' or 'gpt2'",
            )
        if not env_checks():
            return
        if self.init_from is not None and not os.path.exists(self.init_from):
            self._fail("init_from", "no such file or directory; give a .safetensors file or an exported directory")
        if self.hf_dir is not None:
            self._check_hf_dir()

    def hf_json(self) -> dict:
        """``hf_dir``'s config.json, parsed."""
        assert self.hf_dir is not None  # asked only of a model with a directory
        path = os.path.join(self.hf_dir, "config.json")
        if not os.path.isfile(path):
            self._fail("hf_dir", "no config.json there; point it at a local Hugging Face model directory")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (ValueError, UnicodeDecodeError) as exc:
            self._fail("hf_dir", f"{path} is not valid JSON ({exc}); restore it from the model's source")
        if not isinstance(d, dict) or not isinstance(d.get("model_type"), str):
            self._fail("hf_dir", f"{path} has no model_type; it is not a Hugging Face model config")
        return d

    def _check_hf_dir(self) -> None:
        """The kind is what config.json says (``auto`` takes it; a contradiction is refused)."""
        model_type = self.hf_json()["model_type"]
        detected = "gpt2" if model_type == "gpt2" else "llama"  # the decoder families; checked when built
        if self.kind == "auto":
            self.kind = detected
        elif self.kind != detected:
            self._fail(
                "kind",
                f"model.hf_dir = {self.hf_dir!r} holds a {model_type!r} model (config.json), which is "
                f"kind {detected!r}; leave model.kind at 'auto' or set it to {detected!r}",
            )

    def position_limit(self) -> tuple[int, str] | None:
        """The longest sequence ``hf_dir``'s model supports, and the config.json key that says so."""
        if self.hf_dir is None:
            return None
        d = self.hf_json()
        for key in ("n_positions", "max_position_embeddings"):
            if isinstance(d.get(key), int):
                return d[key], key
        return None


@dataclass(kw_only=True)
class DataConfig(Section):
    """Training data and batch shape."""

    SECTION: ClassVar[str] = "data"
    corpus: str = opt(
        "bundled",
        "'bundled' (small public-domain text shipped with tiertrain), a .txt file, a token file or "
        "an examples directory made by `tiertrain prepare`, or rows to fine-tune on (.jsonl, .parquet, a "
        "datasets save_to_disk directory: prepared once into ~/.cache/tiertrain/prepared).",
    )
    tokenizer: str | None = opt(
        None,
        "Local Hugging Face tokenizer directory for text and rows (None: model.hf_dir's "
        "tokenizer where it holds one, else byte-level; 'bytes': byte-level whatever the model "
        "directory holds).",
    )
    seq_len: int = opt(128, "Tokens per sequence.")
    micro_batch_size: int = opt(4, "Sequences per micro-batch.")
    micro_batches: int = opt(
        4, "Micro-batches per step (gradient accumulation); all go through a layer while it is resident."
    )
    seed: int = opt(0, "Seed of the sampling order.")
    eval_corpus: str | None = opt(
        None,
        "Held-out data for the validation loss (train.eval_every): any form data.corpus "
        "takes (same tokenizer); text is cut into consecutive windows of seq_len + 1 tokens, "
        "examples taken in order. None: no validation.",
    )
    eval_micro_batches: int = opt(
        8,
        "Micro-batches (of micro_batch_size windows) each validation reads from the start "
        "of data.eval_corpus (fewer if it is shorter); 0: all of it.",
    )

    format: str = opt(
        "auto",
        "Rows (JSONL, Parquet, datasets): 'text' ({text}), 'completion' ({prompt, completion}), "
        "'chat' ({messages}, the tokenizer's chat template) or 'auto' (from the first row's fields).",
    )
    mask_prompt: bool = opt(
        True, "Rows: leave prompt, system and user tokens out of the loss (False: score every token)."
    )
    packing: bool = opt(
        True,
        "Examples: pack them into rows of seq_len + 1 tokens, EOS between them (attention: "
        "data.packed_attention); False: one example per row, padded (the padding not scored).",
    )
    packed_attention: str = opt(
        "document",
        "Packed rows: 'document' (a token attends only to its own document; "
        "positions restart at each; a block-diagonal causal mask) or 'row' (the whole row, "
        "positions 0 .. seq_len - 1).",
    )
    long_examples: str = opt(
        "truncate",
        "Examples longer than seq_len + 1 tokens: 'truncate' (keep their beginning) or "
        "'drop'; how many is logged at start.",
    )

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "micro_batches"):
            self._at_least(name, 1)
        self._at_least("eval_micro_batches", 0)
        self._in_range("seed", 0, 2**63 - 1)  # (numpy's generators: a negative one failed at the first step)
        self._one_of("format", ("auto", "text", "completion", "chat"))
        self._one_of("long_examples", ("truncate", "drop"))
        self._one_of("packed_attention", ("document", "row"))
        for name in ("corpus", "eval_corpus"):
            path = getattr(self, name)
            if path in (None, "bundled") or not env_checks():
                continue
            if not os.path.exists(path):
                self._fail(
                    name,
                    "no such file; use 'bundled', a .txt file, a token file or examples directory from "
                    "`tiertrain prepare`, or .jsonl / .parquet rows",
                )
            if os.path.isdir(path) and not any(
                os.path.isfile(os.path.join(path, f))
                for f in ("meta.json", "state.json", "dataset_info.json", "dataset_dict.json")
            ):
                self._fail(
                    name,
                    "is a directory but neither an examples directory from `tiertrain prepare` nor one "
                    "saved by datasets' save_to_disk",
                )


@dataclass(kw_only=True)
class OptimConfig(Section):
    """Optimizer and learning-rate schedule."""

    SECTION: ClassVar[str] = "optim"
    name: str = opt(
        "adamw",
        "'adamw' (torch's fused kernel), 'adamw8bit' (bitsandbytes' AdamW8bit: both moments in 8 bits, "
        "blockwise, 2 bytes a parameter instead of 8; not plain AdamW's bits, bitsandbytes' own) or 'sgd' "
        "(with momentum).",
    )
    lr: float = opt(3e-4, "Peak learning rate.")
    beta1: float = opt(0.9, "AdamW beta1.")
    beta2: float = opt(0.95, "AdamW beta2.")
    eps: float = opt(1e-8, "AdamW epsilon.")
    weight_decay: float = opt(0.1, "Decoupled weight decay (AdamW) or L2 (SGD).")
    momentum: float = opt(0.9, "SGD momentum.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this (0 turns clipping off).")
    warmup_steps: int = opt(10, "Linear warmup steps.")
    schedule: str = opt("cosine", "'cosine' (to min_lr_ratio * lr at the last step) or 'constant'.")
    min_lr_ratio: float = opt(0.1, "Final learning rate of the cosine schedule, as a fraction of lr.")

    def __post_init__(self) -> None:
        self._one_of("name", ("adamw", "adamw8bit", "sgd"))
        self._in_range("lr", 0.0, 10.0)
        self._in_range("beta1", 0.0, 0.999999)
        self._in_range("beta2", 0.0, 0.999999999)
        self._in_range("eps", 0.0, 1.0)
        self._at_least("weight_decay", 0.0)
        self._in_range("momentum", 0.0, 0.999999)
        self._at_least("grad_clip", 0.0)
        self._at_least("warmup_steps", 0)
        self._one_of("schedule", ("cosine", "constant"))
        self._in_range("min_lr_ratio", 0.0, 1.0)


@dataclass(kw_only=True)
class UpdateConfig(Section):
    """Where the optimizer step runs."""

    SECTION: ClassVar[str] = "update"
    mode: str = opt(
        "auto",
        "'auto': 'baseline' or 'overlap' (same states, memory and math): the baseline where the update "
        "moves nothing on the storage tier and the compute is on the CPU, else the one the cost model "
        "predicts faster (the overlap where nothing is measured); "
        "'baseline': the trainer streams states through its own buffers after the backward; "
        "'overlap': the same, in a background thread under the next forward (with update.eager, under the "
        "backward as gradients arrive): same math, same memory; "
        "'engines': one worker process per storage path updates its slice next to its storage, under the next forward; "
        "'frozen' (chosen with adapters: nothing of the model is updated, its parameters are the only state).",
    )
    engines: int = opt(0, "Number of update engines (0: one per io.paths entry).")
    eager: bool = opt(
        False,
        "Update each unit as its gradients arrive, under the backward (update.mode = 'engines' or "
        "'overlap'; needs optim.grad_clip = 0).",
    )
    speculate: str = opt(
        "off",
        "With optim.grad_clip > 0: 'on' updates each unit as its gradients arrive, "
        "under the backward, as if the clip will not act, into a second copy of the states (twice their "
        "space, said in the plan); after the backward the step is kept where the clip did not act and "
        "every value is finite, else redone from the first copy with the clip (one more update's I/O). "
        "Exact either way. The overlapped path does it in its update thread, the engines next to their "
        "storage (reading no gradient back in a kept step); the baseline in the trainer's thread between "
        "the backward's units: the same math, no time hidden. 'auto': on where the cost model predicts a "
        "gain and the storage tier has the space; 'off'. See docs/guide/update-paths.md.",
    )
    engine_timeout_s: float = opt(30.0, "An engine silent for this long is reported as hung.")
    topk: float = opt(
        0.0,
        "Top-k gradient compression: fraction of each gradient kept and sent to the engines "
        "(0: off; up to 0.5). Changes the math: see docs/guide/update-paths.md.",
    )
    error_feedback: bool = opt(
        False,
        "With topk: add what was dropped to the next step's gradient "
        "(a fp32 residual per parameter, in RAM within memory.residual_host_mib, else on SSD).",
    )

    def __post_init__(self) -> None:
        self._one_of("mode", ("auto", "baseline", "overlap", "engines", "frozen"))
        self._one_of("speculate", ("auto", "on", "off"))
        self._in_range("engines", 0, 256)
        self._in_range("engine_timeout_s", 1.0, 86400.0)
        self._in_range("topk", 0.0, 0.5)


@dataclass(kw_only=True)
class CheckpointConfig(Section):
    """Checkpoints of the whole run state: complete or absent, checked on load."""

    SECTION: ClassVar[str] = "checkpoint"
    every: int = opt(0, "Save every N steps (0: only at the end and on Ctrl-C).")
    keep: int = opt(2, "Keep the last K checkpoints; older ones are deleted after a successful save.")
    dir: str | None = opt(None, "Where checkpoints go (None: <train.run_dir>/checkpoints).")
    at_end: bool = opt(True, "Save when the last step is done.")
    on_interrupt: bool = opt(True, "On Ctrl-C, finish the current step, save, then stop.")

    def __post_init__(self) -> None:
        self._at_least("every", 0)
        self._at_least("keep", 1)


# a ``train.freeze`` selector (models/freeze.py): embed, head, blocks, blocks:N, blocks:A-B
FREEZE_SELECTOR = re.compile(r"^(embed|head|blocks)(?::(\d+)(?:-(\d+))?)?$")


def check_freeze(selectors: list[str]) -> None:
    """Refuse a ``train.freeze`` selector that is not one of its forms (whatever the model)."""
    for s in selectors:
        m = FREEZE_SELECTOR.match(s)
        if m is None or (m.group(2) is not None and m.group(1) != "blocks"):
            raise ConfigError(
                f"train.freeze: {s!r} is not a unit selector: use 'embed', 'head', 'blocks', 'blocks:N' or 'blocks:A-B'"
            )
        if m.group(3) is not None and int(m.group(3)) < int(m.group(2)):
            raise ConfigError(
                f"train.freeze: {s!r} is an empty range: write the first block first ('blocks:A-B', A <= B)"
            )


@dataclass(kw_only=True)
class TrainConfig(Section):
    """The run."""

    SECTION: ClassVar[str] = "train"
    steps: int = opt(40, "Optimizer steps to run.")
    seed: int = opt(0, "Seed of the model's initial weights and of dropout.")
    device: str = opt("auto", "'auto' (cuda when present, else cpu), 'cpu' or 'cuda'.")
    param_dtype: str = opt("auto", "'auto' (float32 on cpu, bfloat16 on cuda), 'float32' or 'bfloat16'.")
    grad_accum_dtype: str = opt(
        "float32",
        "What gradients of bfloat16 parameters are summed in over micro-batches: "
        "'float32' (one rounding per step, as FSDP2's reduce_dtype; a float32 buffer per "
        "gradient buffer on the device) or 'param' (bfloat16, as plain PyTorch does).",
    )
    run_dir: str = opt("./runs/default", "Where metrics, logs and checkpoints of this run go.")
    log_every: int = opt(1, "Print the per-step line every N steps.")
    eval_every: int = opt(
        0,
        "Validation loss on data.eval_corpus every N steps and after the last (0: never); "
        "shown in the per-step line and kept in the metrics as eval_loss.",
    )
    predict: bool = opt(
        True,
        "At start, probe this machine (a few seconds: 64 MiB through the storage tier, one "
        "unit of each kind) and print the predicted step time; after a few steps, predicted "
        "against measured (`tiertrain plan` prints the whole prediction).",
    )
    progress: bool = opt(True, "Show a progress bar (only when stderr is a terminal).")
    overwrite: bool = opt(
        False,
        "Start a new run in a run_dir that holds another run's checkpoints and metrics, "
        "deleting them (without it such a run is refused; --resume continues one).",
    )
    freeze: list[str] = opt(
        None,
        "Units to keep as they are: read in the forward and the backward, never trained "
        "(no gradient, no optimizer step, never written). 'embed', 'head', 'blocks', "
        "'blocks:N' or 'blocks:A-B' (from 0, inclusive); e.g. --train.freeze=embed,blocks:0-3. "
        "As plain PyTorch with requires_grad=False on them; 'head' is the head's unit: the final "
        "norm with the output projection (the start line names the parameters). A whole vocabulary for now "
        "(model.vocab_pieces 1).",
        factory=list,
    )
    tensorboard: bool = opt(
        False,
        "Also write TensorBoard event files (run_dir/tensorboard: loss, validation loss, lr, "
        "grad norm, tokens/s, step time, peak memory); needs the tensorboard package "
        "(pip install 'tiertrain[tensorboard]').",
    )

    def __post_init__(self) -> None:
        self._in_range("seed", 0, 2**63 - 1)  # (torch's generators: larger overflowed at the start)
        if not self.run_dir.strip():  # '' would be the current directory, unnamed
            self._fail("run_dir", "empty: name a directory ('.' for the current one)")
        if self.tensorboard and env_checks():
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                self._fail(
                    "tensorboard",
                    "needs the tensorboard package: pip install 'tiertrain[tensorboard]' (or "
                    "pip install tensorboard), or leave it false",
                )
        self._at_least("steps", 1)
        self._one_of("device", ("auto", "cpu", "cuda"))
        self._one_of("param_dtype", ("auto", "float32", "bfloat16"))
        self._one_of("grad_accum_dtype", ("float32", "param"))
        self._at_least("log_every", 1)
        self._at_least("eval_every", 0)
        check_freeze(self.freeze)


@dataclass(kw_only=True)
class RanksConfig(Section):
    """Data-parallel ranks (`tiertrain train --nproc N`, or torchrun): each rank holds 1/N of every state."""

    SECTION: ClassVar[str] = "ranks"
    timeout_s: float = opt(
        300.0,
        "Longest wait for another rank in any collective, seconds: a rank that died is "
        "seen at once, one that hangs after this long; every rank then stops with an error "
        "naming the collective and, from the ranks' signs of life, the rank that died or hangs.",
    )
    backend: str = opt(
        "auto",
        "'auto' or 'gloo': the ranks' collectives run on host memory over Gloo, on CPU and "
        "CUDA alike (a unit is gathered into its staging buffer and uploaded whole); 'nccl' (gathering "
        "straight into device memory) is not built and is refused.",
    )

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            self._fail("timeout_s", "must be > 0")
        self._one_of("backend", ("auto", "gloo", "nccl"))
