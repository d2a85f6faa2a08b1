"""Sharded data-parallel training (gloo on loopback, 2 and 3 processes): N ranks of M
micro-batches train the model of a plain PyTorch run that sums the same gradients in the
same grouping (each rank's micro-batches, then the ranks in rank order), bit for bit in
fp32; the states each rank holds are its 1/N."""

import os

import pytest
import torch

from reference import reference_model, small_config, weights_of
from test_dist_group import spawn
from test_parity import assert_same_weights
from tiertrain.config import Config
from tiertrain.dist import RankGroup
from tiertrain.models import build_model, tensor_source
from tiertrain.reference import reference_train
from tiertrain.train import Trainer


def _train(rank, world, port, out_dir, tree, init_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = Config.from_dict(tree)
    init = torch.load(init_path)
    skeleton, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    with RankGroup(rank, world, timeout_s=120) as g:
        with Trainer(cfg, weights=tensor_source(skeleton, init), group=g) as tr:
            tr.initialize(progress=False)
            recs = [tr.train_step() for _ in range(cfg.train.steps)]
            weights = tr.weights()  # every rank gathers
            files = {n: os.path.getsize(os.path.join(tr.cfg.io.paths[0], n)) for n, size in tr.plan.files if size}
            res = dict(losses=[r.extra["losses"] for r in recs], loss=[r.loss for r in recs],
                       norm=[r.grad_norm for r in recs], weights=weights if rank == 0 else None, files=files,
                       state=tr.rt.state_layout.total_numel, full=tr.layout.total_numel,
                       paths=tr.cfg.io.paths)
    torch.save(res, os.path.join(out_dir, f"{rank}.pt"))


def run_ranks(tmp_path, cfg, world):
    ref_model = reference_model(cfg)
    init = tmp_path / "init.pt"
    torch.save(weights_of(ref_model), init)
    out = tmp_path / "out"
    out.mkdir()
    return ref_model, spawn(_train, world, out, cfg.to_dict(), str(init))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_train_the_grouped_reference_bit_for_bit(tmp_path, world):
    cfg = small_config(tmp_path, kind="llama", layers=2, d=64, micro_batches=2, steps=3, clip=0.0)
    ref_model, out = run_ranks(tmp_path, cfg, world)
    ref_losses, ref_weights = reference_train(cfg, ref_model, ranks=world)
    for step, want in enumerate(ref_losses):  # every rank's micro-batch losses, in rank order
        assert [x for r in range(world) for x in out[r]["losses"][step]] == want
        assert all(o["loss"][step] == out[0]["loss"][step] for o in out)  # the same mean on every rank
    assert_same_weights(_Named(cfg), out[0]["weights"], ref_weights)
    for r, o in enumerate(out):  # each rank holds 1/N of every state, in its own directory
        assert o["state"] * world == o["full"]
        assert o["paths"] == [os.path.join(cfg.io.paths[0], f"rank{r}")]
        assert o["files"]["exp_avg.bin"] >= 4 * o["state"] and o["files"]["exp_avg.bin"] < 4 * o["full"] / world + (1 << 20)


class _Named:
    """What ``assert_same_weights`` reads of a trainer: its model's naming and config."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.model, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
