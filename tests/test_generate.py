"""Generation, layer-major over the batch with weights read unit by unit: token for token what
transformers' `generate` gives on the same model (greedy; one prompt, and prompts of
different lengths padded on the left, split into micro-batches); sampling repeatable by
seed; stop tokens; bad input named."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from reference import small_config

from tiertrain.config import ConfigError, ModelConfig
from tiertrain.inference.generate import Sampling, generate
from tiertrain.inference.prompts import read_prompts
from tiertrain.models import hf_config_from

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], [3, 4, 5, 200]]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request, tmp_path_factory):
    return _model_dir(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """The Llama alone (tests of the command: one model is enough)."""
    return _model_dir("llama", tmp_path_factory)


def _model_dir(kind, tmp_path_factory):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    if kind == "llama":
        hf = AutoModelForCausalLM.from_config(
            hf_config_from(ModelConfig(kind="llama", n_layers=2, d_model=64, n_heads=4, vocab_size=256))
        )
    else:
        hf = GPT2LMHeadModel(
            GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
        )
    d = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(d)
    return str(d), hf.eval()


def _cfg(tmp_path, model_dir, per_micro_batch=2):
    cfg = small_config(tmp_path)
    cfg.model.kind, cfg.model.hf_dir, cfg.data.micro_batch_size = "auto", model_dir, per_micro_batch
    return cfg


def _hf_generate(hf, prompts, n):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return out[:, width:].tolist()


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one", "padded"])
def test_greedy_is_transformers_generate_token_for_token(tmp_path, model_dir, prompts):
    path, hf = model_dir
    ours = generate(_cfg(tmp_path, path), prompts, Sampling(max_new_tokens=10))
    assert ours == _hf_generate(hf, prompts, 10)


@pytest.mark.slow
def test_sampling_repeats_by_seed_and_top_k_1_is_greedy(tmp_path, model_dir):
    path, _ = model_dir
    cfg = _cfg(tmp_path, path)
    s = Sampling(max_new_tokens=12, temperature=1.5, top_k=50, top_p=0.95, seed=7)
    a, b = generate(cfg, PROMPTS, s), generate(cfg, PROMPTS, s)
    assert a == b
    assert generate(cfg, PROMPTS, Sampling(max_new_tokens=12, temperature=1.5, top_k=50, top_p=0.95, seed=8)) != a
    greedy = generate(cfg, PROMPTS, Sampling(max_new_tokens=12))
    assert generate(cfg, PROMPTS, Sampling(max_new_tokens=12, temperature=1.0, top_k=1, seed=3)) == greedy


def test_top_p_keeps_the_tokens_transformers_keeps():
    """At the boundary (tokens ranked above holding exactly top_p, ties) a token more was kept
    than transformers' TopPLogitsWarper keeps: [0.5, 0.25, 0.25] at top_p 0.5 sampled from two."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from tiertrain.inference.generate import _top_p

    g = torch.Generator().manual_seed(0)
    cases = [(torch.tensor([[0.5, 0.25, 0.25]]).log(), 0.5), (torch.tensor([[0.25, 0.5, 0.25]]).log(), 0.75)]
    cases += [(torch.randn(4, 50, generator=g) * 3, p) for p in (0.1, 0.5, 0.9, 0.99)]
    cases += [(torch.zeros(2, 8), 0.5)]  # all tied: 4 of 8 reach it exactly
    for logits, p in cases:
        theirs = TopPLogitsWarper(top_p=p)(None, logits.clone())
        assert torch.equal(_top_p(logits, p).isfinite(), theirs.isfinite()), (logits, p)


def test_a_stop_token_ends_its_row_only(tmp_path, model_dir):
    path, _ = model_dir
    cfg = _cfg(tmp_path, path)
    greedy = generate(cfg, PROMPTS, Sampling(max_new_tokens=10))
    stop = greedy[1][2]  # the third token of the second row
    seen = []
    rows = generate(cfg, PROMPTS, Sampling(max_new_tokens=10, stop=(stop,)), on_tokens=seen.append)
    first = greedy[1].index(stop)
    assert rows[1] == greedy[1][: first + 1]  # kept, then the row ends
    for r in (0, 2):
        want = greedy[r][: greedy[r].index(stop) + 1] if stop in greedy[r] else greedy[r]
        assert rows[r] == want
    assert all(step[1] is None for step in seen[first + 1 : -1])
    assert seen[-1] == []  # the end, said once (a streamed line is ended before the summary is logged)


