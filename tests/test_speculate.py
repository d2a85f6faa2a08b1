"""The speculative update (``update.speculate``): each unit updated under the backward as if
the clip will not act, into the other half of its states; kept, or redone from the current
half with the clip. Bit-identical to plain PyTorch AdamW + ``clip_grad_norm_`` either way."""

import dataclasses
import os
import re
import signal

import pytest
import torch
from reference import assert_resume_exact, reference_model, small_config, weights_of
from test_parity import assert_parity

from tiertrain.config import ConfigError, load_config
from tiertrain.models import build_model, tensor_source
from tiertrain.state.double import DoubleRegions
from tiertrain.training.trainer import Trainer
from tiertrain.update.speculate import MIN_STEPS, Speculation

CLIP_ACTS, CLIP_NEVER = 1e-3, 1e3  # the small model's norms are ~0.5-3


# the streamed paths (an update thread, or the trainer's thread) and the update engines (worker
# processes next to the storage)
MODES = ["overlap", "baseline", "engines"]
STREAMED = ["overlap", "baseline"]


def spec_config(tmp_path, *, speculate="on", mode="overlap", **kw):
    cfg = small_config(tmp_path, **kw)
    cfg.update.mode = mode
    cfg.update.speculate = speculate
    return cfg


def _norms(cfg) -> list[float]:
    """The steps' gradient norms from the weights ``assert_parity`` starts from."""
    skeleton, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    init = tensor_source(skeleton, weights_of(reference_model(cfg)))
    with Trainer(dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, speculate="off")), weights=init) as tr:
        tr.initialize(progress=False)
        return [tr.train_step().grad_norm for _ in range(cfg.train.steps)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("clip", [CLIP_ACTS, CLIP_NEVER], ids=["clip-acts", "clip-never-acts"])
def test_speculation_is_bit_identical_to_plain_pytorch(tmp_path, kind, clip, mode):
    tr, losses = assert_parity(spec_config(tmp_path, kind=kind, clip=clip, micro_batches=2, steps=4, mode=mode))
    held = 4 if clip == CLIP_NEVER else 0
    assert tr.update.spec.summary() == f"speculation held in {held} of 4 steps"
    assert losses[-1] != losses[0]


@pytest.mark.parametrize("mode", MODES)
def test_steps_kept_and_redone_in_one_run_with_states_partly_in_memory(tmp_path, mode):
    """The clip set between the steps' norms: some steps kept, some redone, in one run; host-
    resident parameters (held twice: copied, not updated in place) and moments."""
    kw = dict(
        micro_batches=2, steps=6, host_param_mib=1, grad_host_mib=1, optim_host_mib=1, paths=2, update_kib=256, slots=2
    )
    norms = sorted(_norms(spec_config(tmp_path / "probe", clip=CLIP_NEVER, **kw)))
    clip = (norms[2] + norms[3]) / 2
    cfg = spec_config(tmp_path / "run", clip=clip, mode=mode, **kw)
    tr, _ = assert_parity(cfg)
    spec = tr.update.spec
    assert spec.steps == 6 and 0 < spec.held < 6, spec.summary()


@pytest.mark.parametrize("mode", MODES)
def test_bf16_parameters_with_master_weights_match_the_path_not_speculating(tmp_path, mode):
    """Lower-precision parameters (the clip applied to the fp32 copy of the gradient): the
    same losses and weights as the same path without speculation, bit for bit."""
    out = {}
    for speculate in ("off", "on"):
        for clip in (CLIP_ACTS, CLIP_NEVER):
            cfg = spec_config(
                tmp_path / f"{speculate}{clip}", speculate=speculate, clip=clip, dtype="bfloat16", steps=3, mode=mode
            )
            with Trainer(cfg) as tr:
                tr.initialize(progress=False)
                losses = [tr.train_step().extra["losses"] for _ in range(3)]
                out[speculate, clip] = losses, tr.weights()
    for clip in (CLIP_ACTS, CLIP_NEVER):
        (la, wa), (lb, wb) = out["off", clip], out["on", clip]
        assert la == lb and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ["tied-embedding-in-vocab-pieces", "frozen-units"])
