"""Routed expert reads in eval and generation (``inference/routed.py``): with the converted
copy on the storage tier (``io.weights = tier``), a mixture of experts' block is read without its
experts and each experts module reads the experts its tokens reach, when they reach them; the
expert cache keeps the most reached in host memory. Outputs stay transformers' bit for bit
(generation token for token, eval the forward loss), the rows never read hold poison on the
simulated separate device, and the bytes the storage tier counts are the formula's."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from test_generate import _hf_generate
from test_moe import _config, _moe_config

from tiertrain.device import AsyncCpuDevice
from tiertrain.inference import routed
from tiertrain.inference.generate import Sampling, generate

PROMPTS = [list(range(10, 30)), list(range(40, 52))]


def _many_experts(family: str, n: int = 16):
    c = _config(family)
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(c, k, None):
            setattr(c, k, n)
    c.output_router_logits = False  # transformers' generate fails with it; not part of a forward-only run
    c.tie_word_embeddings = False  # the byte formulas count each unit once a pass (a tied head re-reads the embedding)
    return c


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "deepseek_v3", "jetmoe", "llama4_text"])
def wide_moe(request, tmp_path_factory):
    """(family, directory, transformers' model): 16 experts, 2 a token (gpt-oss: biased experts,
    the routing by keyword; DeepSeek-V3: shared experts, grouped routing, a dense first layer;
    JetMoE: the routing as counts, experts in its attention too, of another size; Llama 4: one a
    token, every expert run on every token, those not picked on zeros)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_many_experts(request.param))
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    return request.param, str(d), AutoModelForCausalLM.from_pretrained(d).eval()


@pytest.fixture
def reads(monkeypatch):
    """Every RoutedReads' stats and its file's read bytes, when it closes."""
    seen = []
    close = routed.RoutedReads.close

    def record(self):
        seen.append((self, self.tier.file.workers.stats.snapshot().read_bytes))
        close(self)

    monkeypatch.setattr(routed.RoutedReads, "close", record)
    return seen


def _cfg(tmp_path, path, cache_mib):
    cfg = _moe_config(tmp_path, path)
    cfg.data.micro_batch_size = 2
    cfg.io.weights = "tier"
    cfg.memory.host_param_mib = 0  # every unit read at every pass
    cfg.memory.expert_cache_mib = cache_mib
    return cfg


@pytest.mark.parametrize("cache_mib", [0, 1], ids=["no-cache", "cache"])
def test_generation_reads_the_reached_experts_only_and_is_transformers_generate(
    tmp_path, wide_moe, reads, cache_mib, caplog
):
    _, path, hf = wide_moe
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        ours = generate(_cfg(tmp_path, path, cache_mib), PROMPTS, Sampling(max_new_tokens=10), eos=())
    assert ours == _hf_generate(hf, PROMPTS, 10)
    ((src, file_bytes),) = reads
    s, es = src.stats, src.dtype.itemsize
    experts = [ex for exs in src.by_unit.values() for ex in exs]
    assert 0 < s.reached < s.of  # decoding two rows a step reaches a few of the 16 experts
    _assert_reached_bytes(s, experts, es, s.read_bytes + s.cached_bytes + s.hit_bytes)
    assert (s.cached_bytes > 0) == bool(cache_mib)
    # what the storage tier counted: every unit load, less the experts left out, plus those read
    units = sum(u.numel for u in src.layout.units) * es
    expert_bytes = sum(r.numel for ex in experts for r in ex.records) * es
    passes = 10  # the prefill, then one a token; the last token's pass is not run
    assert file_bytes == passes * units - s.skipped_bytes + s.read_bytes + s.guessed_bytes
    assert s.skipped_bytes == passes * expert_bytes
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("generated"))
    assert re.search(rf"experts: {s.reached} of {s.of} reached and loaded", line)
    assert f"{file_bytes / 1e9:.3f} GB read ({file_bytes / 20 / 1e6:.2f} MB a token)" in line


def _assert_reached_bytes(s, experts, es, got):
    """``got`` bytes are the ``s.reached`` experts' rows (bounded by the smallest and largest
    row where they differ: JetMoE's attention's experts and its MLP's)."""
    rows = {ex.row * es for ex in experts}
    assert min(rows) * s.reached <= got <= max(rows) * s.reached
    if len(rows) == 1:
        assert got == s.reached * rows.pop()


class _Counted(AsyncCpuDevice):
    """The simulated separate device, counting the bytes uploaded."""

    uploaded = 0

    def upload(self, dst, src, *, after=None):
        self.uploaded += src.numel() * src.element_size()
        return super().upload(dst, src, after=after)


