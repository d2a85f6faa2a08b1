"""8-bit optimizer states (``optim.name = "adamw8bit"``, ``update/adamw8bit.py``): the streamed
update is bitsandbytes' ``AdamW8bit`` on plain PyTorch bit for bit on CPU (its blockwise 8-bit
moments for parameters of 4096 elements or more, fp32 ones below), on the trainer's update
paths, with the speculative update, clipping, states partly in host memory and resume; its
files hold one byte a moment; the cost model counts the bytes the storage tier moves; what it
does not run yet is refused by name. Update chunks of 16,384 elements (whole 16 KiB checksum
blocks of the 1-byte codes) cut through the 8-bit parameters, whose last blocks are partial."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import assert_resume_exact, reference_model, reference_train, small_config, weights_of
from test_parity import assert_parity, assert_same_weights, run_tiertrain

from tiertrain.config import ConfigError
from tiertrain.state.scales import BLOCK, MIN_8BIT, ScaleLayout
from tiertrain.training.trainer import Trainer

pytest.importorskip("bitsandbytes")


def _config(tmp_path, *, mode="baseline", **kw):
    kw.setdefault("micro_batches", 2)
    kw.setdefault("steps", 3)
    kw.setdefault("clip", 0.05)
    kw.setdefault("d", 104)  # 26-wide heads: matrices end in part of a block (10,816 = 42 x 256 + 64)
    cfg = small_config(tmp_path, kind="llama", **kw)
    cfg.io.checksum_block_kib = 16  # chunks of 16,384 one-byte codes: cuts inside the MLP's matrices
    cfg.optim.name = "adamw8bit"
    cfg.update.mode = mode
    return cfg


def _cut_and_mixed(tr) -> None:
    """The run cut 8-bit parameters between chunks and had small (fp32-moment) ones too."""
    big = [r for u in tr.layout.units for r in u.params if r.numel >= MIN_8BIT]
    small = [r for u in tr.layout.units for r in u.params if r.numel < MIN_8BIT]
    assert big and small and any(r.numel % BLOCK for r in big)
    chunk = tr.optim.chunk
    assert any(r.offset // chunk != (r.offset + r.numel - 1) // chunk for r in big), "no parameter cut by a chunk"
    assert all(r.offset % BLOCK == 0 for u in tr.layout.units for r in u.params)


def _file_bytes(records: list[int], block: int = 16 << 10) -> int:
    """A state file's size: each unit's record starts on a whole checksum block."""
    return sum(-(-n // block) * block for n in records[:-1]) + records[-1]


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_streamed_adamw8bit_is_bitsandbytes_on_plain_pytorch_bit_for_bit(tmp_path, mode, clip):
    tr, losses = assert_parity(_config(tmp_path, mode=mode, clip=clip))
    _cut_and_mixed(tr)
    assert losses[-1] != losses[0]
    files = dict(tr.plan.files)
    codes = [u.numel for u in tr.layout.units]  # one byte a moment
    assert files["exp_avg.bin"] == files["exp_avg_sq.bin"] == _file_bytes(codes)
    assert files["exp_avg_scales.bin"] == _file_bytes([4 * u.numel for u in ScaleLayout(tr.layout).units])
    assert files["exp_avg.bin"] < files["grads.bin"] / 3


def test_the_reference_is_not_torchs_adamw(tmp_path):
    """The same run with fp32 AdamW gives other weights: the parity above compares 8-bit states."""
    cfg = _config(tmp_path / "a", steps=2)
    ref = reference_model(cfg)
    _, eight = reference_train(cfg, ref)
    cfg32 = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="adamw"))
    _, full = reference_train(cfg32, ref)
    assert any(not torch.equal(eight[k], full[k]) for k in eight)


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
def test_speculation_and_states_partly_in_host_memory(tmp_path, mode):
    """The speculative update (each unit updated under the backward, redone where the clip acts;
    on the baseline path unit by unit in the trainer's thread) and moments, scales and parameters
    partly in host memory: bitsandbytes' bits still."""
    kw = dict(micro_batches=2, steps=4, host_param_mib=1, grad_host_mib=1, optim_host_mib=1, clip=1e3)
    cfg = _config(tmp_path, mode=mode, **kw)
    cfg.update.speculate = "on"
    tr, _ = assert_parity(cfg)
    assert tr.update.spec.summary() == "speculation held in 4 of 4 steps"
    cfg = _config(tmp_path / "clipped", mode=mode, **{**kw, "clip": 1e-3})
    cfg.update.speculate = "on"
    tr, _ = assert_parity(cfg)
    assert tr.update.spec.summary() == "speculation held in 0 of 4 steps"


def test_bf16_parameters_keep_an_fp32_master_updated_by_bitsandbytes(tmp_path):
    """bf16 parameters: the 8-bit update runs on the fp32 master (plain PyTorch's recipe: AdamW8bit
    over fp32 master weights); within the tolerance bf16 parameters give (``test_parity``: bf16
    kernels on views of flat buffers round otherwise). Measured on this shape: losses within
    5.5e-4, master weights within 2.4e-3 after 3 steps of lr 2e-3 (fp32 AdamW on the same shape:
    4.5e-4 and 3.3e-3); the test allows 2 x lr."""
    cfg = _config(tmp_path, dtype="bfloat16")
    ref = reference_model(cfg)
    ref_losses, ref_weights = reference_train(cfg, ref, mixed=True)
    losses, weights, tr = run_tiertrain(cfg, weights_of(ref))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=2e-3, rtol=0)
    assert_same_weights(tr, weights, ref_weights, exact=False, atol=2 * cfg.optim.lr)
    assert tr.optim.master is not None


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
def test_a_resumed_run_is_the_straight_run_bit_for_bit(tmp_path, mode):
    assert_resume_exact(*(_config(tmp_path / s, mode=mode, steps=4) for s in ("a", "b")))