def test_a_tied_embedding_cut_in_pieces_and_frozen_units_match_the_path_not_speculating(tmp_path, mode, shape):
    """Units whose gradients come home out of order (the tied embedding's after the head's,
    vocabulary pieces) or never (frozen units): the same losses and weights, bit for bit."""
    out = {}
    for speculate in ("off", "on"):
        for clip in (CLIP_ACTS, CLIP_NEVER):
            cfg = spec_config(
                tmp_path / f"{speculate}{clip}",
                speculate=speculate,
                clip=clip,
                micro_batches=2,
                steps=3,
                mode=mode,
                tie=shape.startswith("tied"),
            )
            if shape.startswith("tied"):
                cfg.model.vocab_pieces = 3
            else:
                cfg.train.freeze = ["embed", "blocks:0"]
            with Trainer(cfg) as tr:
                tr.initialize(progress=False)
                out[speculate, clip] = [tr.train_step().extra["losses"] for _ in range(3)], tr.weights()
                if speculate == "on":
                    assert tr.update.spec.held == (3 if clip == CLIP_NEVER else 0)
                if shape == "frozen-units":
                    assert any(u.frozen for u in tr.update.layout.units)
    for clip in (CLIP_ACTS, CLIP_NEVER):
        (la, wa), (lb, wb) = out["off", clip], out["on", clip]
        assert la == lb and all(torch.equal(wa[k], wb[k]) for k in wa)


def _step_bytes(cfg, steps=4):
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        before = tr.storage.stats()
        recs = [tr.train_step() for _ in range(steps)]
        tr.update.wait_all()
        after = tr.storage.stats()
        handed = sum(r.extra.get("handoff_bytes", 0) for r in recs) + tr.update.record().get("handoff_bytes", 0)
        read = sum(after[k].read_bytes - before[k].read_bytes for k in after)
        written = sum(after[k].write_bytes - before[k].write_bytes for k in after)
        return read + handed, written, tr.update


@pytest.mark.parametrize("mode", STREAMED)
def test_a_kept_step_moves_the_paths_bytes_and_a_redone_one_one_update_more(tmp_path, mode):
    """Per step, loads read or handed over and bytes written: a kept speculative step's equal
    the same path's not speculating (the halves flip, no bytes move); a redone one adds one
    update's reads (moments, parameters, gradients) and writes (moments, parameters)."""
    got = {}
    for speculate in ("off", "on"):
        for clip in (CLIP_ACTS, CLIP_NEVER):
            got[speculate, clip] = _step_bytes(
                spec_config(tmp_path / f"{speculate}{clip}", speculate=speculate, clip=clip, mode=mode)
            )
    assert got["on", CLIP_NEVER][:2] == got["off", CLIP_NEVER][:2]
    (r_off, w_off, _), (r_on, w_on, upd) = got["off", CLIP_ACTS], got["on", CLIP_ACTS]
    n = sum(u.numel for u in upd.optim.trainable)  # fp32: 4 bytes an element
    assert upd.redone == 4
    # the overlapped path drains every unit's speculation before redoing; the baseline path has
    # not started the backward's last unit (the embedding)
    wasted = 4 * n if mode == "overlap" else upd.wasted_numel
    assert 2 * n < wasted <= 4 * n
    assert (r_on - r_off, w_on - w_off) == (4 * 4 * wasted, 3 * 4 * wasted)


def test_engines_a_kept_step_skips_the_gradients_read_back_and_a_redone_one_adds_one_update(tmp_path):
    """The engines' bytes on their storage, per step after the first (fp32 AdamW, every state
    on disk, n trained elements): not speculating, the gradient is written and read back and
    the moments and parameters read and written (16n read, 16n written); a kept speculative
    step updates from the gradient's shared slot, so it reads no gradient back (12n read) but
    writes it all the same, kept for a redo; a redone step adds one update from the file
    (12n more each way)."""

    def per_step(cfg, steps=4):
        with Trainer(cfg) as tr:
            tr.initialize(progress=False)
            kept = [tr.train_step().extra.get("speculation_kept") for _ in range(steps)]
            upd = tr.update
            files = {f.name for d in tr.plan.states for f in d.files}
            held_twice = {f"engine{i}.{k}.spec.bin" for i in range(2) for k in ("params", "exp_avg", "exp_avg_sq")}
            assert (held_twice <= files) == (cfg.update.speculate == "on") and not any("grads.spec" in f for f in files)
            upd.wait_all()
            reports = upd.stepped[upd.n :]  # the first step's report carries the initial weights' writes
            n = sum(u.numel for u in upd.layout.units if not u.frozen)
            return sum(r.read for r in reports) // (steps - 1), sum(r.written for r in reports) // (steps - 1), n, kept

    got = {}
    for speculate in ("off", "on"):
        for clip in (CLIP_ACTS, CLIP_NEVER):
            cfg = spec_config(tmp_path / f"{speculate}{clip}", speculate=speculate, clip=clip, mode="engines", paths=2)
            got[speculate, clip] = per_step(cfg)
    n = got["off", CLIP_ACTS][2]
    assert got["off", CLIP_ACTS][:2] == got["off", CLIP_NEVER][:2] == (16 * n, 16 * n)
    assert got["on", CLIP_NEVER][:2] == (12 * n, 16 * n) and got["on", CLIP_NEVER][3] == [True] * 4
    assert got["on", CLIP_ACTS][:2] == (28 * n, 28 * n) and got["on", CLIP_ACTS][3] == [False] * 4


