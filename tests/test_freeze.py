"""Frozen units (``train.freeze``): the same losses and weights as plain PyTorch with
``requires_grad=False`` on the frozen units' parameters and AdamW over the rest, bit for bit
in fp32; frozen parameters never change and never form a gradient; bad selectors named."""

from __future__ import annotations

import pytest
import torch
from reference import reference_model, reference_train, small_config, weights_of
from test_parity import assert_parity, assert_same_weights, run_tiertrain

from tiertrain.config import ConfigError, load_config


@pytest.mark.parametrize(
    "kind,freeze,mode,micro_batches,tie",
    [
        ("gpt", ["embed", "blocks:0"], "baseline", 2, False),
        ("gpt", ["blocks:1-2", "head"], "overlap", 1, False),
        ("gpt", ["embed", "head"], "baseline", 2, True),
        ("llama", ["embed", "blocks:1"], "overlap", 2, False),
        ("gpt2", ["blocks"], "baseline", 1, True),
        ("gpt", ["embed", "blocks:1"], "engines", 2, False),
        ("llama", ["blocks:0", "head"], "engines", 1, False),
    ],
)
def test_frozen_units_train_as_plain_pytorch_with_requires_grad_false(tmp_path, kind, freeze, mode, micro_batches, tie):
    cfg = small_config(tmp_path, kind=kind, micro_batches=micro_batches, tie=tie, steps=3, clip=0.05)
    cfg.train.freeze = freeze
    cfg.update.mode = mode
    ref_model = reference_model(cfg)
    init = weights_of(ref_model)
    ref_losses, ref_weights = reference_train(cfg, ref_model)
    losses, weights, tr = run_tiertrain(cfg, init)
    assert losses == ref_losses
    assert_same_weights(tr, weights, ref_weights)
    frozen = {n for u in tr.rt.frozen for n, _ in _owned(tr)[u]}
    assert frozen and all(torch.equal(weights[n], _initial(tr, init, n)) for n in frozen)  # never written
    trained = set(weights) - frozen
    assert trained and any(not torch.equal(weights[n], _initial(tr, init, n)) for n in trained)


def _owned(tr):
    from tiertrain.models import unit_param_names

    return unit_param_names(tr.model)


def _initial(tr, init, name):
    from test_parity import ref_name_map

    return init[ref_name_map(tr, [name])[name]].float()


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_offloaded_activations_behind_a_frozen_first_block_are_plain_pytorch(tmp_path, kind):
    """The offload record was sized on the first block of each structure, here frozen: it saves
    nothing for its weights' gradients, the trained blocks after it more, and the first step
    stopped ("saves more than the ... bytes planned per record"). Frozen and trained blocks are
    measured apart."""
    cfg = small_config(tmp_path, kind=kind, micro_batches=2, steps=3, activations="offload")
    cfg.train.freeze = ["blocks:0"]
    tr, _ = assert_parity(cfg)
    assert tr.acts.offloaded > 0


@pytest.mark.slow
def test_engines_updating_each_unit_as_it_arrives_skip_the_frozen_ones(tmp_path):
    """update.eager with the engines (no clip): each engine's step report waits for the trained
    units only (it waited for every unit, frozen ones included, and never came)."""
    cfg = small_config(tmp_path, layers=3, micro_batches=2, steps=3, clip=0.0)
    cfg.train.freeze = ["blocks:0-1"]
    cfg.update.mode, cfg.update.eager = "engines", True
    assert_parity(cfg)


def test_the_clip_norm_is_over_the_trained_parameters_only(tmp_path):
    """A clip that acts every step (norm over the trained parameters, as clip_grad_norm_ over
    the optimizer's parameters): a frozen unit's gradient would change every update."""
    cfg = small_config(tmp_path, layers=2, micro_batches=2, steps=3, clip=1e-3)
    cfg.train.freeze = ["blocks:0"]
    assert_parity(cfg)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--train.freeze=embedding"], "'embedding' is not a unit selector"),
        (["--train.freeze=blocks:3-1"], "is an empty range"),
        (["--train.freeze=head:0"], "'head:0' is not a unit selector"),
    ],
)
def test_bad_selectors_and_combinations_are_named(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, flags)


@pytest.mark.parametrize(
    "freeze,tie,message",
    [
        (["blocks:9"], False, r"names block 9, but the model has 3 blocks \(0 to 2\)"),
        (["embed"], True, "share their weight"),
        (["embed", "blocks", "head"], False, "every unit is frozen"),
    ],
)
def test_what_the_model_cannot_freeze_is_named(tmp_path, freeze, tie, message):
    from tiertrain.runtime import Runtime

    cfg = small_config(tmp_path, tie=tie)
    cfg.train.freeze = freeze
    with pytest.raises(ConfigError, match=message):
        Runtime(cfg)


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
def test_a_run_with_frozen_units_resumes_bit_for_bit(tmp_path, mode):
    from reference import assert_resume_exact

    cfgs = []
    for name in ("straight", "split"):
        cfg = small_config(tmp_path / name, layers=2, micro_batches=2, clip=0.05)
        cfg.train.freeze, cfg.update.mode = ["embed", "blocks:1"], mode
        cfgs.append(cfg)
    assert_resume_exact(*cfgs)


@pytest.mark.slow
def test_the_command_trains_with_frozen_units_and_says_so(tmp_path):
    """tiertrain train --train.freeze=...: the plan line names the frozen units and their
    parameters; the run ends as any other."""
    import subprocess
    import sys

    from reference import tiny_flags

    r = subprocess.run(
        [sys.executable, "-m", "tiertrain", "train", *tiny_flags(tmp_path, "--train.freeze=embed,blocks:0")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "frozen (train.freeze = embed, blocks:0): 2 of 4 units" in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode,eager", [("baseline", False), ("overlap", True)])
def test_ranks_with_frozen_units_train_the_grouped_reference_bit_for_bit(tmp_path, mode, eager):
    """2 ranks, each updating its shard of the trained units only (the overlapped path as each
    unit's gradient arrives), against plain PyTorch's grouped sum with the same units frozen."""
    from test_dist_train import _Named, run_ranks

    cfg = small_config(tmp_path, kind="llama", layers=2, d=64, micro_batches=2, steps=3, clip=0.0)
    cfg.update.mode, cfg.update.eager = mode, eager
    cfg.train.freeze = ["embed", "blocks:0"]
    ref_model, out = run_ranks(tmp_path, cfg, 2)
    ref_losses, ref_weights = reference_train(cfg, ref_model, ranks=2)
    for step, want in enumerate(ref_losses):
        assert [x for r in range(2) for x in out[r]["losses"][step]] == want
    assert_same_weights(_Named(cfg), out[0]["weights"], ref_weights)


def test_the_start_names_what_the_embedding_and_the_head_freeze(tmp_path, caplog):
    """Found from outside: 'head' froze the final norm with lm_head (the head's unit), where a
    user freezing lm_head alone expected the norm trained, and nothing said so: the start line
    names the parameters 'embed' and 'head' freeze."""
    import logging

    from tiertrain.training.trainer import Trainer

    cfg = small_config(tmp_path, kind="llama", layers=2)
    cfg.train.freeze = ["head", "blocks:0"]
    caplog.set_level(logging.INFO, logger="tiertrain")
    with Trainer(cfg):
        pass
    line = next(r.message for r in caplog.records if r.message.startswith("frozen (train.freeze"))
    assert line.endswith("read, never trained or written; head: head.norm.weight, head.lm_head.weight"), line
