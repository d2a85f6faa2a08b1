"""The ranks of one run over ``torch.distributed``: the collectives sharded training needs,
with their bytes counted and their sums in a fixed order.

Sharded training moves three things between ranks (the layer-major schedule does each once
per unit and step, whatever the number of micro-batches):

- a unit's parameters, each rank holding ``1/N``: ``all_gather`` assembles the whole unit
  (forward, and again in the backward);
- a unit's gradient, summed over the ranks, each rank keeping its ``1/N``: ``reduce_scatter``;
- a few scalars (the squared gradient norm, the stop flag): ``sum_in_rank_order``, ``max``.

Exactness: a sum over ranks is always taken in rank order, ``((g0 + g1) + g2) + ...``, by the
rank that keeps the result, from the parts every rank sent it (``all_to_all``), not by the
backend's reduction, whose order depends on the algorithm (a ring starts each chunk at another
rank). So the result is the same on every rank and equal, bit for bit, to a plain PyTorch
reference that adds the ranks' gradients in rank order.

Bytes (``traffic``) are what each rank sends and receives by the algorithm's count: an
all-gather of a ``s``-byte shard sends it to ``N - 1`` ranks and receives ``N - 1`` shards; a
reduce-scatter of ``b`` bytes sends and receives ``b (N - 1) / N``. A step moves about
``3 x parameter bytes x (N - 1) / N`` per rank: two gathers and one reduce-scatter per unit.

Faults: every collective runs under the group's timeout (``timeout_s``); a rank that died or
hangs makes the others raise ``RankError`` within it instead of waiting for ever (a dead
rank's closed connections are seen at once, a hung one when the timeout runs out), naming
the rank that stopped where its signs of life tell (``watch.py``: 2 s more, 4 s at most).
Once a collective has failed the group is broken: every later one (a unit still loading
while the trainer closes) raises at once, so that ending a run never waits out a second
timeout.

Alignment: ``reduce_scatter`` needs a length divisible by the world size (a sharded layout pads
every unit to a multiple of ``N x`` its alignment).

One process is a group too: ``SoloGroup``, rank 0 of 1, whose collectives return their input
and count no bytes. The trainer holds a group either way and never asks how many ranks there
are; what differs (a unit gathered, a gradient reduced, a checkpoint written by rank 0 alone)
is the group's (``wrap_*``: the sharded wrappers, or the inner objects themselves for one).
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import typing
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TiertrainError
from .watch import Watch

__all__ = ["RankError", "BrokenGroupError", "RankGroup", "SoloGroup", "Group", "Traffic", "env_world"]


class RankError(TiertrainError, RuntimeError):
    """A collective failed: another rank died, hangs past the timeout, or disagrees."""


class BrokenGroupError(RankError):
    """A collective not run: an earlier one failed (and its error said why)."""


@dataclass
class Traffic:
    """Bytes this rank sent to and received from the others, by the algorithm's count."""

    sent: int = 0
    received: int = 0

    def add(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) as ``torchrun`` sets them; (0, 1, 0) outside it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= rank < world:
        raise RankError(f"RANK={rank} is outside WORLD_SIZE={world}: launch with torchrun, which sets both")
    return rank, world, local