def test_engines_with_top_k_and_error_feedback_match_the_engines_not_speculating(tmp_path):
    """Top-k gradients (decoded by the engine, kept for a redo as decoded) and the residual the
    trainer keeps: speculating changes none of the bits, kept or redone."""
    out = {}
    for speculate in ("off", "on"):
        for clip in (CLIP_ACTS, CLIP_NEVER):
            cfg = spec_config(tmp_path / f"{speculate}{clip}", speculate=speculate, clip=clip, mode="engines", steps=3)
            cfg.update.topk, cfg.update.error_feedback = 0.1, True
            with Trainer(cfg) as tr:
                tr.initialize(progress=False)
                out[speculate, clip] = [tr.train_step().extra["losses"] for _ in range(3)], tr.weights()
    for clip in (CLIP_ACTS, CLIP_NEVER):
        (la, wa), (lb, wb) = out["off", clip], out["on", clip]
        assert la == lb and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert out["on", CLIP_ACTS][0] != out["on", CLIP_NEVER][0]  # the clip acted: another run


def test_the_states_are_held_twice_and_the_plan_says_so(tmp_path):
    cfg = spec_config(tmp_path, optim_host_mib=1)
    with Trainer(cfg) as tr:
        names = {f.name for d in tr.plan.states for f in d.files}
        assert {"exp_avg.spec.bin", "exp_avg_sq.spec.bin", "params.spec.bin"} <= names
        assert "grads.spec.bin" not in names  # gradients are written once a step, never redone over
        regions = tr.update.optim.regions()
        assert all(isinstance(r, DoubleRegions) for r in regions.values())
        # one MiB for both halves of the moments: each half holds what fits in half of its share
        m = regions["exp_avg"]
        assert m.halves[0].host_bytes == m.halves[1].host_bytes <= (1 << 20) // 2 // 2
        assert "exp_avg.spec.bin" in tr.plan.describe()


@pytest.mark.parametrize("mode", MODES)
def test_resume_from_a_checkpoint_of_a_speculative_run_is_exact(tmp_path, mode):
    """And the checkpoint holds the committed state: resumed without speculation, the run goes
    on to the same bits."""
    kw = dict(micro_batches=2, steps=4, mode=mode)
    straight = spec_config(tmp_path / "a", clip=CLIP_ACTS, **kw)
    assert_resume_exact(straight, spec_config(tmp_path / "b", clip=CLIP_ACTS, **kw))
    off = spec_config(tmp_path / "c", speculate="off", clip=CLIP_NEVER, **kw)
    on = spec_config(tmp_path / "d", clip=CLIP_NEVER, **kw)
    with Trainer(on) as tr:
        tr.initialize(progress=False)
        [tr.train_step() for _ in range(2)]
        saved = tr.save_checkpoint()
    with Trainer(off) as tr:
        tr.restore(saved.path)
        tr.train_step()
        got = tr.weights()
    with Trainer(dataclasses.replace(off, train=dataclasses.replace(off.train, run_dir=str(tmp_path / "e")))) as tr:
        tr.initialize(progress=False)
        [tr.train_step() for _ in range(3)]
        want = tr.weights()
    assert all(torch.equal(got[k], want[k]) for k in want)


KILL_FLAGS = ["--update.mode=overlap", "--optim.grad_clip=0.001"]


