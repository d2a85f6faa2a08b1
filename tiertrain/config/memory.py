"""The ``[memory]`` section: one host memory budget and, for experts, the size of each of its
parts (``cost/budget.py`` places the states in it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from .sections import Section, opt

__all__ = ["MemoryConfig"]


@dataclass(kw_only=True)
class MemoryConfig(Section):
    """One memory budget, and (for experts) the size of each of its parts, fixed at start."""

    SECTION: ClassVar[str] = "memory"
    host_mib: int | None = opt(
        None,
        "Host memory tiertrain may use for its pools and states, MiB, beyond what the process holds "
        "at start (interpreter, libraries) (None: half of the memory available at start, within a "
        "memory cgroup's limit where one is tighter (a container's, a Slurm job's), printed; a budget "
        "that with what the cgroup holds would pass its limit is refused; for the built-in default job, the default model on "
        "the bundled corpus, its fixed pools and a quarter of its states, so that it shows the "
        "rest streaming from io.paths). The fixed pools come first; parameters, "
        "gradients, optimizer state, hidden states (and, on CPU, kept activations) are placed "
        "in it by the step time a byte saves; the *_mib fields below that are set are taken as "
        "given.",
    )
    device_mib: int | None = opt(
        None,
        "CUDA: device memory for parameter slots, gradient buffers and kept activations, "
        "MiB (None: 90% of what is free at start).",
    )
    device_slots: int = opt(3, "Device buffers for layer parameters (>= 2: one computing, the rest prefetching).")
    host_param_mib: int | None = opt(
        None,
        "Host memory for parameters kept off the SSD, MiB (None: planned within "
        "host_mib; 0: every layer streams from SSD).",
    )
    grad_host_mib: int | None = opt(
        None,
        "Host memory where gradients wait for the update, MiB; the rest go to SSD (None: planned within host_mib).",
    )
    optim_host_mib: int | None = opt(
        None,
        "Host memory for optimizer states (moments, master weights), MiB (None: "
        "planned within host_mib; 0: all on SSD).",
    )
    optim_device_mib: int | None = opt(
        0,
        "CUDA: device memory for the optimizer's states (fp32 master weights and moments) of the first trained "
        "units that fit, MiB: they are updated there, by torch's fused AdamW on the device (plain PyTorch's own "
        "kernel), and the host's update skips them; only their gradients go up and their new parameters down "
        "(None: planned: as many as the device holds beside the fixed pools, before kept activations; 0: none). "
        "Not on CPU (device memory is the host's) nor with update.speculate = 'on', 8-bit states or update "
        "engines, which update on the host.",
    )
    stash_host_mib: int | None = opt(
        None,
        "Host memory for hidden states between layers, MiB; the rest spills to SSD (None: planned within host_mib).",
    )
    keep_act_mib: int | None = opt(
        None,
        "Memory on the compute device for autograd activations kept from the forward for the backward, MiB:"
        " blocks kept there are neither read back nor recomputed (0: none kept;"
        " None: planned, within host_mib on CPU and device_mib on CUDA).",
    )
    activations: str = opt(
        "auto",
        "Where each (block, micro-batch)'s autograd activations wait for the backward: 'auto' (those the backward"
        " reaches first kept within keep_act_mib, then offloaded to the storage tier as far as the cost model"
        " predicts a faster step, the earliest recomputed), 'keep' (kept within keep_act_mib, the rest recomputed),"
        " 'keep-first' (the first ones kept while the budget lasts, the rest recomputed), 'offload' (every pair not"
        " kept goes to the storage tier) or 'recompute' (none kept: every block recomputed from its stashed input).",
    )
    offload_pairs: int | None = opt(
        None,
        "(block, micro-batch) pairs whose activations go to the storage tier, the ones just before the kept ones"
        " (activations = 'auto' or 'offload'; None: planned: all the rest for 'offload', by the cost model for"
        " 'auto'). Their file space is claimed at start.",
    )
    act_buffers: int = opt(
        3,
        "Records of offloaded activations in memory (>= 2): in the forward, the one being filled and writes in"
        " flight; in the backward, the one back-propagated and act_buffers - 1 read ahead.",
    )
    residual_host_mib: int | None = opt(
        None, "Host memory for top-k error-feedback residuals, MiB; the rest on SSD (None: planned within host_mib)."
    )
    engine_read_ahead_mib: int = opt(
        0,
        "Host memory in which the update engines (together) read the optimizer state of the first chunks of"
        " the next update ahead, while the trainer is in its backward, MiB (update.mode = 'engines'; 0: none;"
        " never more than the engines' state).",
    )
    mmap_threshold_kib: int = opt(
        0,
        "Blocks at least this large are mapped from the system and given back when freed "
        "(glibc's M_MMAP_THRESHOLD, fixed for the process; 0: the C library's default, which "
        "raises it as blocks are freed). 1024 keeps the peak RSS within the budget on long "
        "sequences (freed activations otherwise fragment the heap: +150 MiB measured at 1024 "
        "tokens) but every large tensor is then faulted in afresh: 15-25% slower steps here.",
    )
    trim_heap: bool = opt(
        True,
        "Give the C library's freed heap pages back to the system after a unit step once the "
        "process has grown past its budget less the working set of a step's unit step (glibc "
        "malloc_trim): otherwise what one unit step freed stays in the process, fragmented, and the "
        "peak RSS exceeds the budget (measured: 150-200 MiB at d_model 2048, M = 32). Only where "
        "needed: the pages given back are faulted in again by the next unit step (20-40% of a small "
        "in-memory step when trimmed after every one). No effect where the C library has no malloc_trim.",
    )
    kv_host_mib: int | None = opt(
        None,
        "Generation: host memory for the key/value cache, MiB, claimed at start from "
        "the batch, the prompts' length and max_new_tokens (it never grows); what does not fit "
        "goes to the storage tier (kv.bin on the first io.paths entry), read in and written back "
        "each step, one (block, micro-batch) ahead. None: in memory as far as memory.host_mib (or "
        "its default) leaves after the parameter slots, the rest on the storage tier; 0: all of it on "
        "the storage tier. On CUDA the memory is the device's (None: all of it there).",
    )
    expert_cache_mib: int | None = opt(
        None,
        "Eval and generation of a mixture of experts with io.weights = 'tier': host memory for the "
        "experts the routing reaches most often, MiB, claimed at start (the others are read when "
        "reached). None: what the host budget for weights leaves after the units kept whole; 0: none.",
    )
    update_buffer_kib: int = opt(
        32768,
        "Size of one buffer set of the streamed update, KiB (3 sets are in flight). Left at this default, a memory.host_mib too small for the fixed pools lowers it, down to 8192, and says so.",
    )

    def __post_init__(self) -> None:
        self._in_range("device_slots", 2, 64)
        for name in (
            "host_param_mib",
            "grad_host_mib",
            "optim_host_mib",
            "optim_device_mib",
            "stash_host_mib",
            "residual_host_mib",
            "keep_act_mib",
            "engine_read_ahead_mib",
            "offload_pairs",
            "expert_cache_mib",
        ):
            if getattr(self, name) is not None:
                self._at_least(name, 0)
        for name in ("host_mib", "device_mib"):
            if getattr(self, name) is not None:
                self._at_least(name, 1)
        if self.kv_host_mib is not None:
            self._at_least("kv_host_mib", 0)  # 0: the whole cache on the storage tier
        self._in_range("update_buffer_kib", 64, 4 << 20)
        self._in_range("mmap_threshold_kib", 0, 32 << 10)
        self._one_of("activations", ("auto", "keep", "keep-first", "offload", "recompute"))
        self._in_range("act_buffers", 2, 64)
        if self.offload_pairs and self.activations not in ("auto", "offload"):
            raise ConfigError(
                f"memory.offload_pairs = {self.offload_pairs} needs memory.activations = 'auto' or 'offload' "
                f"(it is {self.activations!r}); set one, or leave offload_pairs unset"
            )
