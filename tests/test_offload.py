"""Activations on the storage tier: keep, offload or recompute per (block, micro-batch) pair.

Parity: every policy, and mixes of the three, train bit-identically to plain PyTorch in
fp32 (dropout on at M = 1, where plain PyTorch draws its masks in the executor's order; the
layer-major order draws them block by block at M > 1, so dropout runs compare the paths
against each other there). Dedup: a record holds each storage autograd saves once, and
neither parameters nor the block's input. Faults: a corrupt or truncated record fails the
step naming the file; a full disk is reported at start with the bytes needed.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from reference import assert_resume_exact, reference_model, small_config, weights_of
from test_parity import assert_parity, run_tiertrain

from tiertrain.activations.offload import ActivationPlanError, record_size
from tiertrain.config import ConfigError, MemoryConfig
from tiertrain.device import AsyncCpuDevice
from tiertrain.io import ChecksumError, OutOfSpaceError, TruncatedFileError
from tiertrain.training.trainer import Trainer

MIB = 1 << 20


def _acts(rec):
    e = rec.extra
    return e["act_kept"], e["act_offloaded"], e["act_recomputed"]


# -- parity -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,micro_batches", [("gpt", 1), ("llama", 3), ("gpt2", 2)])  # gpt2: tied
def test_offload_all_bit_identical(tmp_path, kind, micro_batches):
    cfg = small_config(tmp_path, kind=kind, micro_batches=micro_batches, activations="offload", tie=kind == "gpt2")
    tr, _ = assert_parity(cfg)
    pairs = cfg.model.n_layers * micro_batches
    assert tr.acts.offloaded == pairs and tr.executor.recomputed == 0 and tr.executor.kept_pairs == 0
    assert "acts.bin" in dict(tr.plan.files)


@pytest.mark.parametrize("activations", ["offload", "recompute", "keep"])
def test_dropout_bit_identical_under_every_policy(tmp_path, activations):
    """Dropout in the embedding, attention and residuals: offloaded graphs need no replay,
    recomputed ones replay the forward's draws, kept ones keep their masks."""
    cfg = small_config(
        tmp_path,
        kind="gpt",
        layers=3,
        activations=activations,
        dropout=0.1,
        keep_act_mib=64 if activations == "keep" else 0,
    )
    tr, losses = assert_parity(cfg)
    if activations == "offload":  # once: dropout did draw
        no_drop = assert_parity(small_config(tmp_path / "p0", kind="gpt", layers=3))[1]
        assert losses != no_drop


def test_a_mix_of_kept_offloaded_and_recomputed_pairs_bit_identical(tmp_path):
    """8 pairs: the last 2 kept (1 MiB of ~0.4 MiB graphs), the 3 before them offloaded, the
    first 3 recomputed; bit-identical, and the step says so."""
    cfg = small_config(
        tmp_path, kind="llama", layers=4, micro_batches=2, activations="auto", keep_act_mib=1, offload_pairs=3
    )
    tr, _ = assert_parity(cfg)
    assert (tr.acts.kept, tr.acts.offloaded) == (2, 3)
    assert tr.executor.kept_pairs == 2 and tr.executor.recomputed == 3


def test_a_mix_with_dropout_at_one_micro_batch(tmp_path):
    cfg = small_config(tmp_path, kind="gpt", layers=4, activations="auto", keep_act_mib=1, offload_pairs=1, dropout=0.2)
    tr, _ = assert_parity(cfg)
    assert tr.executor.kept_pairs == 2 and tr.executor.recomputed == 1 and tr.acts.offloaded == 1


@pytest.mark.slow
def test_dropout_at_several_micro_batches_same_under_every_policy(tmp_path):
    runs = []
    for name, kw in {
        "recompute": dict(activations="recompute"),
        "offload": dict(activations="offload"),
        "keep": dict(keep_act_mib=64),
        "mix": dict(activations="auto", keep_act_mib=1, offload_pairs=2),
    }.items():
        cfg = small_config(tmp_path / name, kind="gpt", layers=3, micro_batches=2, dropout=0.1, **kw)
        runs.append(run_tiertrain(cfg, weights_of(reference_model(cfg))))
    for losses, weights, _ in runs[1:]:
        assert losses == runs[0][0]
        for n, t in weights.items():
            assert torch.equal(t, runs[0][1][n]), n