@pytest.fixture(scope="module")
def never_speculating(tmp_path_factory):
    """The final checkpoint of the kill tests' run, uninterrupted, without speculation."""
    from test_checkpoint import cli, final_state

    tmp = tmp_path_factory.mktemp("plain")
    r = cli(tmp, *KILL_FLAGS)
    assert r.returncode == 0, r.stderr[-2000:]
    return final_state(tmp)


@pytest.mark.slow
@pytest.mark.parametrize(
    "point, from_checkpoint, mode",
    [("update:5", False, "overlap"), ("update:80", True, "overlap"), ("update:80", True, "baseline")],
)
def test_sigkill_in_a_speculative_step_then_resume_loses_nothing(
    tmp_path, never_speculating, point, from_checkpoint, mode
):
    """Killed while a step's speculative update runs under its backward, the clip acting in
    every step (each step: ~19 chunks speculated, then ~19 redone): update:5 in step 1, before
    any checkpoint; update:80 in step 3, after the step-2 checkpoint. Resumed (or started
    again): the same bytes in every checkpointed file as a run never interrupted and never
    speculating."""
    from test_checkpoint import cli, final_state

    flags = [*KILL_FLAGS, f"--update.mode={mode}"]
    r = cli(tmp_path / "spec", *flags, "--update.speculate=on", env={"TIERTRAIN_KILL_AT": point})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    ckpts = tmp_path / "spec" / "run" / "checkpoints"
    assert (ckpts.exists() and bool(os.listdir(ckpts))) == from_checkpoint
    again = [f"--resume={tmp_path / 'spec' / 'run'}"] if from_checkpoint else ["--train.overwrite=true"]
    resumed = cli(tmp_path / "spec", *flags, "--update.speculate=on", *again)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert final_state(tmp_path / "spec") == never_speculating
    assert f"speculation held in 0 of {2 if from_checkpoint else 4} steps" in resumed.stderr