class _Sharding:
    """What a group does to the objects the trainer builds (the same for every group): with one
    rank they are used as they are; with several, wrapped so that each rank holds its shard."""

    rank: int
    world: int
    traffic: Traffic

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        raise NotImplementedError

    def all_objects(self, value: Any) -> list[Any]:
        raise NotImplementedError

    def _ranks(self) -> RankGroup:
        """This group, as the sharded wrappers take it (called with several ranks only)."""
        return typing.cast(RankGroup, self)

    @property
    def leader(self) -> bool:
        """Rank 0: the one that writes checkpoints and speaks for the ranks."""
        return self.rank == 0

    def wrap_update(self, update, layout):
        """The update path's parameter source and gradient sink as the stores use them
        (``wrap_stores``); a frozen base kept narrower or quantized is gathered as it is stored
        and converted after (the update path wraps its own reads: ``gather_shards``)."""
        if self.world > 1 and getattr(update, "narrow_shards", False):
            update.gather_shards(self)
            return update.params, update.grads
        return self.wrap_stores(update.params, update.grads, layout)

    def wrap_stores(self, source, sink, layout):
        """The update's parameter source and gradient sink as the stores use them: whole units
        gathered from the ranks' shards, gradients summed over the ranks (``shard.py``)."""
        if self.world == 1:
            return source, sink
        from .shard import ShardedGrads, ShardedParams

        return ShardedParams(source, layout, self._ranks()), ShardedGrads(sink, layout, self._ranks())

    def gather_records(self, inner, layout):
        """A rank's shard of records (``inner``: a ``ParamSource`` of bytes over ``layout``, a
        ``ByteShards``) read and gathered whole, in load order (``ShardedRecords``)."""
        from .shard import ShardedParams, ShardedRecords

        return ShardedRecords(ShardedParams(inner, layout, self._ranks()))

    def gather_units(self, inner, layout):
        """A rank's shard of the units (``inner``, over ``layout``: a narrower frozen base's) read
        and gathered whole in its own dtype, in load order (``ShardedParams``)."""
        from .shard import ShardedParams

        return ShardedParams(inner, layout, self._ranks())

    def gathered(self, regions: dict, layout) -> dict:
        """Checkpointed regions in the one-rank layout (written by rank 0: ``checkpoint.py``)."""
        if self.world == 1:
            return regions
        from .checkpoint import GatheredRegion, gathered_scales, is_scales, shards_of

        g = self._ranks()
        return {
            n: gathered_scales(r, layout, g) if is_scales(r) else GatheredRegion(r, shards_of(r, layout), g)
            for n, r in regions.items()
        }

    def scattered(self, regions: dict, layout) -> dict:
        """Regions every rank restores its shard of from the one-rank layout's files."""
        if self.world == 1:
            return regions
        from .checkpoint import ScatteredRegion, is_scales, scattered_scales, shards_of

        return {
            n: scattered_scales(r, layout) if is_scales(r) else ScatteredRegion(r, shards_of(r, layout))
            for n, r in regions.items()
        }

    def read_unit(self, region, u: int, buf: torch.Tensor, layout) -> None:
        """Unit ``u`` of ``region`` whole into ``buf``: this rank's shard, the others' gathered."""
        if self.world == 1:
            region.read(u, buf).get()
            return
        own = layout.shard(u, buf)
        region.read(u, own).get()
        self.all_gather(buf[: layout.full.units[u].numel], own.clone())

    def step_record(self, rec, before: tuple[int, int]) -> dict:
        """What the per-step record says of the ranks: bytes sent and received, every rank's
        figures (nothing with one rank)."""
        if self.world == 1:
            return {}
        from .ranks import per_rank_figures

        t = self.traffic
        return {"ranks": self.world, "net_sent_bytes": t.sent - before[0], "net_received_bytes": t.received - before[1],
                "per_rank": per_rank_figures(self._ranks(), rec)}

    def check_space(self, needs: list[tuple[str, int]]) -> None:
        """Refuse now unless every filesystem can hold what it is asked (``needs``: this rank's
        ``(path, bytes)``): with ranks, the needs of every rank of this machine at once (they share
        its drives: each alone would fit where all do not), the error naming each rank's share."""
        import socket

        from ..io import check_space
        from ..io.errors import OutOfSpaceError, human_bytes
        from ..io.space import device_of

        if self.world == 1:
            check_space(needs)
            return
        host = socket.gethostname()
        mine = {r: ns for r, (h, ns) in enumerate(self.all_objects((host, needs))) if h == host}
        try:
            check_space([n for ns in mine.values() for n in ns])
        except OutOfSpaceError as exc:
            dev = device_of(exc.filename)  # (another rank may be removing its directories meanwhile)
            share = {r: sum(b for p, b in ns if device_of(p) == dev) for r, ns in mine.items()}
            err = OutOfSpaceError(exc.filename, exc.needed, exc.free, f"the {len(mine)} ranks of this machine share "
                                  "it: " + ", ".join(f"rank {r} {human_bytes(b)}" for r, b in share.items()))
            err.quiet = self.rank != min(mine)  # every rank here found the same: the first of them says it
            raise err from None

    def math_notes(self, cfg) -> list[str]:
        """How this group's sums differ from one process's, said at start: with clipping on, the
        clip's global norm over the ranks' shards (measured: tests/test_dist_train.py, weights
        1.2e-7 apart after 3 steps in which the clip acted)."""
        if self.world == 1 or cfg.optim.grad_clip <= 0:
            return []
        return [
            f"{self.world} ranks with optim.grad_clip = {cfg.optim.grad_clip}: the clip's global norm is the square "
            "root of the ranks' summed squares of their shards' norms, not clip_grad_norm_'s norm of per-parameter "
            "norms (a shard cuts parameters): equal up to float rounding, so in a step where the clip acts the "
            "weights differ from plain PyTorch's in the last bits (1e-7 measured); optim.grad_clip = 0 keeps them "
            "bit for bit"
        ]

    def rank_config(self, cfg):
        """``cfg`` as this rank runs it (``ranks.py``: its own scratch and run subdirectories)."""
        if self.world == 1:
            return cfg
        from .ranks import rank_config

        return rank_config(cfg, self._ranks())