@pytest.mark.slow
def test_offload_through_a_separate_device_memory(tmp_path):
    """The CUDA path on the test device: saved tensors go down on the download stream, the
    record's write starts after them, the record comes back up as one upload."""
    cfg = small_config(tmp_path, kind="llama", micro_batches=2, activations="offload")
    dev = AsyncCpuDevice()
    assert_parity(cfg, device=dev)


@pytest.mark.slow
def test_offload_bf16_same_as_recompute(tmp_path):
    runs = {}
    for act in ("recompute", "offload"):
        cfg = small_config(tmp_path / act, kind="llama", micro_batches=2, dtype="bfloat16", activations=act)
        runs[act] = run_tiertrain(cfg, weights_of(reference_model(cfg)))
    assert runs["recompute"][0] == runs["offload"][0]
    for name, t in runs["recompute"][1].items():
        assert torch.equal(t, runs["offload"][1][name]), name


@pytest.mark.slow
def test_resume_exact_with_offloaded_activations(tmp_path):
    kw = dict(kind="llama", micro_batches=2, activations="auto", keep_act_mib=1, offload_pairs=2)
    assert_resume_exact(small_config(tmp_path / "a", **kw), small_config(tmp_path / "b", **kw))


# -- dedup and bytes ------------------------------------------------------------------------------------
def _saved_storages(block, x) -> tuple[dict[int, int], int]:
    """The storages plain autograd saves for ``block(x)`` (read off its graph's nodes), but for
    parameters and the input: {address: bytes}, and the bytes of every saved tensor counted
    without dedup."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    skip = params | {x.untyped_storage().data_ptr()}
    out = block(x, None)
    seen, total, stack, visited = {}, 0, [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in visited:
            continue
        visited.add(id(fn))
        for name in dir(fn):
            if not name.startswith("_saved_"):
                continue
            v = getattr(fn, name)
            for t in v if isinstance(v, (tuple, list)) else [v]:
                if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in skip:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    total += t.untyped_storage().nbytes()
        stack.extend(f for f, _ in fn.next_functions)
    return seen, total


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_record_holds_each_saved_storage_once(tmp_path, kind):
    """Record bytes = the distinct storages autograd saves for one block (each on 64 bytes,
    the record on whole checksum blocks: ``record_size``),
    not their views (q, k and v are views of one projection), not the parameters, not the
    block's input (in the stash); every step writes exactly that per offloaded pair, and the
    storage tier's counters see nothing else added against the recompute path."""
    runs = {}
    for act in ("recompute", "offload"):
        cfg = small_config(tmp_path / act, kind=kind, micro_batches=2, activations=act, steps=2)
        with Trainer(cfg) as tr:
            tr.initialize(progress=False)
            runs[act] = [tr.train_step() for _ in range(2)]
            plan = tr.acts
    ref = reference_model(cfg)
    if kind == "gpt":
        block = ref.blocks[0]
    else:
        from tiertrain.models.decoder import DecoderBlock

        block = DecoderBlock(ref.hf, 0)  # the layer as tiertrain calls it (its mask and rotary tables inside)
    d = cfg.data
    x = torch.randn(d.micro_batch_size, d.seq_len, cfg.model.d_model, requires_grad=True)
    seen, no_dedup = _saved_storages(block, x)
    formula = record_size(sum(-(-n // 64) * 64 for n in seen.values()), cfg.io.checksum_block_kib << 10)
    assert plan.record_bytes == formula
    assert plan.record_bytes < record_size(no_dedup, cfg.io.checksum_block_kib << 10)  # views of one storage: once
    pairs = cfg.model.n_layers * cfg.data.micro_batches
    for off, rec in zip(runs["offload"], runs["recompute"]):
        assert off.extra["act_offload_bytes"] == pairs * formula
        assert off.ssd_write_bytes - rec.ssd_write_bytes == pairs * formula
        assert off.ssd_read_bytes - rec.ssd_read_bytes == pairs * formula


# -- choice, errors, faults -----------------------------------------------------------------------------
def test_auto_offloads_what_its_prediction_says(tmp_path):
    """A fast disk: every pair not kept is offloaded (its I/O hides); a disk 10^5 times slower:
    none (recomputing is cheaper)."""
    from tiertrain.cost import measure_rates
    from tiertrain.cost.choose import resolve_activations

    cfg = small_config(tmp_path, kind="llama", micro_batches=2, activations="auto")
    with Trainer(cfg) as tr:
        rates = measure_rates(tr.cfg, tr.rt, probe_mib=4)
        a = tr.acts
        base = dataclasses.replace(tr.cfg, memory=dataclasses.replace(tr.cfg.memory, offload_pairs=None))
        fast = dataclasses.replace(rates, read_gbps=100.0, write_gbps=100.0, io_slowdown=1.0, block_fwd_s=0.05)
        slow = dataclasses.replace(rates, read_gbps=1e-5, write_gbps=1e-5)
        pairs = cfg.model.n_layers * cfg.data.micro_batches
        got, why = resolve_activations(base, tr.rt, a.act_bytes, a.record_bytes, lambda: fast)
        assert got.memory.offload_pairs == pairs and f"{pairs} on the storage tier" in why
        got, why = resolve_activations(base, tr.rt, a.act_bytes, a.record_bytes, lambda: slow)
        assert got.memory.offload_pairs == 0 and f"{pairs} recomputed" in why
        assert tr.acts.offloaded == pairs  # not measured at start (train.predict = false): all of them


@pytest.mark.slow
def test_the_step_line_and_summary_say_where_activations_went(tmp_path):
    from reference import tiny_flags

    run = tmp_path / "run"
    args = ["train", *tiny_flags(tmp_path, "--memory.keep_act_mib=0", "--memory.activations=offload")]
    r = subprocess.run([sys.executable, "-m", "tiertrain.cli", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = r.stderr
    assert "acts kept 0, ssd 4 (" in text and "recomputed 0" in text
    assert "activations per step: 0 pairs kept, 4 on the storage tier" in text
    assert (
        "activations (memory.activations = 'offload'): 0 of 4 pairs kept in memory, the other 4 on the storage tier"
    ) in text
    assert "activation records" in text  # a fixed pool, printed with the others
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert rows[-1]["extra"]["act_offloaded"] == 4 and rows[-1]["extra"]["act_offload_bytes"] > 0


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"memory.offload_pairs = 3 needs memory.activations = 'auto' or 'offload'"):
        MemoryConfig(activations="keep", offload_pairs=3)
    with pytest.raises(ConfigError, match=r"memory.act_buffers = 1: must be between 2 and 64"):
        MemoryConfig(act_buffers=1)
    with pytest.raises(ConfigError, match=r"memory.activations = 'ssd': must be one of"):
        MemoryConfig(activations="ssd")


def test_a_pair_saving_more_than_planned_stops_the_step(tmp_path):
    cfg = small_config(tmp_path, kind="gpt", activations="offload")
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.offloaded.record_bytes = 4096  # as if block 0 had saved less than the others
        with pytest.raises(
            ActivationPlanError, match=r"block 0, micro-batch 0 saves more than the 4,096 bytes planned"
        ):
            tr.train_step()


def _corrupt_after_forward(tr, damage):
    """Run ``damage(path, record_bytes)`` on the records' file once the forward has written
    them, before the backward reads any back."""
    off = tr.offloaded
    end = off.end_forward

    def end_forward():
        while any(not r.written for r in off._recs.values()):
            off._reap(block=True)
        damage(os.path.join(tr.cfg.io.paths[0], "acts.bin"), off.record_bytes)
        end()

    off.end_forward = end_forward


def test_a_corrupt_record_fails_the_step_naming_file_and_offset(tmp_path):
    cfg = small_config(tmp_path, kind="gpt", activations="offload")
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)

        def flip(path, record):
            fd = os.open(path, os.O_RDWR)
            try:
                b = os.pread(fd, 1, record + 100)
                os.pwrite(fd, bytes([b[0] ^ 0x40]), record + 100)  # record 1
            finally:
                os.close(fd)

        _corrupt_after_forward(tr, flip)
        with pytest.raises(ChecksumError, match=r"acts\.bin.*offset \d+") as ei:
            tr.train_step()
        assert "acts.bin" in str(ei.value)


def test_a_truncated_record_file_fails_the_step(tmp_path):
    cfg = small_config(tmp_path, kind="gpt", activations="offload")
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        _corrupt_after_forward(tr, lambda path, record: os.truncate(path, record + 512))
        with pytest.raises(TruncatedFileError, match=r"acts\.bin"):
            tr.train_step()


def test_a_full_disk_is_reported_at_start_with_the_bytes_needed(tmp_path, monkeypatch):
    cfg = small_config(tmp_path / "probe", kind="gpt", activations="offload")
    with Trainer(cfg) as tr:
        files = dict(tr.plan.files)
        p = tr.plan  # the data and its checksum sidecars
        need = sum(n for _, n in tr.storage.space_needs(p.files, placed=p.placed, records=p.records))
    assert need > sum(files.values())
    assert files["acts.bin"] > 0
    import tiertrain.io.space as space

    monkeypatch.setattr(space, "free_bytes", lambda path: need - files["acts.bin"] // 2)
    cfg = small_config(tmp_path / "full", kind="gpt", activations="offload")
    with pytest.raises(OutOfSpaceError, match=rf"need {need} bytes"):
        Trainer(cfg)


# -- memory -----------------------------------------------------------------------------------------------
_CHILD = r"""
import dataclasses, json, sys, pathlib
from tiertrain.device import host_rss, host_peak_rss, reset_peak_rss
sys.path.insert(0, sys.argv[2])
from reference import small_config
seq = int(sys.argv[3])
cfg = small_config(pathlib.Path(sys.argv[1]), layers=12, d=256, heads=4, micro_batches=2, steps=2, update_kib=1024,
                   activations="offload")
cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_seq_len=seq),
                          data=dataclasses.replace(cfg.data, seq_len=seq),
                          memory=dataclasses.replace(cfg.memory, mmap_threshold_kib=1024))  # the strict setting
from tiertrain.training.trainer import Trainer
def rss_file():  # the libraries' pages mapped in: as many as the page cache holds around each one touched
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    return 0
base, file_base = host_rss(), rss_file()
if not reset_peak_rss():
    print(json.dumps({"unsupported": "cannot reset the peak RSS (/proc/self/clear_refs)"}))
    sys.exit(0)
with Trainer(cfg) as tr:
    tr.initialize(progress=False)
    recs = [tr.train_step() for _ in range(cfg.train.steps)]
    print(json.dumps(dict(base=base, peak=host_peak_rss(), pools=sum(tr.pool_bytes.values()),
                          records=tr.offloaded.pool_bytes, unit=tr.layout.max_unit_numel * 4, act=tr.acts.act_bytes,
                          record=tr.acts.record_bytes, pairs=tr.acts.offloaded,
                          offloaded=[r.extra["act_offload_bytes"] for r in recs], files=rss_file() - file_base)))
"""


@pytest.mark.slow
def test_rss_stays_within_the_pools_whatever_the_sequence_length(tmp_path):
    """Every pair's activations on the storage tier: peak RSS grows by the fixed pools (the
    records' among them) plus the working set of one micro-batch's block (its activations
    twice: autograd's and the record being filled) plus 96 MiB, at 256 and at 1024 tokens,
    while the step's activations at 1024 tokens are several times that. With
    memory.mmap_threshold_kib = 1024 (the setting that keeps freed activations from
    fragmenting the heap; see tiertrain/device/host.py). The libraries' pages mapped in during
    the run are allowed on top: how many a page touched brings depends on the page cache (a
    fresh virtual environment, all in the cache: 52 MiB; an older one: 23 MiB; the rest of the
    growth the same to 2 MiB)."""
    here = os.path.dirname(__file__)
    out = {}
    for seq in (256, 1024):
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, str(tmp_path / str(seq)), here, str(seq)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        out[seq] = json.loads(r.stdout.strip().splitlines()[-1])
        if "unsupported" in out[seq]:
            pytest.skip(out[seq]["unsupported"])
    for seq, o in out.items():
        growth = o["peak"] - o["base"]
        allowance = o["pools"] + 4 * o["unit"] + 2 * o["act"] + 96 * MIB + o["files"]
        assert growth <= allowance, (seq, growth / MIB, allowance / MIB)
        assert o["records"] == 3 * o["record"]  # memory.act_buffers records, fixed
        assert o["offloaded"] == [o["pairs"] * o["record"]] * 2
    big = out[1024]
    assert big["pairs"] * big["act"] > 2 * (big["peak"] - big["base"])  # the activations were never all in memory


@pytest.mark.slow
def test_plan_shows_where_activations_go_and_their_bytes(tmp_path):
    from reference import tiny_flags

    flags = [
        f
        for f in tiny_flags(tmp_path, "--memory.keep_act_mib=0", "--memory.activations=offload", layers=3)
        if not f.startswith("--train.steps")
    ]
    r = subprocess.run(
        [sys.executable, "-m", "tiertrain.cli", "plan", "--probe-mib=8", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert (
        "activations (memory.activations = 'offload'): of 6 (block, micro-batch) pairs 0 kept, 6 on the storage "
        "tier (records of" in out
    )
    assert "| activations | activations on the storage tier |" in out  # its file, claimed at start
    assert "activations " in out.split("by state (read / write GB):")[1].splitlines()[0]


def test_a_failed_steps_prefetch_of_the_stash_is_not_the_next_steps_entry(tmp_path):
    """A step that failed after the backward prefetched a spilled hidden state left the read in
    the stash: the next step's get of that entry returned it, the old step's value, though its
    put had just rewritten the entry (the executor clears the stash with the rest now)."""
    from tiertrain.activations.stash import HiddenStash
    from tiertrain.device.core import Device
    from tiertrain.io import Storage

    st = Storage([str(tmp_path / "s")], chunk_bytes=1 << 20, checksum_block=1 << 16)
    s = HiddenStash(st, Device(), shape=(1024,), dtype=torch.float32, entries=4, host_bytes=4096, micro_batches=1)
    assert s.spilled >= 2
    for i in range(4):
        s.put(i, torch.full((1024,), float(i)))
    s.prefetch(1)  # ... and the step fails
    s.clear()
    for i in range(4):
        s.put(i, torch.full((1024,), 100.0 + i))
    assert s.get(1)[0].item() == 101.0
    s.free(1)
    s.close()
    st.close()


def test_a_failed_pair_forward_gives_its_record_buffer_back(tmp_path):
    """A pair's forward that failed (out of memory, an activation plan error) kept its record
    buffer: after as many failures as buffers, every forward failed ("held by records being
    back-propagated"), cleared or not."""
    from tiertrain.activations.offload import OffloadedGraphs
    from tiertrain.device.core import Device
    from tiertrain.io import Storage

    st = Storage([str(tmp_path / "s")], chunk_bytes=1 << 20, checksum_block=1 << 16)
    og = OffloadedGraphs(st, Device(), record_bytes=1 << 16, records=4, buffers=2, input_of=lambda k: None)
    w = torch.randn(8, 8)
    og.bind(lambda u: w.reshape(-1))

    def bad(x):
        (x * 2).sin()
        raise RuntimeError("out of memory (a stand-in)")

    for _ in range(3):
        og.clear()
        with pytest.raises(RuntimeError, match="a stand-in"):
            og.forward((0, 0), 0, (0,), bad, torch.randn(4, 8))
    og.clear()
    og.forward((0, 0), 0, (0,), lambda x: (x * 2).sin(), torch.randn(4, 8))
    og.close()
    st.close()


@pytest.mark.parametrize("part", ["offload", "stash"])
def test_a_pool_that_cannot_be_made_leaves_no_file_open(tmp_path, monkeypatch, part):
    """The activation records' (and the stash's spill) file was made before its buffer pool: where
    the pool could not be made (page-locking refused on CUDA), its descriptors stayed open."""
    import tiertrain.activations.offload as offload
    import tiertrain.activations.stash as stash
    from tiertrain.device.core import Device
    from tiertrain.io import Storage

    def refused(*args, **kwargs):
        raise RuntimeError("cudaHostRegister failed (a stand-in)")

    st = Storage([str(tmp_path / "s")], chunk_bytes=1 << 20, checksum_block=1 << 16)
    before = len(os.listdir("/proc/self/fd"))
    mod = offload if part == "offload" else stash
    monkeypatch.setattr(mod, "BufferPool", refused)
    with pytest.raises(RuntimeError, match="a stand-in"):
        if part == "offload":
            offload.OffloadedGraphs(st, Device(), record_bytes=1 << 16, records=4, buffers=2, input_of=lambda k: None)
        else:
            stash.HiddenStash(
                st, Device(), shape=(1024,), dtype=torch.float32, entries=4, host_bytes=4096, micro_batches=1
            )
    assert len(os.listdir("/proc/self/fd")) == before
    st.close()