@pytest.mark.slow
@pytest.mark.parametrize("point, killed", [("backward:15", "trainer"), ("update:80", "engine")])
def test_sigkill_of_the_trainer_or_an_engine_in_a_speculative_step_then_resume_loses_nothing(
    tmp_path, never_speculating, point, killed
):
    """The update engines speculating, the clip acting in every step: the trainer killed in step
    3's backward (its engines updating the units it has sent into their other halves; they exit
    with it), or an engine killed in the middle of its updates of step 3 (the trainer names it
    and stops). Resumed from the step-2 checkpoint: the same bytes in every checkpointed file as
    a run on the overlapped path never interrupted and never speculating."""
    from test_checkpoint import cli, final_state

    # nothing measured before training (no backward of the planner's timings among the points)
    flags = [*KILL_FLAGS, "--update.mode=engines", "--update.speculate=on", "--train.predict=false"]
    r = cli(tmp_path, *flags, env={"TIERTRAIN_KILL_AT": point})
    if killed == "trainer":
        assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    else:
        assert r.returncode != 0 and re.search(r"update engine \d .* died \(exit code -9\)", r.stderr), r.stderr[-2000:]
    assert os.listdir(tmp_path / "run" / "checkpoints")
    resumed = cli(tmp_path, *flags, f"--resume={tmp_path / 'run'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert final_state(tmp_path) == never_speculating
    assert "speculation held in 0 of 2 steps" in resumed.stderr


@pytest.mark.parametrize("mode,eager", [(m, False) for m in MODES] + [("overlap", True), ("engines", True)])
def test_a_run_where_the_clip_keeps_acting_stops_speculating_and_says_so(tmp_path, caplog, mode, eager):
    """(update.eager: on the overlapped path, the steps after speculation stopped were updated
    unit by unit without the clip)"""
    steps = MIN_STEPS + 1
    cfg = spec_config(tmp_path, clip=CLIP_ACTS, steps=steps, layers=2, mode=mode)
    cfg.update.eager = eager  # (for the overlapped and engine paths)
    tr, _ = assert_parity(cfg)
    spec = tr.update.spec
    assert spec.steps == MIN_STEPS and spec.held == 0 and tr.update.redone == MIN_STEPS
    assert "the clip acted in 8 of 8 speculative steps" in spec.stopped
    assert "speculation off for the rest of the run" in caplog.text


def test_the_rule_that_stops_speculation():
    s = Speculation(on=True)
    for step in range(1, MIN_STEPS + 1):
        s.begin(step)
        assert s.this_step and not s.judged_at(step)
        s.judged(step, kept=step > 2)  # 2 of 8 redone: a quarter, not more
    assert not s.stopped
    s.begin(MIN_STEPS + 1)
    s.judged(MIN_STEPS + 1, kept=False)  # 3 of 9: more than a quarter
    assert s.stopped and not (s.begin(MIN_STEPS + 2) or s.this_step) and s.judged_at(MIN_STEPS + 2)
    assert Speculation.keeps(torch.tensor(1.0)) and Speculation.keeps(None)
    assert not Speculation.keeps(torch.tensor(0.999999)) and not Speculation.keeps(torch.tensor(float("nan")))


def test_double_regions_flip_per_unit(tmp_path):
    from tiertrain.io import Storage
    from tiertrain.runtime import Runtime

    cfg = small_config(tmp_path)
    rt = Runtime(cfg)
    decl = DoubleRegions.declare(rt.layout, "s.bin", torch.float32, 0, 4096, name="s", owner="t", checkpointed=False)
    assert [f.name for f in decl.files] == ["s.bin", "s.spec.bin"] and decl.double
    storage = Storage(cfg.io.paths, stripe_bytes=64 << 10, chunk_bytes=256 << 10, checksum_block=4096)
    r = DoubleRegions(rt.layout, storage, decl)
    n = rt.layout.units[1].numel
    old, new, out = torch.full((n,), 1.0), torch.full((n,), 2.0), torch.empty(n)
    r.write(1, old).get()
    r.write_next(1, new).get()
    r.read(1, out).get()
    assert torch.equal(out, old)  # not current until flipped
    r.flip(1)
    r.read(1, out).get()
    assert torch.equal(out, new)
    r.write_next(1, old).get()  # the next step writes the other half again: the first one
    r.read(1, out).get()
    assert torch.equal(out, new)
    r.close()
    storage.close()


@pytest.mark.parametrize(
    "flags, fix",
    [
        (["update.mode=frozen"], "set update.mode = 'overlap'"),
        (["optim.grad_clip=0"], "use update.eager = true"),
        (["adapter.kind=lora", "adapter.target=q_proj"], "the adapters update in the trainer"),
    ],
)
def test_speculation_where_it_cannot_run_is_refused_with_the_fix(flags, fix):
    with pytest.raises(ConfigError, match="update.speculate = 'on'") as e:
        load_config(None, ["--update.speculate=on", *(f"--{f}" for f in flags)])
    assert fix in str(e.value)


def test_eager_with_clipping_is_allowed_only_speculating():
    with pytest.raises(ConfigError, match="update.speculate = 'on' updates under the backward"):
        load_config(None, ["--update.eager=true", "--update.mode=overlap"])
    cfg = load_config(None, ["--update.eager=true", "--update.mode=overlap", "--update.speculate=on"])
    assert cfg.update.eager and cfg.optim.grad_clip > 0


def test_auto_speculates_where_the_cost_model_predicts_a_gain_and_the_disk_has_the_space(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from test_cost import _rates

    from tiertrain.cost import predict_with
    from tiertrain.cost.choose import resolve_speculation
    from tiertrain.cost.report import plan_report
    from tiertrain.runtime import Runtime

    cfg = spec_config(tmp_path, speculate="auto", micro_batches=4)
    rt = Runtime(cfg)
    # the update's I/O longer than the forward's compute, shorter than the backward's: it bounds
    # the forward it runs under, and hides under the backward when it speculates
    slow_disk = lambda: _rates(read_gbps=0.01, write_gbps=0.01, block_fwd_s=0.01, block_bwd_s=0.3)  # noqa: E731
    on, why = resolve_speculation(cfg, rt, slow_disk)
    assert on.update.speculate == "on", why
    assert why.startswith("speculative update (auto): on (predicted ") and "held twice take" in why
    off, why = resolve_speculation(cfg, rt, None)
    assert off.update.speculate == "off" and "nothing measured" in why
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 4096))
    off, why = resolve_speculation(cfg, rt, slow_disk)
    assert off.update.speculate == "off" and "free" in why
    monkeypatch.undo()
    # the baseline speculates in the trainer's thread: it hides nothing, and auto says so
    baseline = dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, mode="baseline"))
    resolved, why = resolve_speculation(baseline, rt, slow_disk)
    assert resolved.update.speculate == "off" and "off (predicted " in why, why
    t_on, t_off = map(float, re.findall(r"([0-9.]+) s", why)[:2])
    assert t_on >= t_off, why
    spec_baseline = dataclasses.replace(baseline, update=dataclasses.replace(baseline.update, speculate="on"))
    pred = predict_with(spec_baseline, rt, slow_disk())
    assert pred.notes[-1].startswith("baseline (speculative): each unit's update runs in the trainer's thread"), pred
    report = plan_report(spec_baseline, rt, [], pred)
    assert "update path baseline, speculative, checksums" in report
    assert "baseline (speculative): each unit's update" in report
    # the engines speculating read no gradient back in a kept step: a gain where the disk bounds
    # the step, none where the trainer's compute does
    engines = dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, mode="engines"))
    resolved, why = resolve_speculation(engines, rt, slow_disk)
    assert resolved.update.speculate == "off" and "off (predicted " in why, why
    disk_bound = lambda: _rates(read_gbps=0.01, write_gbps=0.01, block_fwd_s=0.001, block_bwd_s=0.001)  # noqa: E731
    resolved, why = resolve_speculation(engines, rt, disk_bound)
    assert resolved.update.speculate == "on" and "held twice take" in why, why
    pred = predict_with(resolved, rt, disk_bound())
    assert pred.notes[-1].startswith("engines (speculative): each engine updates a unit as its gradient"), pred
    assert "GB less a step" in pred.notes[-1]
    unclipped = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, grad_clip=0.0))
    resolved, why = resolve_speculation(unclipped, rt, slow_disk)
    assert resolved.update.speculate == "off" and why is None  # no norm to wait for: nothing to say