def _slices_cut_a_parameter(tr) -> None:
    """The engines' slices cut an 8-bit parameter (at a block boundary from its start)."""
    cut = [
        (r.name, s.start)
        for i, slices in enumerate(tr.update.slices[1:])
        for s in slices
        for r in tr.layout.units[s.unit].params
        if s.numel and r.offset < s.start < r.offset + r.numel and r.numel >= MIN_8BIT
    ]
    assert cut and all((start - next(p.offset for u in tr.layout.units for p in u.params if p.name == n)) % BLOCK == 0
                       for n, start in cut)  # fmt: skip


@pytest.mark.parametrize("clip,speculate", [(0.05, "off"), (1e3, "on")], ids=["clipped", "speculating"])
def test_the_update_engines_are_bitsandbytes_bit_for_bit(tmp_path, clip, speculate):
    """Two engines, each updating its slice of every unit with bitsandbytes' kernels and keeping
    one scales record a slice in its own files; slices cut 8-bit parameters."""
    cfg = _config(tmp_path, mode="engines", paths=2, clip=clip, steps=4)
    cfg.update.speculate = speculate
    tr, losses = assert_parity(cfg)
    _slices_cut_a_parameter(tr)
    if speculate == "on":
        assert tr.update.spec.summary() == "speculation held in 4 of 4 steps"


def test_the_engines_read_ahead_holds_its_units_scales_within_the_budgets_pools(tmp_path):
    """Engines reading ahead keep one scales record per unit in flight (not one per chunk read
    ahead), the read-ahead's records within the read-ahead's bytes: what each engine holds is
    within the planner's pools for the engines, scales included, and the run is bitsandbytes'."""
    from tiertrain.cost.budget import fixed_pools

    cfg = _config(tmp_path, mode="engines", paths=2, steps=3, update_kib=64)
    cfg.memory.engine_read_ahead_mib = 1  # the engines' together: half a MiB each
    tr, _ = assert_parity(cfg)
    fixed = fixed_pools(tr.cfg, tr.rt)
    reports = tr.engines.stepped
    assert all(0 < r["ahead"] < r["chunks"] for r in reports)  # some chunks read ahead, not all
    per_step = [reports[i : i + 2] for i in range(0, len(reports), 2)]
    held = max(sum(r["pool"] for r in step) for step in per_step)
    assert held <= fixed["engine buffers"] + fixed["8-bit states' scales (engines)"], (held, fixed)


def test_a_read_ahead_takes_one_scales_record_per_unit_within_its_bytes(tmp_path):
    """Each chunk read ahead takes a buffer set; each unit it starts, one record of scales (the
    largest), within the same bytes: a unit cut into many chunks holds one record, not one a
    chunk (that had the engines hold, uncounted, up to a record per chunk read ahead)."""
    with Trainer(_config(tmp_path, update_kib=64)) as tr:
        opt, scales = tr.optim, ScaleLayout(tr.optim.layout)
        chunks, set_bytes, record = opt._all_chunks, opt.sets[0].nbytes, 4 * scales.max_unit_numel
        assert record and len(chunks) > len({u for u, _, _ in chunks}) + 2  # units of several chunks
        for budget in (0, set_bytes + record - 1, set_bytes + record, 7 * set_bytes + 3 * record, 1 << 30):
            n, units = opt._ahead_fit(budget, set_bytes, scales)
            started = len({u for u, _, _ in chunks[:n]})
            assert units == started and n * set_bytes + units * record <= budget
            if n < len(chunks):  # the next chunk would not fit
                nxt = set_bytes + (record if chunks[n][1] == 0 else 0)
                assert n * set_bytes + units * record + nxt > budget
        assert opt._ahead_fit(1 << 30, set_bytes, scales) == (len(chunks), len({u for u, _, _ in chunks}))