class SoloGroup(_Sharding):
    """One process as a group of one: collectives return their input, no byte moves."""

    rank, world = 0, 1

    def __init__(self) -> None:
        self.traffic = Traffic()

    def __enter__(self) -> SoloGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def at_step(self, step: int) -> None:
        pass

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        if out.data_ptr() != shard.data_ptr():
            out.view(-1).copy_(shard.reshape(-1))

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        return full

    def sum_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def max(self, value: int) -> int:
        return value

    choice_note = ""  # one process: its choices are its own

    def rank0s(self, value: Any) -> Any:
        return value

    def all_objects(self, value: Any) -> list[Any]:
        return [value]

    def barrier(self) -> None:
        pass

    def check_same(self, what: str, value: Any) -> None:
        pass


class RankGroup(_Sharding):
    """One rank's handle on the run's process group (a context manager: leaving it destroys
    the group). ``backend``: 'gloo' (CPU tensors) or 'nccl' (CUDA tensors); ``init_method``:
    as ``torch.distributed.init_process_group`` (default: the ``MASTER_ADDR``/``MASTER_PORT``
    that ``torchrun`` sets)."""

    def __init__(self, rank: int, world: int, *, backend: str = "gloo", timeout_s: float = 300.0,
                 init_method: str | None = None) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of world {world}: need 0 <= rank < world")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s = {timeout_s}: a collective needs a positive timeout")
        self.rank, self.world, self.backend, self.timeout_s = rank, world, backend, timeout_s
        self.traffic = Traffic()
        try:
            dist.init_process_group(backend, rank=rank, world_size=world, init_method=init_method or "env://",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as exc:  # the store did not come up, or a rank never joined
            raise RankError(f"rank {rank} of {world}: the process group did not form within {timeout_s:.0f} s "
                            f"({_cause(exc)}); start every rank (torchrun --nproc-per-node {world})") from None
        # Parameter gathers run asynchronously, issued as their reads complete, in an order of
        # their own (the loads'); on the same group as the backward's reduce-scatters they
        # could meet another rank's reduce-scatter. A group of their own keeps each order apart.
        self._gathers = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        self.watch = Watch(_default_store(), rank, world)
        self.failed: RankError | None = None  # the first collective's failure: the group is broken

    def at_step(self, step: int) -> None:
        """The optimizer step this rank starts (told to the others at once, for naming a rank
        that stops)."""
        self.watch.at_step(step)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.watch.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives ------------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out`` = every rank's ``shard`` in rank order (``out.numel() == world x
        shard.numel()``). Sync point: returns when ``out`` is complete."""
        if out.numel() != self.world * shard.numel():
            raise ValueError(f"all_gather: out has {out.numel()} elements, {self.world} shards of "
                             f"{shard.numel()} need {self.world * shard.numel()}")
        if not out.is_contiguous():
            raise ValueError("all_gather: out must be contiguous (it is filled in place)")
        self._run("all_gather", _ALL_GATHER, out.view(-1), shard.reshape(-1).contiguous())
        b = shard.numel() * shard.element_size()
        self.traffic.add((self.world - 1) * b, (self.world - 1) * b)

    def start_all_gather(self, out: torch.Tensor, shard: torch.Tensor):
        """``all_gather`` started asynchronously on the parameter gathers' own group (their
        order is the loads' order, the same on every rank); wait with ``wait``. ``shard`` must
        not alias ``out``."""
        if out.numel() != self.world * shard.numel():
            raise ValueError(f"all_gather: out has {out.numel()} elements, {self.world} shards of "
                             f"{shard.numel()} need {self.world * shard.numel()}")
        self._intact("all_gather")
        p = self.watch.progress
        p.gathers, p.at = p.gathers + 1, "a parameter gather"
        try:
            work = _ALL_GATHER(out.view(-1), shard.reshape(-1), group=self._gathers, async_op=True)
        except (RuntimeError, ValueError) as exc:
            raise self._error("all_gather", exc) from None
        b = shard.numel() * shard.element_size()
        self.traffic.add((self.world - 1) * b, (self.world - 1) * b)
        return work

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's ``1/world`` of the sum of every rank's ``full``, added in rank order
        (the same bits as ``((g0 + g1) + g2) + ...`` on the rank's slice). Sync point."""
        n = full.numel()
        if n % self.world:
            raise ValueError(f"reduce_scatter: {n} elements do not split into {self.world} equal shards; "
                             f"pad to a multiple of {self.world}")
        parts = torch.empty_like(full.reshape(-1))
        self._run("reduce_scatter", dist.all_to_all_single, parts, full.reshape(-1).contiguous())
        parts = parts.view(self.world, n // self.world)
        out = parts[0].clone()
        for r in range(1, self.world):  # rank order: the grouping the exactness tests state
            out += parts[r]
        b = (n // self.world) * full.element_size()
        self.traffic.add((self.world - 1) * b, (self.world - 1) * b)
        return out

    def sum_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``t`` (a small tensor), added in rank order: the same bits
        on every rank. Sync point."""
        gathered = torch.empty((self.world, *t.shape), dtype=t.dtype, device=t.device)
        self.all_gather(gathered, t)
        out = gathered[0].clone()
        for r in range(1, self.world):
            out += gathered[r]
        return out

    def max(self, value: int) -> int:
        """The largest of every rank's ``value`` (a stop flag: any rank stopping stops all)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._run("max", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return int(t.item())

    choice_note = " (rank 0's choice, taken by every rank)"  # said after a choice ``rank0s`` agreed on

    def rank0s(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank: a choice each rank made from its own measurements,
        taken from one so that all run the same. Sync point."""
        box = [value]
        self._run("broadcast", dist.broadcast_object_list, box, src=0)
        return box[0]

    def wait(self, work, name: str) -> None:
        """Wait for an asynchronous collective (``async_op=True``) under the group's timeout."""
        self._run(name, lambda: work.wait(timeout=datetime.timedelta(seconds=self.timeout_s)), started=True)

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)

    def all_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank. Sync point."""
        values: list[Any] = [None] * self.world
        self._run("all_gather_object", dist.all_gather_object, values, value)
        return values

    def check_same(self, what: str, value: Any) -> None:
        """Refuse a run whose ranks disagree on ``value`` (the model, the data, the config that
        must match), naming the ranks that differ from rank 0."""
        values: list[Any] = [None] * self.world
        self._run("check_same", dist.all_gather_object, values, pickle.dumps(value))
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            mine = pickle.loads(values[self.rank])
            raise RankError(f"{what} differs between ranks: rank 0 has {pickle.loads(values[0])!r}, rank(s) "
                            f"{', '.join(map(str, differ))} another (this rank, {self.rank}: {mine!r}); "
                            "start every rank with the same config")

    def _intact(self, name: str) -> None:
        """Refuse a collective once one has failed: its peers may be gone or elsewhere, and it
        would wait out the whole timeout again."""
        if self.failed is not None:
            raise BrokenGroupError(f"rank {self.rank} of {self.world}: {name} not run: an earlier collective "
                                   f"failed ({self.failed})")

    def _run(self, name: str, fn, *args, started: bool = False, **kw) -> None:
        """``fn`` (a collective, or the wait for one already ``started``), its failure a RankError."""
        name = _WORDS.get(name, name)  # (messages said "max failed", "after max")
        self._intact(name)
        if not started:
            p = self.watch.progress
            p.ops, p.at = p.ops + 1, name
        try:
            fn(*args, **kw)
        except (RuntimeError, ValueError) as exc:
            if isinstance(exc, RankError):
                raise
            raise self._error(name, exc) from None

    def _error(self, name: str, exc: BaseException) -> RankError:
        """The failure of collective ``name`` in words, the ranks that stopped named; the group is
        broken from now on."""
        who = self.watch.culprits()
        self.failed = RankError(f"rank {self.rank} of {self.world}: {name} failed ({_cause(exc)}): another rank "
                                f"died, hangs past the {self.timeout_s:.0f} s timeout, or called another collective"
                                + (f": {who}" if who else ""))  # what to resume from: the command line's hint
        return self.failed


# the collectives as messages name them
_WORDS = {
    "all_gather": "the gather of a unit's parameters (all_gather)",
    "reduce_scatter": "the sum of a unit's gradients (reduce_scatter)",
    "max": "the ranks' agreement at a step's end (max)",
    "broadcast": "taking rank 0's choice (broadcast)",
    "barrier": "the wait for every rank (barrier)",
    "all_gather_object": "the exchange of every rank's figures (all_gather_object)",
    "check_same": "the check that every rank has the same config (check_same)",
}


def _default_store():
    """The store the process group formed over (for the ranks' signs of life), or None where
    this torch has no such accessor."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


# torch 2.13 renames all_gather_into_tensor (deprecated there); torch 2.11 has only the old name
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _cause(exc: BaseException) -> str:
    """What a collective's failure says, without gloo's source location and advice: "[.../pair.cc:553]
    Connection closed by peer [127.0.0.1]:8103. This is typically caused by ..." says "Connection
    closed by peer [127.0.0.1]:8103"."""
    text = re.sub(r"^\[[^\]\s]+:\d+\]\s*", "", _first_line(exc))
    return text.split(". ")[0].rstrip(".") or type(exc).__name__


Group = SoloGroup | RankGroup