@pytest.mark.parametrize("mode", MODES)
def test_a_step_abandoned_before_its_judgement_leaves_the_committed_state(tmp_path, mode):
    """An error after the backward (every unit speculated, none judged), then the step again:
    the speculation is dropped (the current halves untouched) and the run ends with the weights
    of one never interrupted."""
    cfg = spec_config(tmp_path / "a", clip=CLIP_NEVER, micro_batches=2, steps=3, mode=mode)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        [tr.train_step() for _ in range(3)]
        want = tr.weights()
    with Trainer(spec_config(tmp_path / "b", clip=CLIP_NEVER, micro_batches=2, steps=3, mode=mode)) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        flush = tr.grads.flush

        def fails():
            flush()
            tr.update.wait_all()  # every speculative update written to the other half
            if mode == "engines":  # each engine gives a slot back once it has updated that unit
                tr.update._pump(lambda: all(len(f) == 2 for f in tr.update._free), "speculating")
            raise OSError("injected after the backward")

        tr.grads.flush = fails
        with pytest.raises(OSError, match="injected"):
            tr.train_step()
        upd = tr.update  # units updated into their other halves, not judged
        speculated = {
            "overlap": lambda: "speculated" in {s.value for s in upd._state},
            "baseline": lambda: len(upd._speculated) > 2,
            "engines": lambda: upd.spec.this_step and not upd.spec.judged_at(2) and upd.sent_bytes > 0,
        }
        assert tr.step == 1 and speculated[mode]()
        tr.grads.flush = flush
        [tr.train_step() for _ in range(2)]
        got = tr.weights()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("eager", [False, True])
def test_the_plans_advice_compares_the_paths_of_a_speculating_run(tmp_path, eager):
    """`tiertrain plan`'s comparison of update paths put a speculating run's setting on the
    baseline, which the config refuses (a ConfigError for the plan of a valid run)."""
    from test_cost import _rates

    from tiertrain.cost import predict_with
    from tiertrain.cost.report import advice
    from tiertrain.runtime import Runtime

    cfg = spec_config(tmp_path, micro_batches=2)
    cfg.update.eager = eager  # with clipping: allowed only speculating, and not among the eager candidates
    rt = Runtime(cfg)
    rates = _rates(read_gbps=0.01, write_gbps=0.01, block_fwd_s=0.01, block_bwd_s=0.3)
    line = next(x for x in advice(cfg, rt, predict_with(cfg, rt, rates)) if x.startswith("update path: "))
    this = "overlap (eager), speculative" if eager else "overlap, speculative"
    assert f"{this} " in line and "baseline, speculative " in line and "engines, speculative " in line, line