def test_the_engines_checkpoint_is_the_one_rank_files_and_resumes_on_any_path(tmp_path):
    """A checkpoint of the engines holds the whole units' scales records, joined from the engines'
    slices: byte for byte the baseline path's checkpoint at the same step; resumed by the engines
    or the overlapped path, it continues the straight run bit for bit."""
    saved = {}
    for mode in ("baseline", "engines"):
        with Trainer(_config(tmp_path / mode, mode=mode, paths=2, steps=2)) as tr:
            tr.initialize(progress=False)
            for _ in range(2):
                tr.train_step()
            saved[mode] = tr.save_checkpoint().path
    for name in ("exp_avg_scales.bin", "exp_avg.bin", "exp_avg_sq.bin", "params.bin"):
        with open(f"{saved['baseline']}/{name}", "rb") as a, open(f"{saved['engines']}/{name}", "rb") as b:
            assert a.read() == b.read(), name
    with Trainer(_config(tmp_path / "straight", mode="overlap", paths=2, steps=4)) as tr:
        tr.initialize(progress=False)
        straight = [tr.train_step().extra["losses"] for _ in range(4)]
        want = tr.weights()
    for mode in ("engines", "overlap"):
        with Trainer(_config(tmp_path / f"resumed-{mode}", mode=mode, paths=2, steps=4)) as tr:
            tr.restore(saved["engines"])
            rest = [tr.train_step().extra["losses"] for _ in range(2)]
            got = tr.weights()
        assert rest == straight[2:], mode
        assert all(torch.equal(got[k], want[k]) for k in want), mode


def test_a_corrupt_scales_file_in_a_checkpoint_is_caught(tmp_path):
    cfg = _config(tmp_path, steps=1)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        saved = tr.save_checkpoint().path
    path = f"{saved}/exp_avg_scales.bin"
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x7f\x7f\x7f\x7f")
    with Trainer(cfg) as tr, pytest.raises(Exception, match="exp_avg_scales"):
        tr.restore(saved)


def test_the_cost_model_counts_what_the_storage_tier_moves(tmp_path):
    """The bytes of a step (one-byte moments and their scales, read and written) are the counters'."""
    from tiertrain.cost import run_traffic

    cfg = _config(tmp_path)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        rec = tr.train_step()
        t = run_traffic(tr, kept=len(tr.model.blocks) * cfg.data.micro_batches - tr.executor.recomputed)
    assert (t.read, t.write) == (rec.ssd_read_bytes, rec.ssd_write_bytes)
    n = tr.layout.total_numel
    assert list(t.by_state["exp_avg"]) == list(t.by_state["exp_avg_sq"]) == [n, n]  # one byte a moment


def test_lora_adapters_step_with_bitsandbytes_as_peft_users_do(tmp_path):
    """Adapters (in memory) take bitsandbytes' AdamW8bit itself; rank 32 on a 128-wide model gives
    adapters of 4096 elements, so both of its state kinds are used; resumed bit for bit (its step
    count, a Python int, goes through the checkpoint)."""
    from test_lora import _train, assert_lora_parity, lora_config

    def cfg_of(sub, steps=3):
        cfg = lora_config(tmp_path / sub, "llama", rank=32, steps=steps, d=128)  # adapters of 4,096
        cfg.optim.name = "adamw8bit"
        return cfg

    tr = assert_lora_parity(cfg_of("parity"))
    assert type(tr.adapter_update.opt).__name__ == "AdamW8bit"
    # the start-up line counts the states the 8-bit moments keep (it said "AdamW moments", x4)
    assert "(x2.5 with gradients and 8-bit AdamW moments" in tr.rt.adapters.describe(tr.cfg.optim.name)
    init = weights_of(reference_model(cfg_of("a", 4)))
    straight, w_straight, _ = _train(cfg_of("a", 4), init, 4)
    first, _, ckpt = _train(cfg_of("b", 4), init, 2)
    second, w_resumed, _ = _train(cfg_of("b", 4), init, 2, resume=ckpt)
    assert first + second == straight
    assert all(torch.equal(w_straight[n], w_resumed[n]) for n in w_straight)