def test_bad_input_is_named(tmp_path, model_dir):
    path, hf = model_dir
    cfg = _cfg(tmp_path, path)
    with pytest.raises(ConfigError, match="every prompt needs at least one token"):
        generate(cfg, [[1, 2], []])
    limit = getattr(hf.config, "max_position_embeddings", None) or hf.config.n_positions
    with pytest.raises(
        ConfigError,
        match=rf"the longest prompt plus max_new_tokens is {limit + 3} tokens, more than "
        rf"the model's context \({limit}\)",
    ):
        generate(cfg, [[1] * 7], Sampling(max_new_tokens=limit - 4))
    with pytest.raises(ConfigError, match=r"token id 300, outside the model's vocabulary \(0 to 255\)"):
        generate(cfg, [[1, 300]])
    with pytest.raises(ConfigError, match=r"the tokenizer has 300 tokens, more than the model's vocabulary \(256\)"):
        generate(cfg, [[1, 2]], tokenizer_vocab=300)
    with pytest.raises(ConfigError, match="max_new_tokens = 0"):
        Sampling(max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"is 70 tokens, more than the model's context \(64\)"):  # built-in GPT
        generate(small_config(tmp_path), [[1] * 60], Sampling(max_new_tokens=10))
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl, line 2: no \"prompt\" string field"):
        read_prompts(None, str(bad))
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match=r"p.jsonl, line 2: not JSON"):
        read_prompts(None, str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="empty.txt: holds no prompt"):
        read_prompts(None, str(empty))
    # Python API: fields of the wrong type failed deep inside (torch's zeros, topk, a comparison)
    for field, value, want in (("max_new_tokens", 2.5, "a whole number"), ("seed", "1", "a whole number"),
                               ("top_k", 2.5, "a whole number"), ("temperature", "x", "a number"),
                               ("stop", 5, "a tuple of token ids"), ("stop", (1, True), "a tuple of token ids")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"Sampling.{field} = {re.escape(repr(value))}: must be {want}"):
            Sampling(**{field: value})
    with pytest.raises(TypeError, match=r"sampling is a Sampling\(...\), not a dict"):
        generate(_cfg(tmp_path, path), PROMPTS, {"max_new_tokens": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"eos = 5: a tuple of token ids"):
        generate(_cfg(tmp_path, path), PROMPTS, Sampling(max_new_tokens=2), eos=5)  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_command_streams_one_prompt_and_writes_jsonl(tmp_path, llama_dir):
    path, hf = llama_dir
    base = [sys.executable, "-m", "tiertrain", "generate", f"--model.hf_dir={path}", "--max-new-tokens", "5"]
    one = subprocess.run([*base, "--prompt", "Hi"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]
    want = _hf_generate(hf, [list(b"Hi")], 5)[0]  # the byte tokenizer: no tokenizer files in the directory
    assert one.stdout == "Hi" + bytes(want).decode("utf-8", errors="replace") + "\n"  # the prompt, as with several
    # a model that fails before its first token: the error alone (the prompt was printed first, glued to it)
    import shutil

    (tmp_path / "no-weights").mkdir()
    shutil.copy(os.path.join(path, "config.json"), tmp_path / "no-weights")
    bad = [*base[:4], f"--model.hf_dir={tmp_path / 'no-weights'}", *base[5:], "--prompt", "Hi"]
    failed = subprocess.run(bad, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert failed.returncode != 0 and failed.stdout == "" and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hi\nHello there\n")
    out = tmp_path / "out.jsonl"
    many = subprocess.run(
        [*base, "--prompts-file", str(prompts), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert many.returncode == 0, many.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Hi", "Hello there"] and rows[0]["tokens"] == want


def test_each_unit_is_read_once_per_step_for_the_whole_batch(tmp_path, model_dir, caplog):
    """Three micro-batches of one prompt, 6 steps, 3 slots for 4 units: every unit is loaded
    at most once per step (24 loads; the tied GPT-2, 19), not once per micro-batch."""
    path, _ = model_dir
    cfg = _cfg(tmp_path, path, per_micro_batch=1)
    cfg.memory.device_slots, cfg.memory.host_param_mib = 3, 0  # none kept in host memory
    import logging

    with caplog.at_level(logging.INFO, logger="tiertrain"):
        generate(cfg, PROMPTS, Sampling(max_new_tokens=6))
    line = next(r.message for r in caplog.records if r.message.startswith("generated"))
    # GPT-2's head is tied to its embedding: the prefetch counts the head's borrowed embedding as
    # a unit ahead, so the embedding is never evicted between its two visits of a step and the
    # next step's start: after the first step, the three other units take turns in two slots
    loads = 4 + 5 * 3 if "gpt2" in path else 24
    assert "generated 18 tokens for 3 prompts in 6 steps" in line and f"weights: {loads} unit loads" in line, line


def test_the_kv_cache_bytes_are_its_formula(model_dir):
    """The key/value cache is transformers' static one, sized at start: its bytes by formula
    are what it holds."""
    import inspect

    from tiertrain.models.hf import kv_bytes, new_cache

    _, hf = model_dir
    cache = new_cache(hf.config, 7 + 5)
    kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        hf(input_ids=torch.tensor([PROMPTS[0], PROMPTS[0]]), use_cache=True, **{kw: cache})
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == kv_bytes(hf.config, 2, 12, torch.float32) > 0


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["none", "half", "zero"])
def test_the_kv_cache_spilled_to_the_storage_tier_gives_the_same_tokens(tmp_path, model_dir, budget, caplog):
    """memory.kv_host_mib = 0 (every block's keys and values on the storage tier, read in and
    written back every step) or half of them: the tokens of the cache all in memory, sampled
    too; the file's bytes are counted and it is gone afterwards."""
    import logging

    from tiertrain.models.hf import kv_bytes

    path, hf = model_dir
    cfg = _cfg(tmp_path, path, per_micro_batch=2)
    prompts, n = (PROMPTS * 18, 40) if budget == "half" else (PROMPTS, 9)  # 'half': a cache of ~2.5 MiB
    modes = [Sampling(max_new_tokens=n)]
    if budget != "half":  # sampled too (the 'half' case's larger batch: greedy only)
        modes.append(Sampling(max_new_tokens=n, temperature=1.2, top_k=40, seed=4))
    want = [generate(cfg, prompts, m) for m in modes]
    total = sum(
        kv_bytes(hf.config, len(prompts[i : i + 2]), max(map(len, prompts[i : i + 2])) + n, torch.float32)
        for i in range(0, len(prompts), 2)
    )
    cfg.memory.kv_host_mib = {"none": None, "half": (total // 2) >> 20, "zero": 0}[budget]
    assert budget != "half" or cfg.memory.kv_host_mib > 0
    caplog.clear()  # the runs above may have logged too (where an earlier test set the level)
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        got = [generate(cfg, prompts, m) for m in modes]
    assert got == want
    line = next(r.message for r in caplog.records if r.message.startswith("key/value cache:"))
    import re

    host, spilled = map(
        float, re.search(r"cache: ([\d.]+) MiB in host memory, ([\d.]+) MiB on the storage", line).groups()
    )
    done = next(r.message for r in caplog.records if r.message.startswith("generated"))
    read, written = map(float, re.search(r"storage tier: ([\d.]+) MiB read, ([\d.]+) MiB written", done).groups())
    assert host + spilled == pytest.approx(total / 2**20, abs=2e-3)
    if budget == "none":
        assert spilled == read == written == 0
    else:  # each step reads the positions a pair holds and writes the ones it added, never whole regions
        assert spilled > 0 and 0 < written < n * spilled and 0 < read < (n - 1) * spilled, done
    if budget == "zero":  # every pair spilled: bytes by formula, per micro-batch of width w and r rows
        from tiertrain.models.hf import kv_shape

        layers, heads, dim = kv_shape(hf.config)
        want_w = want_r = 0
        for i in range(0, len(prompts), 2):
            rows, w = len(prompts[i : i + 2]), max(map(len, prompts[i : i + 2]))
            per_pos = 2 * rows * heads * dim * 4 * layers
            want_w += (w + n - 1) * per_pos  # the prompt at step 0, one position each step after
            want_r += sum(w + s - 1 for s in range(1, n)) * per_pos  # what is held before each step
        assert written == pytest.approx(want_w / 2**20, abs=2e-3)  # the first run's line (greedy)
        assert read == pytest.approx(want_r / 2**20, abs=2e-3)
    if budget == "zero":
        assert host == 0
    if budget == "half":
        assert 0 < host <= cfg.memory.kv_host_mib
    assert not (tmp_path / "ssd0" / "kv.bin").exists()


class _Layer:
    def __init__(self):
        self.cumulative_length = torch.tensor(0)


class _Cache:
    def __init__(self, layers):
        self.layers = [_Layer() for _ in range(layers)]


@pytest.mark.parametrize("separate", [False, True], ids=["cpu", "separate-device"])
@pytest.mark.parametrize("budget_pairs", [0, 1, 3])
def test_tiered_kv_keeps_what_each_pair_wrote_across_steps(tmp_path, budget_pairs, separate):
    """Two layers x two micro-batches, 0, 1 or 3 pairs in memory (one spilled pair alone: its
    own write-back must finish before it is read again): what a pair's block wrote into its
    keys and values in one step is what it finds there in the next, for 5 steps. On the
    simulated separate-memory device too (uploads and downloads on their streams, fresh device
    memory poisoned): the block works on the device twin, what it wrote reaches the file."""
    from tiertrain.device import AsyncCpuDevice, Device
    from tiertrain.inference.kvcache import TieredKV

    shape = (2, 2, 8, 4)  # rows, heads, max_len, head dim
    pair = 2 * torch.Size(shape).numel() * 4
    caches = [_Cache(2), _Cache(2)]
    dev = AsyncCpuDevice() if separate else Device()
    with TieredKV(
        caches,
        [2, 2],
        [8, 8],
        kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        dev=dev,
        budget=budget_pairs * pair,
        path=str(tmp_path),
        checksum=True,
    ) as kv:
        assert (kv.device_pool is not None) == (separate and budget_pairs < 4)
        assert kv.host_bytes == budget_pairs * pair and kv.spilled_bytes == (4 - budget_pairs) * pair
        for step in range(5):
            for layer in range(2):
                for m in range(2):
                    kv.bring(layer, m)
                    lay = caches[m].layers[layer]
                    want = float(10 * layer + m) if step else 0.0
                    assert torch.all(lay.keys[:, :, :step] == want) and torch.all(lay.values[:, :, :step] == -want)
                    lay.keys[:, :, step], lay.values[:, :, step] = 10 * layer + m, -(10 * layer + m)
                    kv.send(layer, m, 1)
        spilled = 4 - budget_pairs
        pos = pair // 8  # one position of a pair: the unit of what is read and written
        assert kv.read_bytes >= spilled * (1 + 2 + 3 + 4) * pos  # before steps 1..4: what each pair held
    assert kv.written_bytes == spilled * 5 * pos  # one new position a step, never the whole region
    dev.close()
    assert not (tmp_path / "kv.bin").exists()


@pytest.mark.slow
def test_a_row_ends_at_the_models_end_of_sequence_token_as_in_transformers(tmp_path, llama_dir):
    """The end-of-sequence ids of generation_config.json (a list, as chat models have) end a row
    by default, as transformers' generate does (same tokens, row by row); --ignore-eos goes on
    to max_new_tokens; a stop id outside the vocabulary is refused."""
    import shutil

    from transformers import AutoModelForCausalLM

    src, _ = llama_dir
    d = tmp_path / "m"
    shutil.copytree(src, d)
    cfg = _cfg(tmp_path, str(d))
    free = generate(cfg, PROMPTS, Sampling(max_new_tokens=10, stop_at_eos=False))
    eos = [free[1][2], 255]  # the second row's third token, and one never generated
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": 0}))
    rows = generate(cfg, PROMPTS, Sampling(max_new_tokens=10))
    assert rows[1] == free[1][:3]
    hf = AutoModelForCausalLM.from_pretrained(d).eval()  # its generation config read from the directory
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    theirs = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)[:, width:].tolist()
    for ours, t in zip(rows, theirs):  # transformers pads a row that ended; ours just ends
        assert t[: len(ours)] == ours and all(x == 0 for x in t[len(ours) :]), (ours, t)
    assert generate(cfg, PROMPTS, Sampling(max_new_tokens=10, stop_at_eos=False)) == free
    with pytest.raises(ConfigError, match=r"stop token id 300 is outside the model's vocabulary \(0 to 255\)"):
        generate(cfg, PROMPTS, Sampling(max_new_tokens=3, stop=(300,)))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiertrain",
            "generate",
            f"--model.hf_dir={d}",
            "--prompt",
            "ab",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
            f"--io.paths={tmp_path / 's'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "end-of-sequence" not in r.stderr, r.stderr[-2000:]


def test_a_streamed_completion_prints_whole_characters(capsys):
    """One prompt is printed as it comes: each token decoded alone printed 'caf\ufffd\ufffd' for
    'café' from the byte tokenizer (and ran SentencePiece's words together). What is printed is
    the completion decoded whole, a character cut between tokens held back until complete."""
    from tiertrain.data import load_tokenizer
    from tiertrain.inference.prompts import StreamedText

    tok = load_tokenizer("bytes")
    ids = tok.encode("café ☕ ok")
    show = StreamedText(tok, "> ")
    seen = []
    for i in ids:
        show([i])
        seen.append(capsys.readouterr().out)
    show([None])  # the row stopped (others go on)
    show([])
    assert "".join(seen) + capsys.readouterr().out == "> café ☕ ok\n"
    assert all("\ufffd" not in s for s in seen) and seen[3] == "" and seen[4] == "é"  # é: two bytes


def test_ctrl_c_mid_stream_ends_the_line(monkeypatch, capsys):
    """Ctrl-C while one prompt's completion streamed left stdout without its newline (the shell's
    prompt glued to the text); the line is ended, and the interrupt goes on as it was."""
    import tiertrain.inference.prompts as prompts
    from tiertrain.config import load_config

    def cut(cfg, ps, sampling, *, on_tokens=None, **kw):
        on_tokens([ps[0][0]])
        on_tokens([ps[0][1]])
        raise KeyboardInterrupt

    monkeypatch.setattr(prompts, "generate", cut)
    with pytest.raises(KeyboardInterrupt):
        prompts.run_generate(load_config(None, []), ["ab"], prompts.Sampling(max_new_tokens=4))
    assert capsys.readouterr().out == "abab\n"


def test_odd_prompts_and_padding_ids(tmp_path, llama_dir):
    """A config's pad_token_id of -1 (some converted Llamas) padded rows of unequal prompts with
    -1: an IndexError deep in the embedding (a device assert on CUDA); tuple prompts passed the
    check, then failed to concatenate; a negative id went to the embedding unchecked."""
    from tiertrain.config import ConfigError

    path, hf = llama_dir
    d = tmp_path / "pad"
    shutil.copytree(path, d)
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "pad_token_id": -1}))
    want = _hf_generate(hf, PROMPTS, 4)
    assert generate(_cfg(tmp_path, str(d)), PROMPTS, Sampling(max_new_tokens=4)) == want
    assert generate(_cfg(tmp_path, path), [tuple(p) for p in PROMPTS], Sampling(max_new_tokens=4)) == want
    with pytest.raises(ConfigError, match=r"a prompt holds token id -2, outside the model's vocabulary \(0 to 255\)"):
        generate(_cfg(tmp_path, path), [[1, -2, 3]], Sampling(max_new_tokens=2))


def test_a_text_prompt_is_encoded_as_the_tokenizer_does_by_default(tmp_path, llama_dir):
    """`generate --prompt X` encoded X without the tokenizer's special tokens: a Llama's or
    Gemma's BOS was missing, so the model got other ids than `model.generate(**tok(X))`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from tiertrain.inference.prompts import run_generate

    path, hf = llama_dir
    d = tmp_path / "with-bos"
    shutil.copytree(path, d)
    words = ["<unk>", "<s>", "</s>", "hello", "world", "how", "are", "you"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    enc = tok("hello world how", return_tensors="pt")
    assert enc["input_ids"][0, 0].item() == 1  # the BOS the tokenizer adds
    want = hf.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, enc["input_ids"].shape[1] :]
    cfg = _cfg(tmp_path, str(d))
    cfg.data.tokenizer = str(d)  # (as the config finds it in the model's directory)
    run_generate(cfg, ["hello world how"], Sampling(max_new_tokens=4), out=str(tmp_path / "o.jsonl"))
    assert json.loads((tmp_path / "o.jsonl").read_text())["tokens"] == want.tolist()


def test_a_seed_past_64_bits_and_a_generation_config_that_is_no_object_are_named(tmp_path, llama_dir):
    """--seed 18446744073709551616 overflowed in torch's generator (a traceback); a
    generation_config.json holding a list was said to be "not valid JSON"."""
    from tiertrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"seed = 18446744073709551616: must be between 0 and"):
        Sampling(seed=2**64)
    path, _ = llama_dir
    d = tmp_path / "m"
    shutil.copytree(path, d)
    (d / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"generation_config.json is not a JSON object \(a list\)"):
        generate(_cfg(tmp_path, str(d)), PROMPTS[:1], Sampling(max_new_tokens=2))


def test_a_model_that_samples_is_said_to_be_decoded_greedily_without_a_temperature(tmp_path, llama_dir, capsys):
    """transformers' generate samples where the model's generation_config.json says do_sample
    (Llama 3 Instruct: temperature 0.6, top_p 0.9); tiertrain decodes greedily unless told: said,
    with the flags that sample as the model asks, only where no --temperature was given."""
    from tiertrain.cli import main
    from tiertrain.inference.generate import model_sampling

    path, _ = llama_dir
    d = tmp_path / "m"
    shutil.copytree(path, d)
    assert model_sampling(str(d)) == {} and model_sampling(None) == {}
    (d / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6, "top_p": 0.9}')
    assert model_sampling(str(d)) == {"temperature": 0.6, "top_k": 50.0, "top_p": 0.9}  # transformers' top_k default
    flags = ["generate", f"--model.hf_dir={d}", f"--io.paths={tmp_path / 's'}", "--max-new-tokens", "2",
             "--data.seq_len=32", "--prompt", "hi"]  # fmt: skip
    assert main(flags) == 0
    assert "give --temperature 0.6 --top-k 50 --top-p 0.9 to sample as it does" in capsys.readouterr().err
    assert main([*flags, "--temperature", "0"]) == 0
    assert "to sample as it does" not in capsys.readouterr().err


def test_the_models_repetition_penalty_is_applied_as_transformers_generate_applies_it(tmp_path, llama_dir, caplog):
    """transformers' generate applies generation_config.json's repetition_penalty (Qwen2.5
    Instruct ships 1.05) to greedy decoding too; tiertrain ignored it without a word (the tokens
    differed from the fourth). Now taken as transformers takes it, with padded rows; 1 turns it
    off; settings transformers applies and tiertrain does not are named."""
    import logging

    from transformers import AutoModelForCausalLM

    path, _ = llama_dir
    d = tmp_path / "m"
    shutil.copytree(path, d)
    (d / "generation_config.json").write_text('{"repetition_penalty": 1.8, "no_repeat_ngram_size": 0}')
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    assert hf.generation_config.repetition_penalty == 1.8
    penalised = _hf_generate(hf, PROMPTS, 12)
    cfg = _cfg(tmp_path, str(d))
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        assert generate(cfg, PROMPTS, Sampling(max_new_tokens=12), eos=()) == penalised
    assert "repetition_penalty 1.8, the model's generation_config.json's" in caplog.text
    assert "transformers' generate applies and tiertrain's does not" not in caplog.text  # 0: nothing set
    hf.generation_config.repetition_penalty = 1.0
    plain = _hf_generate(hf, PROMPTS, 12)
    assert plain != penalised
    assert generate(cfg, PROMPTS, Sampling(max_new_tokens=12, repetition_penalty=1.0), eos=()) == plain
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="repetition_penalty = .*: must be a positive finite number"):
            Sampling(repetition_penalty=bad)
    with pytest.raises(ConfigError, match="Sampling.repetition_penalty = '2': must be a number"):
        Sampling(repetition_penalty="2")
    (d / "generation_config.json").write_text('{"no_repeat_ngram_size": 3, "num_beams": 1}')
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        generate(cfg, PROMPTS[:1], Sampling(max_new_tokens=2), eos=())
    assert "sets no_repeat_ngram_size = 3, which transformers' generate applies" in caplog.text
    assert "num_beams" not in caplog.text and "repetition_penalty" not in caplog.text


def test_a_field_the_models_config_class_does_not_have_does_not_size_the_cache(tmp_path, tmp_path_factory):
    """A GPT-2 config.json holding num_key_value_heads (GPT-2 ignores it; configs shared between
    models carry one): the cache was sized for 2 heads and generation failed at its first step
    (index_copy_: destination slice 1 2 16, source 1 4 16)."""
    path, hf = _model_dir("gpt2", tmp_path_factory)
    with open(os.path.join(path, "config.json")) as f:
        conf = json.load(f)
    d = tmp_path / "gpt2"
    shutil.copytree(path, d)
    (d / "config.json").write_text(json.dumps({**conf, "num_key_value_heads": 2}))
    assert generate(_cfg(tmp_path, str(d)), PROMPTS, Sampling(max_new_tokens=6)) == _hf_generate(hf, PROMPTS, 6)