@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
@pytest.mark.parametrize("cache_mib", [0, 1], ids=["no-cache", "cache"])
def test_the_rows_never_read_are_never_used_on_a_separate_device(tmp_path, wide_moe, reads, direct, cache_mib):
    """The simulated separate device poisons a slot dropped and a staging buffer given back: the
    experts not reached keep the poison, the reached ones are uploaded after the unit (ordered on
    the streams), through the bounce or from the cache; only what the reads filled is uploaded
    (staged), or the reads go straight into device memory (direct)."""
    _, path, hf = wide_moe
    cfg = _cfg(tmp_path, path, cache_mib)
    dev = _Counted(delay=0.001, direct=direct)
    ours = generate(cfg, PROMPTS, Sampling(max_new_tokens=6), eos=(), device=dev)
    assert ours == _hf_generate(hf, PROMPTS, 6)
    src = reads[0][0]
    assert src.stats.reached < src.stats.of
    if not direct:  # units uploaded without their experts: less than every pass's whole units
        whole = 6 * sum(u.numel for u in src.layout.units) * src.dtype.itemsize
        assert (
            0
            < dev.uploaded
            < whole
            - src.stats.skipped_bytes
            + src.stats.read_bytes
            + src.stats.cached_bytes
            + src.stats.guessed_bytes
            + 1
        )


def test_units_kept_in_host_memory_beside_routed_ones(tmp_path, wide_moe, reads, monkeypatch):
    """The host budget keeps the first units whole (never routed, read once before the passes);
    the rest are routed, and the bytes a pass reads leave the units kept out."""
    from tiertrain.inference import weights
    from tiertrain.runtime import Runtime

    _, path, hf = wide_moe
    cfg = _cfg(tmp_path, path, 0)
    rt = Runtime(cfg)
    try:  # a budget of the embedding and the first block (MiB are too coarse for these units)
        kept = sum(u.numel for u in rt.layout.units[:2]) * rt.dtype.itemsize
    finally:
        rt.close()
    monkeypatch.setattr(weights, "resident_budget", lambda cfg, rt, other=0, host=None: (kept, "the test's"))
    ours = generate(cfg, PROMPTS, Sampling(max_new_tokens=5), eos=())
    assert ours == _hf_generate(hf, PROMPTS, 5)
    ((src, file_bytes),) = reads
    assert src.base_bytes == kept  # the units kept, read once before the passes: not counted in them
    assert 0 not in src.by_unit and 1 not in src.by_unit and src.by_unit  # kept whole: not routed
    rest = sum(u.numel for u in src.layout.units[2:]) * src.dtype.itemsize
    assert (
        0
        < file_bytes - src.base_bytes
        <= 5 * rest - src.stats.skipped_bytes + src.stats.read_bytes + src.stats.guessed_bytes
    )