def test_what_it_does_not_run_yet_is_refused_by_name(tmp_path):
    from tiertrain.runtime import Runtime

    cut = _config(tmp_path / "pieces")
    cut.model.vocab_pieces = 3  # rows 0-85, 86-170, 171-255 of 104: the second starts at element 8,944
    with pytest.raises(ConfigError, match=r"row piece embed_pieces.1.weight starts at element 8944 of .*256-element"):
        Runtime(cut)


def test_an_old_bitsandbytes_is_named(tmp_path, monkeypatch):
    import bitsandbytes

    from tiertrain.runtime import Runtime

    monkeypatch.setattr(bitsandbytes, "__version__", "0.44.1")
    with pytest.raises(ConfigError, match=r"bitsandbytes >= 0.50.*0.44.1 is installed"):
        Runtime(_config(tmp_path))


@pytest.mark.parametrize("first,then", [("adamw", "adamw8bit"), ("adamw8bit", "adamw")])
def test_a_checkpoint_resumed_with_the_other_optimizer_is_refused_by_name(tmp_path, first, then):
    """Its states are in another form and its parameters on other offsets: named before any state
    is read, not found corrupt (nor read wrongly)."""
    cfg = _config(tmp_path, steps=1)
    cfg.optim.name = first
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        saved = tr.save_checkpoint().path
    cfg.optim.name = then
    with (
        Trainer(cfg) as tr,
        pytest.raises(ConfigError, match=rf"made with optim.name = '{first}'.*--optim.name={first}"),
    ):
        tr.restore(saved)
    with pytest.raises(ConfigError, match=r"optim.name.*'adamw8bit'"):
        _config(tmp_path / "bad").optim.__class__(name="adam8bit")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["baseline", "engines"])
def test_ranks_are_bitsandbytes_on_the_grouped_reference_bit_for_bit(tmp_path, mode):
    """2 ranks, each updating its shard of every unit (shards cut 8-bit parameters at block
    boundaries, a scales record per unit and rank), on the trainer's path and each rank's
    engines: plain PyTorch + bitsandbytes' AdamW8bit summing the same gradients in the same
    grouping, bit for bit. No clipping: the ranks' global norm sums their shards' squares, within
    rounding of the whole's, as with fp32 states (``test_dist_train``)."""
    from test_dist_train import _Named, run_ranks

    cfg = _config(tmp_path, mode=mode, steps=3, clip=0.0)
    ref_model, out = run_ranks(tmp_path, cfg, 2)
    ref_losses, ref_weights = reference_train(cfg, ref_model, ranks=2)
    for step, want in enumerate(ref_losses):
        assert [x for r in range(2) for x in out[r]["losses"][step]] == want
    assert_same_weights(_Named(cfg), out[0]["weights"], ref_weights)
    assert [o["mode"] for o in out] == [mode] * 2 and out[0]["state"] * 2 == out[0]["full"]


