"""Ranks over torch.distributed (gloo on loopback, 2 and 3 processes): the collectives
sharded training uses, their exactness (sums in rank order, the same bits on every rank),
their byte counts against the formula, a dead rank, ranks that disagree; and the data each
rank draws."""

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from reference import small_config

from tiertrain.data import Corpus
from tiertrain.dist import RankError, RankGroup, env_world

SIZES = [1, 7, 4099]  # elements per shard: tiny, odd, unaligned


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grads_of(rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s gradient: values whose sum depends on the order it is taken in."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 6, (n,), generator=g)


def _collectives(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with RankGroup(rank, world, timeout_s=60) as g:
        res = {}
        for s in SIZES:
            full = torch.empty(world * s)
            g.all_gather(full, torch.arange(s, dtype=torch.float32) + 1000 * rank)
            res[f"gather{s}"] = full
            res[f"rs{s}"] = g.reduce_scatter(grads_of(rank, world * s))
        res["norm"] = g.sum_in_rank_order(grads_of(rank, 5).square().sum().reshape(1))
        res["max"] = torch.tensor([g.max(rank * 3)])
        res["sent"], res["received"] = torch.tensor([g.traffic.sent]), torch.tensor([g.traffic.received])
        try:
            g.reduce_scatter(torch.ones(world * 3 + 1))  # checked before anything is sent
            res["uneven"] = "no error"
        except ValueError as exc:
            res["uneven"] = str(exc)
        torch.save(res, os.path.join(out_dir, f"{rank}.pt"))


# Ranks start from a fork server that imported torch and tiertrain once (per test worker):
# a fresh interpreter per rank spent seconds of CPU importing them, most of what a small rank
# test costs. The ranks run the same code; `tiertrain train --nproc` (its own launcher, fresh
# interpreters) is tested through the command.
_PRELOAD = ["torch", "tiertrain.training.trainer", "tiertrain.dist.group", "reference", "test_dist_group"]


def _with_env(rank, env, fn, *args):
    """In the rank: the environment the test had when it started the ranks (the fork server
    keeps the one it started with), then ``fn``."""
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def spawn(fn, world, tmp_path, *args):
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    args = (dict(os.environ), fn, world, free_port(), str(tmp_path), *args)
    mp.start_processes(_with_env, args=args, nprocs=world, join=True, start_method="forkserver")
    return [torch.load(tmp_path / f"{r}.pt") for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_are_exact_in_rank_order_and_count_their_bytes(tmp_path, world):
    out = spawn(_collectives, world, tmp_path)
    for s in SIZES:
        want = torch.cat([torch.arange(s, dtype=torch.float32) + 1000 * r for r in range(world)])
        parts = [grads_of(r, world * s) for r in range(world)]
        total = parts[0].clone()
        for p in parts[1:]:
            total += p  # the reference: plain PyTorch, in rank order
        for r in range(world):
            assert torch.equal(out[r][f"gather{s}"], want)
            assert torch.equal(out[r][f"rs{s}"], total[r * s : (r + 1) * s])  # bit-identical
    norms = [grads_of(r, 5).square().sum() for r in range(world)]
    ref = norms[0].clone()
    for n in norms[1:]:
        ref += n
    for r in range(world):
        assert torch.equal(out[r]["norm"], ref.reshape(1))  # the same bits on every rank
        assert out[r]["max"].item() == 3 * (world - 1)
        # the formula: gathers (N-1) shards each way, reduce-scatter (N-1)/N of its input
        # each way, and the norm's gather of one float32
        per = sum(4 * s * (world - 1) * 2 for s in SIZES) + 4 * (world - 1)
        assert out[r]["sent"].item() == out[r]["received"].item() == per
        assert f"{world * 3 + 1} elements do not split into {world} equal shards" in out[r]["uneven"]


def test_reduce_scatter_in_rank_order_differs_from_another_order():
    """The test above can fail: for these gradients another grouping gives other bits."""
    a, b, c = (grads_of(r, 3 * 4099) for r in range(3))
    assert not torch.equal((a + b) + c, a + (b + c))


def _dead_rank(rank, world, port, out_dir, how):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    g = RankGroup(rank, world, timeout_s=5)
    if rank == 1:
        if how == "hangs":
            time.sleep(12)  # alive, but never joins the collective (past the 5 s timeout)
        os._exit(0)  # dies without a word, as kill -9 would leave it
    t0 = time.perf_counter()
    try:
        g.reduce_scatter(torch.ones(4 * world))
        msg = "no error"
    except RankError as exc:
        msg = str(exc)
    torch.save({"msg": msg, "s": time.perf_counter() - t0}, os.path.join(out_dir, f"{rank}.pt"))
    os._exit(0)  # the group cannot be torn down cleanly with a peer gone


@pytest.mark.serial  # bounds in seconds: measured alone
@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_dead_or_hung_rank_stops_the_others_within_the_timeout(tmp_path, how):
    """Timeout 5 s: a dead peer is seen at once (its connection closes), a hung one when the
    timeout runs out; either way the others raise a RankError naming it, never wait for ever."""
    ctx = mp.spawn(_dead_rank, args=(2, free_port(), str(tmp_path), how), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5) and time.monotonic() < deadline:
        pass
    res = torch.load(tmp_path / "0.pt")
    assert (
        "rank 0 of 2: the sum of a unit's gradients (reduce_scatter) failed (" in res["msg"]
        and "another rank died" in res["msg"]
    ), res["msg"]
    named = (
        "rank 1 died: no sign of life for 2 s (last seen at step 0, after start)"
        if how == "dies"
        else "rank 1 is alive but has not reached this collective: it is at step 0, after start (0 collectives"
    )
    assert named in res["msg"], res["msg"]
    assert res["s"] < (7 if how == "dies" else 13), res["s"]  # + 2 s to tell which rank stopped


def _disagree(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with RankGroup(rank, world, timeout_s=60) as g:
        try:
            g.check_same("model", {"n_layers": 4 if rank < 2 else 6})
            msg = "no error"
        except RankError as exc:
            msg = str(exc)
        chosen = g.rank0s(("overlap", f"rank {rank} measured"))  # a choice made on every rank: rank 0's
        torch.save({"msg": msg, "chosen": chosen}, os.path.join(out_dir, f"{rank}.pt"))


@pytest.mark.slow
def test_ranks_that_disagree_are_refused_by_name(tmp_path):
    out = spawn(_disagree, 3, tmp_path)
    for r in range(3):
        assert "model differs between ranks: rank 0 has {'n_layers': 4}, rank(s) 2 another" in out[r]["msg"]
        assert out[r]["chosen"] == ("overlap", "rank 0 measured")


def test_rank_world_and_timeout_are_checked():
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        RankGroup(2, 2)
    with pytest.raises(ValueError, match="timeout_s = 0"):
        RankGroup(0, 1, timeout_s=0)


def test_env_world(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert env_world() == (0, 1, 0)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert env_world() == (3, 4, 1)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(RankError, match="RANK=4 is outside WORLD_SIZE=4"):
        env_world()


@pytest.mark.parametrize("world,m", [(2, 2), (3, 1), (4, 3)])
def test_n_ranks_of_m_micro_batches_see_one_rank_of_n_times_m(tmp_path, world, m):
    one = small_config(tmp_path, micro_batches=world * m)
    many = small_config(tmp_path, micro_batches=m)
    whole, part = Corpus(one.data), Corpus(many.data)
    for step in (0, 5):
        ref = whole.batches(step)
        got = [b for r in range(world) for b in part.batches(step, rank=r, world=world)]
        assert len(got) == len(ref) == world * m
        for (x, y), (rx, ry) in zip(got, ref):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    assert not torch.equal(part.batches(0, rank=0, world=world)[0][0], part.batches(0, rank=1, world=world)[0][0])
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        part.batches(0, rank=2, world=2)