def test_a_cache_smaller_than_the_experts_reached_evicts_the_least_reached(tmp_path, reads):
    """Experts of 393 KB (64 x 512 x 3 in fp32): a 1 MiB cache holds two. Generation stays
    transformers' while rows are given to experts reached more often."""
    from transformers import AutoModelForCausalLM

    c = _many_experts("qwen3_moe")
    c.moe_intermediate_size = 512
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(c)
    hf.save_pretrained(tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    ours = generate(_cfg(tmp_path, str(tmp_path / "m"), 1), PROMPTS, Sampling(max_new_tokens=10), eos=())
    assert ours == _hf_generate(hf, PROMPTS, 10)
    src = reads[0][0]
    assert len(src.cache.where) == 2 and not src.cache.free
    assert src.cache.evictions > 0 and src.stats.cached_bytes > 0


@pytest.mark.parametrize("parts", [None, 3], ids=["whole", "ranges"])
def test_eval_with_routed_reads_is_transformers_forward_loss(tmp_path, wide_moe, reads, parts):
    from tiertrain.data import EvalSet
    from tiertrain.inference.evaluate import evaluate

    _, path, hf = wide_moe
    text = tmp_path / "held_out.txt"
    text.write_text("".join(f"{i} held-out words, {i * 7 % 5} of them.\n" for i in range(40)))
    cfg = _cfg(tmp_path, path, 0)
    cfg.model.layer_pieces = parts
    cfg.data.eval_corpus, cfg.data.eval_micro_batches = str(text), 0
    res = evaluate(cfg)
    with torch.no_grad():
        want = [float(hf(input_ids=x, labels=y, shift_labels=y).loss) for x, y in EvalSet(cfg.data).micro_batches()]
    assert res.loss == sum(want) / len(want)
    assert res.read_bytes == reads[0][1] and "experts:" in res.experts
    assert "MB a token" in res.line()


def test_the_expert_cache_keeps_the_most_reached():
    cache = routed.ExpertCache(2, 64)
    for key, n in (("a", 3), ("b", 1), ("c", 2)):
        for _ in range(n):
            cache.reached(key)
    assert cache.admit("a") is not None and cache.admit("b") is not None
    assert cache.get("c") is None
    cache.admit("c").fill_(7)  # reached twice, more than b: takes b's row
    assert cache.get("b") is None and int(cache.get("c")[0]) == 7 and cache.get("a") is not None
    cache.reached("d")
    assert cache.admit("d") is None  # reached once, less than every expert kept
    assert routed.ExpertCache(0, 64).admit("a") is None


def test_source_weights_read_whole_units_and_say_how_to_route(tmp_path, wide_moe, caplog):
    _, path, hf = wide_moe
    cfg = _cfg(tmp_path, path, 0)
    cfg.io.weights = "source"
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        ours = generate(cfg, PROMPTS, Sampling(max_new_tokens=3), eos=())
    assert ours == _hf_generate(hf, PROMPTS, 3)
    assert "--io.weights=tier reads only the experts the tokens reach" in caplog.text


def test_routed_reads_off_read_whole_blocks_ahead(tmp_path, wide_moe, reads, caplog):
    _, path, hf = wide_moe
    cfg = _cfg(tmp_path, path, 0)
    cfg.io.routed_experts = False
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        ours = generate(cfg, PROMPTS, Sampling(max_new_tokens=3), eos=())
    assert ours == _hf_generate(hf, PROMPTS, 3)
    assert not reads and "experts:" not in caplog.text


def test_ranges_of_experts_read_the_reached_experts_only(tmp_path, wide_moe, reads):
    """Layers cut into attention and 2 ranges of 8 experts (``model.layer_pieces = 3``): each
    range reads the experts of its own that the routing reaches (gpt-oss: their biases' rows
    too), nothing else of its rows; the tokens are transformers'."""
    family, path, hf = wide_moe
    cfg = _cfg(tmp_path, path, 0)
    cfg.model.layer_pieces = 3
    assert generate(cfg, PROMPTS, Sampling(max_new_tokens=10), eos=()) == _hf_generate(hf, PROMPTS, 10)
    # on the simulated separate device too, with the expert cache: the rows not reached hold poison
    cfg.memory.expert_cache_mib = 1
    dev = _Counted(delay=0.001)
    assert generate(cfg, PROMPTS, Sampling(max_new_tokens=6), eos=(), device=dev) == _hf_generate(hf, PROMPTS, 6)
    assert reads[1][0].stats.cached_bytes > 0 and 0 < reads[1][0].stats.reached < reads[1][0].stats.of
    (src, file_bytes), _ = reads
    s, es = src.stats, src.dtype.itemsize
    experts = [ex for exs in src.by_unit.values() for ex in exs]
    # JetMoE's attention's experts (16, in the attention's unit) are not cut
    assert {ex.n for ex in experts} == ({8, 16} if family == "jetmoe" else {8}) and 0 < s.reached < s.of
    _assert_reached_bytes(s, experts, es, s.read_bytes + s.hit_bytes)
    units = sum(u.numel for u in src.layout.units) * es
    assert file_bytes == 10 * units - s.skipped_bytes + s.read_bytes + s.guessed_bytes
    assert s.skipped_bytes == 10 * sum(r.numel for ex in experts for r in ex.records) * es


@pytest.mark.parametrize("device", ["host", "separate"])
def test_experts_the_passes_reach_again_are_read_ahead_with_their_block(tmp_path, wide_moe, reads, device):
    """Eval in passes of 2 micro-batches of 2 rows: each pass reaches nearly every expert, so
    from the third pass on a block's load reads its last pass's experts with it (guessed), ahead
    of the compute; the loss is transformers' bit for bit, with guesses and without, on the
    simulated separate device too (the rows never read hold poison there); the storage tier counts
    the guessed bytes, and the routing then reads fewer experts itself."""
    from tiertrain.data import EvalSet
    from tiertrain.inference.evaluate import evaluate

    _, path, hf = wide_moe
    text = tmp_path / "held_out.txt"
    text.write_text("".join(f"{i} held-out words, {i * 7 % 5} of them.\n" for i in range(60)))
    want, stats = None, {}
    for guess in (True, False):
        cfg = _cfg(tmp_path, path, 0)
        cfg.data.eval_corpus, cfg.data.eval_micro_batches, cfg.data.micro_batches = str(text), 0, 2
        cfg.memory.device_slots = 2  # fewer slots than units: every unit read at every pass
        cfg.io.guess_experts = guess
        if want is None:
            with torch.no_grad():
                ref = [
                    float(hf(input_ids=x, labels=y, shift_labels=y).loss) for x, y in EvalSet(cfg.data).micro_batches()
                ]
            want, passes = sum(ref) / len(ref), -(-len(ref) // 2)
            assert passes >= 4
        dev = _Counted(delay=0.001) if device == "separate" else None
        assert evaluate(cfg, device=dev).loss == want
        src, file_bytes = reads[-1]
        s, es = src.stats, src.dtype.itemsize
        units = sum(u.numel for u in src.layout.units) * es
        assert file_bytes == passes * units - s.skipped_bytes + s.read_bytes + s.guessed_bytes
        stats[guess] = s
    on, off = stats[True], stats[False]
    assert off.guessed == off.guessed_bytes == off.guess_hits == 0
    assert on.guess_hits > on.guessed // 2 > 0  # most guesses reached
    assert on.reached == off.reached  # the same pairs reached, fewer of them read after the router
    assert on.read_bytes < off.read_bytes and on.read_bytes + on.hit_bytes == off.read_bytes
    assert f"({on.guess_hits} of {on.guessed} reached)" in on.line()