@pytest.mark.slow
def test_a_checkpoint_of_ranks_is_the_one_rank_files_and_loads_on_any_number(tmp_path):
    """The ranks' scales records joined into the whole units' (the checkpoint a one-rank run
    writes): saved by 2 ranks, loaded by 1 and saved again at once, the same bytes; the other way
    round, 1 to 3 ranks; and from 2 ranks' engines (a slice of each rank's shard each) to one
    rank's trainer. Training goes on from it."""
    from test_dist_train import ckpt_run

    for first, then, mode in ((2, 1, "baseline"), (1, 3, "baseline"), (2, 1, "engines")):
        root = tmp_path / f"{first}-{then}-{mode}"
        root.mkdir()
        cfg = _config(root / "a", steps=4, micro_batches=6 // first, mode=mode, paths=2)
        saved = ckpt_run(root, "save", cfg, first, steps=2, save=True)
        cfg2 = _config(root / "b", steps=4, micro_batches=6 // then)
        again = ckpt_run(root, "again", cfg2, then, resume=saved["path"], save=True)
        for name in ("exp_avg_scales.bin", "exp_avg.bin", "exp_avg_sq.bin", "params.bin"):
            with open(f"{saved['path']}/{name}", "rb") as a, open(f"{again['path']}/{name}", "rb") as b:
                assert a.read() == b.read(), (first, then, mode, name)
        if (first, mode) != (2, "baseline"):
            continue  # training on from a checkpoint: once
        # (into a run directory of its own: cfg2's holds the run saved "again", which takes another's refuse)
        on = ckpt_run(
            root, "on", _config(root / "c", steps=4, micro_batches=6 // then), then, resume=saved["path"], steps=1
        )
        assert on["step"] == 3 and any(not torch.equal(on["weights"][k], saved["weights"][k]) for k in saved["weights"])


@pytest.mark.parametrize("mode", ["baseline", "engines"])
def test_ranges_of_experts_keep_the_whole_matrices_blocks_bit_for_bit(tmp_path, mode):
    """A mixture of experts cut into 4 ranges of one expert: each range's share of an expert
    parameter is a parameter of its own, its blocks counted from its start (on the whole
    matrix's blocks: every expert starts on one), and a share below 4,096 elements of a matrix
    above keeps 8-bit moments, as bitsandbytes decides by the whole matrix. bitsandbytes'
    AdamW8bit on the uncut model bit for bit (no clipping: the ranges' norms sum otherwise)."""
    from test_experts_cut import _cfg, _parity
    from test_moe import _config as moe_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config("qwen3_moe")).save_pretrained(tmp_path / "m")
    cfg = _cfg(tmp_path, str(tmp_path / "m"), 5, clip=0.0)
    cfg.optim.name, cfg.update.mode = "adamw8bit", mode
    cfg.io.paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    tr = _parity(cfg)
    shares = [r for u in tr.layout.units for r in u.params if r.whole != r.numel]
    assert any(r.numel < MIN_8BIT <= r.whole for r in shares)


def test_vocabulary_pieces_on_blocks_train_within_the_pieces_rounding(tmp_path):
    """The vocabulary in 2 pieces of 128 rows of 104 (the second starts on element 13,312, a
    block's): 8-bit states as bitsandbytes' on the whole matrices. The loss over pieces rounds
    otherwise than the whole's (fp32 AdamW on the same pieces: losses 5e-7 apart, weights 1.4e-5
    after 3 steps of lr 2e-3), and where that rounding flips an 8-bit code the weight moves by a
    step of the code's (measured: 5.9e-5); so losses within 1e-5, weights within lr / 16."""
    cfg = _config(tmp_path, clip=0.0)
    cfg.model.vocab_pieces = 2
    ref = reference_model(cfg)
    ref_losses, ref_weights = reference_train(cfg, ref)
    losses, weights, tr = run_tiertrain(cfg, weights_of(ref))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    from test_parity import ref_name_map

    names = ref_name_map(tr, weights)
    atol = cfg.optim.lr / 16
    assert_same_weights(tr, weights, ref_weights, names={n: names[n] for n in weights}, exact=False, atol=atol)
    assert any("embed_pieces" in r.name for u in tr.layout.units for r in u.params)


def test_the_planners_vocabulary_cut_starts_its_pieces_on_the_8bit_blocks(tmp_path):
    """A 6,401 x 192 vocabulary the budget cannot hold whole: with fp32 states the planner cuts
    it into 4 even pieces (1,601 rows), which start off bitsandbytes' 256-element blocks; with
    8-bit states it takes the fewest on them, 9 (712 rows). It was refused at planning, telling
    the user to leave unset the cut they had left unset."""
    from test_pieces import _gqa_llama

    from tiertrain.cost.budget import PoolsOverBudget, resolve_budget
    from tiertrain.runtime import Runtime

    def cfg(pieces=None, host=1, name="adamw8bit"):
        c = _gqa_llama(tmp_path / f"p{pieces}-{host}-{name}", vocab=6401)
        c.optim.name, c.model.vocab_pieces, c.memory.host_mib = name, pieces, host
        return c

    needed = []
    for pieces in (None, 9):  # the fixed pools whole, and cut as 8-bit states need
        c = cfg(pieces)
        rt = Runtime(c)
        try:
            with pytest.raises(PoolsOverBudget) as exc:
                resolve_budget(c, rt, None, lambda: (1 << 20, 0))
            needed.append(exc.value.needed >> 20)
        finally:
            rt.close()
    host = sum(needed) // 2  # holds the cut pools, not the whole ones
    assert needed[1] < host < needed[0]
    for name, pieces in (("adamw", 4), ("adamw8bit", 9)):
        with Trainer(cfg(host=host, name=name)) as tr:
            assert tr.cfg.model.vocab_pieces == pieces
            rows = tr.model.row_pieces
            assert (name == "adamw8bit") == all(p.start * 192 % BLOCK == 0 for p in rows.values() if "embed" in p.whole)
