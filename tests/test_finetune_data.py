"""Fine-tuning data: JSONL (text, prompt/completion, chat), Parquet and datasets directories
prepared into examples with loss masks (checked token by token), packed or padded rows over
seeded epochs, the loss as the mean over a step's scored tokens (however the step is cut), exact
resume mid-epoch, and every bad-data error by its message."""

import json
import os

import numpy as np
import pytest
import torch
from reference import assert_resume_exact, reference_model, small_config, weights_of

from tiertrain.data.examples import IGNORE, ExampleBatches, PreparedExamples
from tiertrain.data.formats import DataError
from tiertrain.data.prepare import prepare_examples

WORDS = [
    "[UNK]",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "hello",
    "world",
    "how",
    "are",
    "you",
    "fine",
    "thanks",
    "say",
    "yes",
    "no",
    "be",
    "brief",
    "the",
    "sky",
    "is",
    "blue",
    ".",
]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tokenizer(directory, chat=True):
    """A word-level tokenizer built here with `tokenizers` (EOS '</s>'), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>", additional_special_tokens=WORDS[2:6]
    )
    if chat:
        fast.chat_template = TEMPLATE
    fast.save_pretrained(directory)
    return str(directory)


def ids(text):
    return [WORDS.index(w) for w in text.split()]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine thanks"},
    ]
}


def _prepared(tmp_path, rows, name="d", **kw):
    tok = make_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    meta = prepare_examples([src], str(tmp_path / name), tokenizer=tok, progress=False, **kw)
    return PreparedExamples(str(tmp_path / name)), meta


def _example(p, i):
    a, b = int(p.offsets[i]), int(p.offsets[i + 1])
    return list(p.ids[a:b]), list(p.mask[a:b])


def test_text_completion_and_chat_masks_token_by_token(tmp_path):
    p, meta = _prepared(tmp_path, [{"text": "the sky is blue ."}], "t")
    assert meta["kind"] == "text" and _example(p, 0) == (ids("the sky is blue . </s>"), [1] * 6)
    p, meta = _prepared(
        tmp_path, [{"prompt": "say yes", "completion": "yes"}, {"prompt": "say no", "completion": "no ."}], "c"
    )
    assert meta["kind"] == "completion" and meta["examples"] == 2
    assert _example(p, 0) == (ids("say yes yes </s>"), [0, 0, 1, 1])
    assert _example(p, 1) == (ids("say no no . </s>"), [0, 0, 1, 1, 1])
    p, meta = _prepared(tmp_path, [CHAT], "chat")
    got, mask = _example(p, 0)
    want = ids(
        "<|system|> be brief <|end|> <|user|> hello <|end|> <|assistant|> hello world <|end|> <|user|> how are "
        "you <|end|> <|assistant|> fine thanks <|end|>"
    )
    assert got == want
    scored = [w for w, m in zip(got, mask) if m]  # the replies and their end marks, not the headers
    assert scored == ids("hello world <|end|> fine thanks <|end|>")
    p, _ = _prepared(tmp_path, [CHAT], "chat-all", mask_prompt=False)
    assert _example(p, 0)[1] == [1] * len(want)


@pytest.mark.slow
def test_parquet_and_a_datasets_directory_give_the_jsonl_examples(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "say yes", "completion": "yes"}, {"prompt": "how are you", "completion": "fine thanks ."}] * 3
    tok = make_tokenizer(tmp_path / "tok")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet", row_group_size=2)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    out = {}
    for name, src in [
        ("jsonl", write_jsonl(tmp_path / "r.jsonl", rows)),
        ("parquet", str(tmp_path / "r.parquet")),
        ("datasets", str(tmp_path / "ds")),
    ]:
        prepare_examples([src], str(tmp_path / f"out-{name}"), tokenizer=tok, progress=False)
        p = PreparedExamples(str(tmp_path / f"out-{name}"))
        out[name] = [_example(p, i) for i in range(p.count)]
    assert out["jsonl"] == out["parquet"] == out["datasets"] and len(out["jsonl"]) == 6
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"holds several splits \(train\); give one of them, e\.g\. .*dd/train"):
        prepare_examples([str(tmp_path / "dd")], str(tmp_path / "x"), tokenizer=tok, progress=False)


@pytest.mark.parametrize(
    "rows, kw, match",
    [
        (  # (parsed with its newline: "Expecting ',' delimiter at column 1")
            ['{"text": "hello"}', '{"text": "hello"'],
            {},
            r"b\.jsonl, line 2: invalid JSON \(Expecting ',' delimiter at column 17\)",
        ),
        (['{"text": "hel\tlo"}'], {}, r"line 1: invalid JSON \(Invalid control character at column 14\)"),
        (
            ['{"prompt": "say yes", "completion": "yes"}', '{"prompt": "say no"}'],
            {},
            r"b\.jsonl, line 2: no 'completion' field \(completion data; the row has 'prompt'\)",
        ),
        (['{"prompt": "say yes", "completion": ""}'], {}, r"line 1: field 'completion' is empty"),
        (['{"text": 5}'], {}, r"line 1: field 'text' must be a string, got int"),
        (['{"question": "x"}'], {}, r"line 1: cannot tell the data's format from its fields \('question'\)"),
        (['{"messages": [{"role": "user", "content": "hello"}]}'], {}, r"line 1: no assistant message with content"),
        (['{"messages": [{"role": "bot", "content": "hello"}]}'], {}, r"messages\[0\] must be an object with 'role'"),
        ([json.dumps(CHAT)], {"chat": False}, r"line 1: chat data needs a tokenizer with a chat template"),
        (['{"text": "hello"}'], {"kind": "chat"}, r"line 1: no 'messages' field \(chat data"),
    ],
)
def test_bad_data_is_named_by_file_line_and_field(tmp_path, rows, kw, match):
    tok = make_tokenizer(tmp_path / "tok", chat=kw.pop("chat", True))
    (tmp_path / "b.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=match):
        prepare_examples([str(tmp_path / "b.jsonl")], str(tmp_path / "out"), tokenizer=tok, progress=False, **kw)
    assert not (tmp_path / "out" / "meta.json").exists()  # nothing half-written is taken for prepared


def test_a_damaged_prepared_directory_is_refused(tmp_path):
    from tiertrain.errors import UsageError

    _prepared(tmp_path, [{"text": "hello world"}] * 4, "d")
    mask = tmp_path / "d" / "mask.bin"
    raw = bytearray(mask.read_bytes())
    raw[3] ^= 1
    mask.write_bytes(bytes(raw))
    with pytest.raises(UsageError, match=r"mask\.bin does not match its checksum; the file is corrupt"):
        PreparedExamples(str(tmp_path / "d"))
    mask.write_bytes(bytes(raw[:-2]))
    with pytest.raises(UsageError, match=r"mask\.bin is 10 bytes, expected 12; it is truncated"):
        PreparedExamples(str(tmp_path / "d"))


def _batches(p, **kw):
    args = dict(seq_len=6, micro_batch_size=2, micro_batches=2, seed=3, packing=True, long_examples="truncate")
    return ExampleBatches(p, **{**args, **kw})


def test_packed_rows_follow_each_epochs_order_with_the_mask_on_targets(tmp_path):
    rows = [{"prompt": "say " + w, "completion": w} for w in ("yes", "no", "hello", "world", "fine")]
    p, _ = _prepared(tmp_path, rows)
    b = _batches(p)
    assert b.epoch_tokens == 20 and b.rows_per_epoch == 3  # (20 - 1) // 6
    for e in range(3):  # every example once per epoch, the order a permutation of its own
        order, starts = b._epoch(e)
        assert sorted(order) == list(range(5))
        stream = np.concatenate([p.ids[p.offsets[i] : p.offsets[i + 1]] for i in order])
        smask = np.concatenate([p.mask[p.offsets[i] : p.offsets[i + 1]] for i in order])
        for j in range(3):
            x, m = b._row(e * 3 + j)
            assert list(x) == list(stream[j * 6 : j * 6 + 7]) and list(m) == list(smask[j * 6 : j * 6 + 7])
    assert list(b._epoch(0)[0]) != list(b._epoch(1)[0]) or list(b._epoch(1)[0]) != list(b._epoch(2)[0])
    (x, y), _ = b.batches(0)
    row, mask = b._row(0)
    assert x[0].tolist() == list(row[:-1])
    assert y[0].tolist() == [t if k else IGNORE for t, k in zip(row[1:], mask[1:])]
    assert b.scored(0) == sum(int(b._row(i)[1][1:].sum()) for i in range(4))
    # ranks: 2 ranks x M = 1 see exactly the rows of 1 rank x M = 2, in C order
    r = _batches(p, micro_batches=1)
    assert [t.tolist() for t in r.batches(1, rank=1, world=2)[0]] == [t.tolist() for t in b.batches(1)[1]]


def test_a_packed_documents_first_token_is_no_target_of_the_document_before(tmp_path):
    """Text rows packed with attention within each document: the end of document A was trained
    to predict document B's first token, which it cannot see (padded rows, and transformers'
    DataCollatorWithFlattening, never score it); with attention over the whole row, it can."""
    words = ("hello world", "the sky is blue", "fine", "how are you")
    p, _ = _prepared(tmp_path, [{"text": w} for w in words])
    for by_document in (True, False):
        b = _batches(p, seq_len=8, micro_batch_size=1, micro_batches=1, by_document=by_document)
        order, starts = b._epoch(0)
        for j in range(b.rows_per_epoch):
            ((x, y),) = b.batches(j)
            for pos in range(1, 9):  # target pos - 1 is the token at pos of the row
                at_start = j * 8 + pos in starts
                scored = bool(b._row(j)[1][pos]) if not at_start else not by_document
                assert (y[0, pos - 1] != IGNORE).item() == scored, (by_document, j, pos)
            assert b.scored(j) == int((y != IGNORE).sum())


def test_padded_rows_hold_one_example_and_long_ones_are_cut_or_dropped(tmp_path, caplog):
    import logging

    rows = [
        {"prompt": "say yes", "completion": "yes"},
        {"text": "the sky is blue . the sky is blue ."},
        {"prompt": "say no", "completion": "no"},
    ]
    tok = make_tokenizer(tmp_path / "tok")
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::2]))
    prepare_examples([str(tmp_path / "m.jsonl")], str(tmp_path / "pc"), tokenizer=tok, progress=False)
    p = PreparedExamples(str(tmp_path / "pc"))
    b = _batches(p, packing=False, micro_batch_size=1, micro_batches=1)
    assert b.rows_per_epoch == 2
    x, m = b._row(0)
    ex = _example(p, b._epoch(0)[0][0])
    assert list(x[: len(ex[0])]) == ex[0] and set(x[len(ex[0]) :]) == {1} and set(m[len(ex[1]) :]) == {0}
    ((xs, ys),) = b.batches(0)
    assert (ys[0] == IGNORE).sum() == 6 - 2  # 6 targets: the completion and its EOS scored, not the rest
    # an 11-token text example in rows of 7: cut (its first 7 tokens) or dropped, and said
    p2, _ = _prepared(tmp_path, [rows[1], {"text": "hello world"}], "long")
    caplog.set_level(logging.INFO, logger="tiertrain")
    cut = _batches(p2, packing=False, micro_batch_size=1, micro_batches=1)
    assert "1 of 2 examples are longer than seq_len + 1 = 7 tokens: cut to that length" in caplog.text
    assert cut.rows_per_epoch == 2 and int(cut.lengths.max()) == 7
    drop = _batches(p2, packing=False, micro_batch_size=1, micro_batches=1, long_examples="drop")
    assert drop.rows_per_epoch == 1 and "dropped" in caplog.text


def test_padded_rows_masks_follow_a_resumes_origin(tmp_path):
    """A run resumed with another global batch (other micro-batches, rows or ranks) reads on from
    the checkpoint's row; the pad masks (a mixture's auxiliary loss counts no pad) were taken from
    the rows a fresh run would have read at that step: another row's length, a silent 0.5% off the
    loss of a Qwen2-MoE resumed from 2 micro-batches to 1."""
    rows = [{"prompt": "say " + "yes " * (i % 4), "completion": "no " * (1 + i % 3)} for i in range(12)]
    p, _ = _prepared(tmp_path, rows)
    fresh, resumed = (_batches(p, packing=False, micro_batch_size=1, micro_batches=2, seq_len=12) for _ in "ab")
    resumed.resume_at(1, 6)  # its step 1 reads rows 6-9 (2 ranks) or 6-7 (1): a fresh run's steps 3 and 4
    for (rank, world), step in (((0, 1), 3), ((0, 2), 3), ((1, 2), 4)):
        got, want = resumed.attention(1, rank=rank, world=world), fresh.attention(step)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (rank, world)
        for (x, y), (x2, y2) in zip(resumed.batches(1, rank=rank, world=world), fresh.batches(step), strict=True):
            assert torch.equal(x, x2) and torch.equal(y, y2)  # the same rows: their masks are theirs
    assert any(not torch.equal(g, w) for g, w in zip(resumed.attention(1), fresh.attention(1)))  # (the case bites)


def _finetune_cfg(tmp_path, corpus, tok_dir, micro_batches=2, micro_batch_size=2, kind="llama", **kw):
    cfg = small_config(tmp_path, kind=kind, micro_batches=micro_batches, steps=3, **kw)
    cfg.data.corpus, cfg.data.tokenizer, cfg.data.seq_len = corpus, tok_dir, 12
    cfg.data.micro_batch_size, cfg.model.vocab_size = micro_batch_size, len(WORDS)
    return cfg


ROWS = (
    [
        {"prompt": "say yes", "completion": "yes"},
        {"prompt": "how are you", "completion": "fine thanks ."},
        {"text": "the sky is blue ."},
        CHAT,
    ]
    * 4
)[:-1]


def _finetune_data(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    pc = write_jsonl(tmp_path / "pc.jsonl", [r for r in ROWS if "prompt" in r])
    chat = write_jsonl(tmp_path / "chat.jsonl", [r for r in ROWS if "messages" in r])
    return tok, pc, chat


@pytest.mark.parametrize("rows", ["packed-document", "packed-row", "padded"])
@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt2"])
def test_masked_fine_tuning_is_bit_identical_to_plain_pytorch(tmp_path, kind, rows, monkeypatch):
    """Chat rows (JSONL, prepared on the fly into the cache) fine-tuned with masked targets: the
    losses and weights of plain PyTorch computing the same loss (summed cross-entropy over the
    step's scored tokens; packed rows with attention within each document: the model given the
    same restarting position ids), bit for bit in fp32."""
    from test_parity import assert_parity

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, _, chat = _finetune_data(tmp_path)
    # GPT-2 ties its embedding to its head: one micro-batch (with several, plain PyTorch sums the
    # two gradients in another order: tests/test_parity.py's one stated exception)
    cfg = _finetune_cfg(tmp_path, chat, tok, kind=kind, micro_batches=1 if kind == "gpt2" else 2)
    cfg.data.packing = rows != "padded"
    cfg.data.packed_attention = "row" if rows == "packed-row" else "document"
    _, losses = assert_parity(cfg)
    assert all(np.isfinite(v) for step in losses for v in step)
    assert (tmp_path / "cache" / "tiertrain" / "prepared").is_dir()


def test_the_loss_and_gradients_do_not_depend_on_the_micro_batch_split(tmp_path):
    """A step of 8 rows as 4 micro-batches of 2, 2 of 4 and 1 of 8 (rows with different numbers
    of scored tokens): the loss (the mean over the step's scored tokens) and every gradient
    agree to float rounding (rtol 1e-6): each micro-batch's summed cross-entropy is divided by
    the step's count, never by its own."""
    tok, pc, _ = _finetune_data(tmp_path)
    prepare_examples([pc], str(tmp_path / "pc"), tokenizer=tok, progress=False)
    got = []
    for m, b in [(4, 2), (2, 4), (1, 8)]:
        cfg = _finetune_cfg(tmp_path, str(tmp_path / "pc"), tok, micro_batches=m, micro_batch_size=b)
        cfg.data.packing = False
        from tiertrain.data import open_corpus

        data = open_corpus(cfg.data)
        model = reference_model(cfg)
        scored, loss = data.scored(0), 0.0
        for x, y in data.batches(0):
            part = model(x, y, scored)
            part.backward()
            loss += part.item()
        got.append((loss, [p.grad.clone() for p in model.parameters()]))
    for loss, grads in got[1:]:
        assert loss == pytest.approx(got[0][0], rel=1e-6)
        for g, g0 in zip(grads, got[0][1]):
            torch.testing.assert_close(g, g0, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_resume_mid_epoch_is_bit_identical(tmp_path):
    """Packed prompt/completion examples, 3 rows per epoch and 4 rows a step: the checkpoint at
    step 2 falls inside the third epoch; the resumed run's losses and weights equal the
    straight run's."""
    tok, pc, _ = _finetune_data(tmp_path)
    prepare_examples([pc], str(tmp_path / "pc"), tokenizer=tok, progress=False)
    a = _finetune_cfg(tmp_path / "a", str(tmp_path / "pc"), tok)
    b = _finetune_cfg(tmp_path / "b", str(tmp_path / "pc"), tok)
    from tiertrain.data import open_corpus

    rows = open_corpus(a.data).rows_per_epoch
    assert 4 * 2 % rows != 0  # the split point is inside an epoch
    assert_resume_exact(a, b, steps=4, split=2)


def test_validation_loss_on_examples_is_the_mean_over_scored_tokens(tmp_path):
    """data.eval_corpus as prepared examples: the validation loss equals plain PyTorch's summed
    cross-entropy over every evaluated micro-batch's scored targets over their count."""
    from tiertrain.data import EvalSet
    from tiertrain.models import build_model, tensor_source
    from tiertrain.training.trainer import Trainer

    tok, pc, _ = _finetune_data(tmp_path)
    prepare_examples([pc], str(tmp_path / "pc"), tokenizer=tok, progress=False)
    cfg = _finetune_cfg(tmp_path, str(tmp_path / "pc"), tok, kind="gpt")
    cfg.data.eval_corpus, cfg.data.eval_micro_batches, cfg.train.eval_every = str(tmp_path / "pc"), 0, 1
    ref = reference_model(cfg)
    ev = EvalSet(cfg.data)
    total, count = 0.0, 0
    with torch.no_grad():
        positions = ev.positions()
        assert positions is not None  # packed, attention within each document
        for (x, y), pos in zip(ev.micro_batches(), positions):
            total += float(ref(x, y, 1, pos))  # divisor 1: the summed cross-entropy
            count += int((y != IGNORE).sum())
    skeleton, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    cfg.train.steps = 1
    with Trainer(cfg, weights=tensor_source(skeleton, weights_of(ref))) as tr:
        tr.initialize(progress=False)
        from tiertrain.inference.validation import validation_loss

        got = validation_loss(tr.evalset, tr.executor, cfg.data.micro_batches)
    assert ev.total_scored() == count and got == pytest.approx(total / count, rel=1e-6)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_masked_targets_through_a_vocabulary_cut_into_pieces(tmp_path, kind, monkeypatch):
    """The head cut into 3 vocabulary pieces (its own pass-2 gradient, masked targets' rows
    zeroed) against plain PyTorch on the same masked chat data, SGD at lr 0.5 (the loss falls
    to 0.08 in 3 steps, rounding grows with it): losses within 1e-5 relative, weights within 1e-5 of how far they moved (the cut head's stated tolerance,
    tests/test_pieces.py)."""
    from reference import reference_train
    from test_pieces import _rel, _train_cut

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, _, chat = _finetune_data(tmp_path)
    cfg = _finetune_cfg(tmp_path, chat, tok, kind=kind, lr=0.5)
    cfg.optim.name, cfg.optim.momentum = "sgd", 0.9
    ref = reference_model(cfg)
    init = weights_of(ref)
    ref_losses, ref_w = reference_train(cfg, ref)
    losses, w, names, tr = _train_cut(cfg, init, 3)
    assert len(tr.model.head_pieces) == 3
    assert _rel(losses, ref_losses) < 1e-5
    for n, t in w.items():
        theirs = ref_w[names[n] if names else n]
        moved = (theirs - init[names[n] if names else n]).norm()
        assert (t - theirs).norm() <= 1e-5 * moved + 1e-12, n


@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt2"])
def test_packed_documents_do_not_see_each_other(tmp_path, kind):
    """A row packing document A (5 tokens) and document B (7), positions restarting at B: B's
    logits are those of B run alone (to 1e-5), and changing A's tokens leaves them as they are;
    with positions 0 .. T-1 ('row') they change."""
    from tiertrain.models.base import document_mask

    cfg = small_config(tmp_path, kind=kind)
    model = reference_model(cfg).eval()
    a, b = [5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26]
    pos = torch.tensor([list(range(5)) + list(range(7))])

    def logits(ids, positions=None):
        x = torch.tensor([ids])
        if kind == "gpt":
            h = model.embed(x, positions)
            for blk in model.blocks:
                h = blk(h, positions)
            return model.head.logits(h)[0]
        return model.hf(input_ids=x, position_ids=positions).logits[0]

    with torch.no_grad():
        alone = logits(b)
        packed = logits(a + b, pos)
        other = logits([40, 41, 42, 43, 44] + b, pos)
        across = logits(a + b)
    torch.testing.assert_close(packed[5:], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(other[5:], packed[5:], atol=1e-5, rtol=0)
    assert (across[5:] - alone).abs().max() > 1e-3
    assert document_mask(pos)[0, 0, 6].tolist() == [False] * 5 + [True, True] + [False] * 5


def test_a_packed_micro_batchs_mask_is_made_once(tmp_path, monkeypatch):
    """Llama, packed rows with attention within documents, 2 micro-batches through 3 blocks
    (forward, recompute and backward): transformers builds the block-diagonal mask once per
    micro-batch (each build costs a device-to-host sync on a GPU), not once per block."""
    from test_parity import run_tiertrain

    import tiertrain.models.masks as masks

    made = []
    real, keyword = masks._makers()

    def counting(**kw):
        made.append(kw["position_ids"] is not None)
        return real[masks.FULL](**kw)

    monkeypatch.setattr(masks, "_makers", lambda: ({masks.FULL: counting}, keyword))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, _, chat = _finetune_data(tmp_path)
    cfg = _finetune_cfg(tmp_path, chat, tok, kind="llama", layers=3)
    cfg.train.steps = 1
    run_tiertrain(cfg, weights_of(reference_model(cfg)))
    assert made.count(True) == cfg.data.micro_batches == 2


def test_a_non_utf8_byte_is_named_by_its_line(tmp_path):
    """A text stream decodes ahead in blocks: the bad byte on line 3 was reported "after line 0"."""
    tok = make_tokenizer(tmp_path / "tok")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "one"}\n{"text": "two"}\n{"text": "thr\xffee"}\n')
    with pytest.raises(DataError, match=r"b\.jsonl, line 3: not UTF-8 \(byte 14 of the line"):
        prepare_examples([str(tmp_path / "b.jsonl")], str(tmp_path / "out"), tokenizer=tok, progress=False)


def test_a_tokenizer_replaced_at_the_same_path_prepares_the_rows_again(tmp_path, monkeypatch):
    """The prepared-data cache is keyed on the tokenizer's files' contents, not its path: a
    tokenizer replaced in place gives new ids (it reused the old ones without a word)."""
    import shutil

    from tiertrain.config import DataConfig
    from tiertrain.data.loader import open_corpus

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rows = write_jsonl(tmp_path / "r.jsonl", [{"text": "hello world how are you"}] * 4)
    tok = make_tokenizer(tmp_path / "tok")
    cfg = DataConfig(corpus=rows, tokenizer=tok, seq_len=8, micro_batch_size=1)
    first = open_corpus(cfg)
    assert open_corpus(cfg).data.path == first.data.path  # reused while unchanged
    shutil.rmtree(tok)
    global WORDS
    saved = WORDS
    try:
        WORDS = saved[:6] + list(reversed(saved[6:]))  # the same words, other ids
        make_tokenizer(tmp_path / "tok")
    finally:
        WORDS = saved
    second = open_corpus(cfg)
    assert second.data.path != first.data.path
    assert list(second.data.ids[:5]) != list(first.data.ids[:5])


def test_a_models_own_tokenizer_is_used_for_its_text(tmp_path):
    """A model directory that holds a tokenizer tokenizes its training and evaluation text with
    it when data.tokenizer is unset (eval used bytes while generate used the directory's)."""
    from transformers import AutoModelForCausalLM

    from tiertrain.config import ModelConfig, load_config
    from tiertrain.inference.evaluate import evaluate
    from tiertrain.models import hf_config_from

    d = tmp_path / "m"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        hf_config_from(ModelConfig(kind="llama", n_layers=1, d_model=32, n_heads=2, vocab_size=len(WORDS)))
    ).save_pretrained(d)
    make_tokenizer(d)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["hello world how are you fine thanks"] * 20))
    flags = [
        f"--model.hf_dir={d}",
        f"--data.eval_corpus={text}",
        "--data.seq_len=16",
        "--data.micro_batch_size=1",
        "--data.eval_micro_batches=0",
        f"--io.paths={tmp_path / 's'}",
    ]
    cfg = load_config(None, flags)
    assert cfg.data.tokenizer == str(d)
    res = evaluate(cfg)
    assert res.tokens == (140 - 1) // 16 * 16  # words, not bytes (the text has 140 words, 700 bytes)
    assert res.loss == evaluate(load_config(None, [*flags, f"--data.tokenizer={d}"])).loss
    assert load_config(None, [*flags, "--data.tokenizer=bytes"]).absolute().data.tokenizer == "bytes"  # bytes asked for


def test_a_damaged_prepared_cache_entry_is_prepared_again(tmp_path, monkeypatch, caplog):
    """A truncated token file in the prepared-data cache (which the user never made by hand) is
    found at the next run, said, and prepared again: the rows are the same as before. The
    refusal told the user to run `tiertrain prepare`, which does not touch the cache."""
    import logging
    import os

    from tiertrain.data.loader import prepared_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, _, chat = _finetune_data(tmp_path)
    cfg = _finetune_cfg(tmp_path, chat, tok)
    out = prepared_cache(cfg.data, chat, "data.corpus")
    ids = os.path.join(out, "ids.tokens")
    whole = open(ids, "rb").read()
    with open(ids, "r+b") as f:
        f.truncate(len(whole) - 7)
    with caplog.at_level(logging.WARNING, logger="tiertrain"):
        assert prepared_cache(cfg.data, chat, "data.corpus") == out
    assert "is damaged" in caplog.text and "truncated" in caplog.text, caplog.text
    assert open(ids, "rb").read() == whole


def test_data_prepared_with_another_tokenizer_is_refused_and_its_own_settings_said(tmp_path, caplog):
    """A directory or token file `tiertrain prepare` made with another tokenizer (bytes, by
    default) than the run's: its ids were read as this tokenizer's, silently (another vocabulary
    entirely). And a prepared directory's loss mask and format are its own: settings asking
    otherwise were ignored without a word."""
    from tiertrain.config import ConfigError
    from tiertrain.data import open_corpus
    from tiertrain.data.prepare import prepare

    tok, pc, _ = _finetune_data(tmp_path)
    as_bytes = str(tmp_path / "bytes")
    prepare_examples([pc], as_bytes, tokenizer=None, progress=False)
    cfg = _finetune_cfg(tmp_path, as_bytes, tok)
    with pytest.raises(ConfigError, match=r"was prepared with tokenizer 'bytes', not this run's data.tokenizer"):
        open_corpus(cfg.data)
    text = tmp_path / "t.txt"
    text.write_text("hello world how are you fine thanks " * 20)
    prepare([str(text)], str(tmp_path / "t.tok"))  # bytes: a vocabulary of 256
    cfg.data.corpus = str(tmp_path / "t.tok")
    with pytest.raises(
        ConfigError, match=rf"holds token ids of a vocabulary of 256 .* \({len(WORDS)}\); prepare it again"
    ):
        open_corpus(cfg.data)
    mine = str(tmp_path / "mine")
    prepare_examples([pc], mine, tokenizer=tok, progress=False, mask_prompt=False)
    cfg.data.corpus, cfg.data.format = mine, "text"
    with caplog.at_level("WARNING", logger="tiertrain"):
        open_corpus(cfg.data)  # this tokenizer's: read as prepared
    assert (
        "is used as it was prepared: data.mask_prompt = True (prepared with False) and data.format = 'text' (prepared as 'completion') not applied"
        in caplog.text
    )


def _bos_tokenizer(directory, eos_too=False):
    """make_tokenizer's words with a BOS '<s>' that tokenizer(text) puts first (Llama's
    post-processor), and its EOS after where ``eos_too`` (a Llama tokenizer's add_eos_token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = WORDS + ["<s>"]
    bos, eos = len(WORDS), WORDS.index("</s>")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    single = "<s> $A </s>" if eos_too else "<s> $A"
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", bos), ("</s>", eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    return str(directory), fast


def _first(directory):
    """The first example's ids and mask of a prepared directory, as lists."""
    d = PreparedExamples(str(directory))
    a, b = int(d.offsets[0]), int(d.offsets[1])
    return d.ids[a:b].tolist(), d.mask[a:b].tolist()


@pytest.mark.parametrize("eos_too", [False, True])
def test_texts_and_prompts_begin_as_the_tokenizer_begins_them(tmp_path, eos_too, caplog):
    """A text row and a prompt were tokenized without the special tokens tokenizer(text) adds:
    a Llama or Gemma tokenizer's BOS was missing (TRL's and transformers' fine-tuning give it;
    Gemma is trained on inputs it never sees at inference). Now: tokenizer(text)'s ids, with one
    EOS at the end (an EOS the tokenizer adds itself is not doubled). A directory prepared before
    (no lead in its metadata) is said to lack it."""
    from tiertrain.data import open_corpus

    tok, fast = _bos_tokenizer(tmp_path / "tok", eos_too)
    eos = WORDS.index("</s>")
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": "the sky is blue"}] * 4)
    prepare_examples([src], str(tmp_path / "t"), tokenizer=tok, progress=False)
    want = fast("the sky is blue")["input_ids"]
    want = want if want[-1] == eos else want + [eos]
    assert want[0] == len(WORDS) and want.count(eos) == 1
    assert _first(tmp_path / "t")[0] == want
    src = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "say yes", "completion": "yes"}])
    prepare_examples([src], str(tmp_path / "c"), tokenizer=tok, progress=False)
    ids, mask = _first(tmp_path / "c")
    assert ids == [len(WORDS), *map(WORDS.index, ["say", "yes", "yes"]), eos]
    assert mask == [0, 0, 0, 1, 1]
    meta_path = tmp_path / "t" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["lead"] == [len(WORDS)]
    cfg = _finetune_cfg(tmp_path, str(tmp_path / "t"), tok)
    with caplog.at_level("WARNING", logger="tiertrain"):
        open_corpus(cfg.data)
    assert "BOS" not in caplog.text
    del meta["lead"]  # as an earlier tiertrain wrote it
    meta_path.write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="tiertrain"):
        open_corpus(cfg.data)
    assert (
        f"was prepared by an earlier tiertrain without the tokenizer's BOS (id {len(WORDS)}) before each text"
        in caplog.text
    )


SEED = 2  # data.seed whose order takes scored steps first (the test needs some done before)


def test_a_step_without_a_scored_token_is_found_at_start_or_stops_the_run_with_its_work_saved(tmp_path, monkeypatch):
    """Rows whose prompt fills data.seq_len score nothing; a step of only such rows has no loss.
    It stopped the run where it fell (step 194 of a 200-step run: 93 steps lost since the last
    checkpoint, and resuming met it again). Now the steps are checked before the first (none of
    the run directory made); past the rows checked, the run stops there with its steps saved."""
    from tiertrain.data import examples
    from tiertrain.data.examples import UnscoredStep
    from tiertrain.training.trainer import Trainer

    tok = make_tokenizer(tmp_path / "tok")
    rows = [{"prompt": "say yes", "completion": "yes"}] * 6 + [{"prompt": "how are you " * 6, "completion": "fine"}] * 6
    cfg = _finetune_cfg(tmp_path, write_jsonl(tmp_path / "r.jsonl", rows), tok, micro_batches=1, micro_batch_size=1)
    cfg.data.packing, cfg.train.steps, cfg.checkpoint.every, cfg.data.seed = False, 24, 0, SEED
    with Trainer(cfg) as tr, pytest.raises(UnscoredStep, match=r"data: \d+ of steps 1-24 have no scored token"):
        tr.run()
    assert not os.path.exists(cfg.train.run_dir)
    monkeypatch.setattr(examples, "CHECK_ROWS", 1)  # the first step alone checked: the rest met as they come
    with Trainer(cfg) as tr:
        first_bad = tr.corpus.unscored_steps(0, 24)[0]
        assert first_bad > 1, tr.corpus.unscored_steps(0, 24)  # (the seed's order: scored steps first)
        with pytest.raises(UnscoredStep, match=rf"data: step {first_bad + 1} has no scored token"):
            tr.run()
    from tiertrain.checkpoint import Manifest, latest_checkpoint

    assert Manifest.read(latest_checkpoint(cfg.checkpoint_root)).step == first_bad  # every step done, kept


def test_a_conversation_opening_with_the_assistant_scores_its_reply_not_the_header(tmp_path):
    """The header the template puts before the first message (here the assistant's role mark)
    was scored: the span began at 0. Also where the template puts a default system prompt
    before a conversation that does not open with one."""
    opening = {"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "say yes"},
                            {"role": "assistant", "content": "yes"}]}  # fmt: skip
    p, _ = _prepared(tmp_path, [opening], "open")
    got, mask = _example(p, 0)
    assert got == ids("<|assistant|> hello <|end|> <|user|> say yes <|end|> <|assistant|> yes <|end|>")
    assert [w for w, m in zip(got, mask) if m] == ids("hello <|end|> yes <|end|>")
    tok = make_tokenizer(tmp_path / "tok-sys")
    cfg_path = tmp_path / "tok-sys" / "tokenizer_config.json"
    conf = json.loads(cfg_path.read_text())
    conf["chat_template"] = "{% if messages[0]['role'] != 'system' %}<|system|> be brief <|end|> {% endif %}" + TEMPLATE
    cfg_path.write_text(json.dumps(conf))
    for f in (tmp_path / "tok-sys").glob("chat_template.*"):
        f.unlink()
    src = write_jsonl(tmp_path / "open2.jsonl", [opening])
    prepare_examples([src], str(tmp_path / "open2"), tokenizer=tok, progress=False)
    got, mask = _example(PreparedExamples(str(tmp_path / "open2")), 0)
    assert got[:4] == ids("<|system|> be brief <|end|>")
    assert [w for w, m in zip(got, mask) if m] == ids("hello <|end|> yes <|end|>")


def test_errors_about_rows_prepared_into_the_cache_name_the_users_file(tmp_path, monkeypatch):
    """Rows given as JSONL are prepared into the cache; an error about them named only the cache
    entry (a hashed directory the user never made), not the file they gave."""
    from tiertrain.data import open_corpus
    from tiertrain.errors import UsageError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, pc, _ = _finetune_data(tmp_path)
    cfg = _finetune_cfg(tmp_path, pc, tok)
    cfg.data.seq_len, cfg.data.packing, cfg.data.long_examples = 2, False, "drop"
    with pytest.raises(UsageError, match=rf"every example of {pc} \(prepared in .*cache.*\) is longer"):
        open_corpus(cfg.data)


def test_the_prepared_data_cache_removes_copies_unused_for_a_month(tmp_path, monkeypatch):
    """Every new input (or setting) added a copy to the cache, and none was ever removed. A copy
    unused for 30 days goes when another is made; a copy used again is kept (its use touches it)."""
    import time

    from tiertrain.data import open_corpus

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, pc, chat = _finetune_data(tmp_path)
    root = tmp_path / "cache" / "tiertrain" / "prepared"
    entry_of = lambda corpus, **kw: open_corpus(_finetune_cfg(tmp_path, corpus, tok, **kw).data).data.path  # noqa: E731
    pc_copy, chat_copy = entry_of(pc), entry_of(chat)
    month = time.time() - 31 * 86400
    for entry in (pc_copy, chat_copy):
        os.utime(entry, (month, month))
    import tiertrain.data.loader as loader

    check = loader._damaged

    def checked_while_touched(out):  # the long check runs with the entry already marked used (another
        assert os.stat(out).st_mtime > time.time() - 60  # process pruning meanwhile would remove it)
        return check(out)

    monkeypatch.setattr(loader, "_damaged", checked_while_touched)
    assert entry_of(chat) == chat_copy  # used again: touched
    # a preparation killed two days ago (no metadata: never pruned), one under way now, not ours
    killed, running, other = root / "00112233aabbccdd", root / "99112233aabbccdd", root / "mine"
    for d in (killed, running, other):
        d.mkdir()
        (d / "mask.bin.tmp4194305").write_bytes(b"x")
    for d in (killed, other):
        os.utime(d, (time.time() - 2 * 86400,) * 2)
    cfg = _finetune_cfg(tmp_path, pc, tok)
    cfg.data.mask_prompt = False  # another setting: a third copy, made now
    third = open_corpus(cfg.data).data.path
    kept = (chat_copy, third, running, other)
    assert sorted(os.listdir(root)) == sorted(os.path.basename(p) for p in kept)


def test_what_a_killed_prepare_left_is_removed_by_the_next(tmp_path):
    """`prepare` killed before its rename left OUT.tmpPID (a full-size copy) for good, and an
    in-cache preparation its rows' mask.bin.tmpPID and offsets.bin.tmpPID: the next removes those
    of writers no longer running."""
    import subprocess
    import sys

    from tiertrain.cli import main

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has ended
    (tmp_path / "a.txt").write_text("in the beginning " * 50)
    for name in (f"a.tokens.tmp{pid}", f"a.tokens.tmp{os.getppid()}"):  # the second: a writer still running
        (tmp_path / name).write_bytes(bytes(1000))
    assert main(["prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "a.tokens")]) == 0
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("a.tokens")) == [
        "a.tokens",
        f"a.tokens.tmp{os.getppid()}",
    ]
    rows = [{"prompt": "say yes", "completion": "yes"}] * 3
    out = tmp_path / "rows"
    out.mkdir()
    (out / f"mask.bin.tmp{pid}").write_bytes(bytes(10))
    (out / f"offsets.bin.tmp{pid}").write_bytes(bytes(10))
    tok = make_tokenizer(tmp_path / "tok")
    prepare_examples([write_jsonl(tmp_path / "r.jsonl", rows)], str(out), tokenizer=tok, progress=False)
    assert not [n for n in os.listdir(out) if ".tmp" in n], os.listdir(out)


def test_json_lines_under_json_or_upper_case_names_are_rows(tmp_path, capsys):
    """`prepare --input rows.json` (JSON Lines under .json, as datasets' to_json writes it) or
    rows.JSONL wrote a token file of the raw JSON text and said "wrote N tokens"; a prompts file
    .JSONL gave each JSON line as a literal prompt. A JSON array is refused, saying what to give."""
    from tiertrain.cli import main
    from tiertrain.inference.prompts import read_prompts

    tok = make_tokenizer(tmp_path / "tok")
    for name in ("rows.json", "rows.JSONL"):
        src = write_jsonl(tmp_path / name, [{"prompt": "say yes", "completion": "yes"}])
        assert main(["prepare", "--input", src, "--output", str(tmp_path / f"out-{name}"), "--tokenizer", tok]) == 0
        assert PreparedExamples(str(tmp_path / f"out-{name}")).count == 1
    (tmp_path / "array.json").write_text(json.dumps([{"text": "hello world"}]))
    assert (
        main(["prepare", "--input", str(tmp_path / "array.json"), "--output", str(tmp_path / "o"), "--tokenizer", tok])
        == 1
    )
    assert "array.json: a JSON array; give JSON Lines" in capsys.readouterr().err
    prompts = write_jsonl(tmp_path / "p.JSONL", [{"prompt": "hello"}])
    assert read_prompts(None, prompts) == ["hello"]


def test_held_out_examples_with_an_unscored_micro_batch_or_too_few_for_the_ranks(tmp_path):
    """An eval micro-batch whose every target was masked (its completion cut off) stopped the run
    at its first validation, as if a training step had none ("data: step 1 has no scored
    token", with a checkpoint "the last the data lets this run take"); fewer eval micro-batches
    than ranks divided by zero there. A set of some unscored micro-batches validates; one of
    none scored, or too small for the ranks, is refused at start."""
    import math

    from tiertrain.config import ConfigError
    from tiertrain.data import EvalSet
    from tiertrain.inference.validation import validation_loss
    from tiertrain.training.trainer import Trainer

    tok = make_tokenizer(tmp_path / "tok")
    long_prompt = {"prompt": "how are you how are you how are you", "completion": "fine"}
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [long_prompt, {"prompt": "say", "completion": "yes"}])
    cfg = _finetune_cfg(tmp_path, mixed, tok, micro_batches=1, micro_batch_size=1)
    cfg.data.seq_len, cfg.data.packing, cfg.data.long_examples = 4, False, "truncate"
    cfg.data.eval_corpus, cfg.data.eval_micro_batches, cfg.train.eval_every, cfg.train.steps = mixed, 0, 1, 1
    ev = EvalSet(cfg.data)
    assert ev.count == 2 and ev.total_scored() == 2  # one micro-batch scores "yes" and its EOS, one nothing
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        assert math.isfinite(validation_loss(tr.evalset, tr.executor, 1))
    with pytest.raises(
        ConfigError, match=r"data.eval_corpus gives 2 micro-batch\(es\) of 1 rows, fewer than the 3 ranks"
    ):
        EvalSet(cfg.data, world=3)
    cfg.data.eval_corpus = write_jsonl(tmp_path / "cut.jsonl", [long_prompt])
    with pytest.raises(ConfigError, match=r"data.eval_corpus: every target of its 1 micro-batch\(es\) is masked"):
        EvalSet(cfg.data)


def test_a_damaged_cache_entry_is_made_again_and_a_failed_prepare_keeps_the_earlier_one(tmp_path, monkeypatch):
    """A flipped byte in a cache entry's mask.bin (not a token file) failed every run, telling the
    user to prepare again what they never prepared: it is made again. `prepare --output DIR`
    over an earlier preparation with a bad row deleted that one's metadata before reading any
    row: DIR was left unusable."""
    from tiertrain.data import open_corpus

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, pc, _ = _finetune_data(tmp_path)
    cfg = _finetune_cfg(tmp_path, pc, tok)
    entry = open_corpus(cfg.data).data.path
    with open(os.path.join(entry, "mask.bin"), "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    assert open_corpus(cfg.data).data.path == entry  # made again, read whole
    out = str(tmp_path / "prepared")
    prepare_examples([pc], out, tokenizer=tok, progress=False)
    before = PreparedExamples(out).count
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "say yes", "completion": "yes"}, {"nothing": 1}])
    with pytest.raises(Exception, match=r"bad.jsonl, line 2"):
        prepare_examples([bad], out, tokenizer=tok, progress=False)
    assert PreparedExamples(out).count == before
    prepare_examples([pc], out, tokenizer=tok, progress=False)  # an earlier preparation: replaced


def test_prepare_never_writes_into_a_directory_of_other_files(tmp_path):
    """`prepare --output DIR` replaced a user's meta.json and scattered its files into a model
    directory; refused, the files left as they were. A new or empty directory, or an earlier
    preparation, takes them."""
    from tiertrain.errors import UsageError

    tok, pc, _ = _finetune_data(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "meta.json").write_text('{"mine": 1}')
    with pytest.raises(
        UsageError, match=r"holds files that are not an earlier preparation \(a meta.json not tiertrain's\)"
    ):
        prepare_examples([pc], str(mine), tokenizer=tok, progress=False)
    assert os.listdir(mine) == ["meta.json"] and (mine / "meta.json").read_text() == '{"mine": 1}'
    with pytest.raises(
        UsageError, match=r"holds files that are not an earlier preparation \(chat_template.jinja, tokenizer.json"
    ):
        prepare_examples([pc], tok, tokenizer=tok, progress=False)  # the tokenizer's directory
    assert "ids.tokens" not in os.listdir(tok)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".DS_Store").write_bytes(b"\0")  # a system's hidden file: no one's data
    prepare_examples([pc], str(tmp_path / "empty"), tokenizer=tok, progress=False)


def test_rows_a_tokenizer_or_its_template_cannot_take_are_named(tmp_path):
    """A lone surrogate (valid JSON, no text) failed inside the tokenizer with a traceback that
    named no row; a chat template's raise_exception (Gemma's "System role not supported") too;
    a chat tokenizer without EOS padded rows with -1 (an IndexError in the embedding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiertrain.data.formats import DataError

    tok = make_tokenizer(tmp_path / "tok")
    (tmp_path / "s.jsonl").write_text('{"text": "hello world"}\n{"text": "hello \\ud83d world"}\n')
    with pytest.raises(DataError, match=r"s.jsonl, line 2: field 'text' holds a lone surrogate \(U\+D83D at char"):
        prepare_examples([str(tmp_path / "s.jsonl")], str(tmp_path / "s"), tokenizer=tok, progress=False)
    strict = PreTrainedTokenizerFast.from_pretrained(tok)
    strict.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + TEMPLATE
    )  # noqa: E501
    strict.save_pretrained(tmp_path / "strict")
    src = write_jsonl(tmp_path / "c.jsonl", [CHAT])
    with pytest.raises(
        DataError,
        match=r"c.jsonl, line 1: the tokenizer's chat template refuses this conversation: System role not supported",
    ):  # noqa: E501
        prepare_examples([src], str(tmp_path / "c"), tokenizer=str(tmp_path / "strict"), progress=False)
    strict.chat_template = TEMPLATE + "{% endfor %}"  # a template that does not parse: not the conversation's fault
    strict.save_pretrained(tmp_path / "broken")
    with pytest.raises(
        DataError, match=r"^the tokenizer's chat template does not parse \(.*, line 1 of the template\)"
    ):
        prepare_examples([src], str(tmp_path / "c"), tokenizer=str(tmp_path / "broken"), progress=False)
    plain = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    no_eos = PreTrainedTokenizerFast(tokenizer_object=plain, unk_token="[UNK]", additional_special_tokens=WORDS[2:6])
    no_eos.chat_template = TEMPLATE
    no_eos.save_pretrained(tmp_path / "no-eos")
    prepare_examples([src], str(tmp_path / "n"), tokenizer=str(tmp_path / "no-eos"), progress=False)
    b = _batches(PreparedExamples(str(tmp_path / "n")), seq_len=64, micro_batch_size=1, micro_batches=1, packing=False)
    ((x, _),) = b.batches(0)
    assert int(x.min()) >= 0


def test_errors_of_rows_a_run_prepares_name_its_settings(tmp_path, monkeypatch):
    """Rows a run prepares into its cache: an empty file said "prepare: the input holds no
    example; nothing written to ~/.cache/tiertrain/prepared/<key>", and a directory that is no
    tokenizer was "prepare --tokenizer", options of a command the user never ran."""
    from tiertrain.data import open_corpus
    from tiertrain.errors import UsageError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, pc, _ = _finetune_data(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UsageError, match=rf"^data.corpus = {empty} holds no example; give rows$"):
        open_corpus(_finetune_cfg(tmp_path, str(empty), tok).data)
    (tmp_path / "not-a-tokenizer").mkdir()
    (tmp_path / "not-a-tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(Exception, match=r"^data.tokenizer = ") as got:
        open_corpus(_finetune_cfg(tmp_path, pc, str(tmp_path / "not-a-tokenizer")).data)
    assert "prepare" not in str(got.value)


def test_bars_are_drawn_only_where_stderr_is_a_terminal(tmp_path, capsys):
    """Python API: prepare_examples, Trainer.initialize, and the weights loads of eval and
    generate drew their bars into a redirected stderr (carriage-return redraws in a log file),
    though their progress argument was left at its default; training's own bar did not."""
    from reference import small_config

    from tiertrain.data.prepare import prepare_examples
    from tiertrain.training.trainer import Trainer

    tok = make_tokenizer(tmp_path / "tok")
    src = tmp_path / "rows.jsonl"
    write_jsonl(src, [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(8)])
    prepare_examples([str(src)], str(tmp_path / "out"), tokenizer=str(tok))
    with Trainer(small_config(tmp_path, steps=1)) as tr:
        tr.initialize()
    err = capsys.readouterr().err
    assert "prepare" not in err and "init weights" not in err and "\r" not in err, err


@pytest.mark.slow
def test_a_resume_with_another_global_batch_goes_on_with_the_next_row(tmp_path):
    """Two steps of 4 rows, resumed with 2 rows a step (fewer micro-batches, or fewer ranks):
    the next step read rows 4-5 again (row = step x the new batch) and the epoch went back; the
    other way rows were skipped. Now the checkpoint records the rows read, and the resumed run
    takes the rows a straight run of its batch would have taken after them."""

    from tiertrain.checkpoint import Manifest, latest_checkpoint
    from tiertrain.data import open_corpus
    from tiertrain.training.trainer import Trainer

    tok, pc, _ = _finetune_data(tmp_path)
    prepare_examples([pc], str(tmp_path / "pc"), tokenizer=tok, progress=False)
    a = _finetune_cfg(tmp_path / "a", str(tmp_path / "pc"), tok, micro_batches=2, micro_batch_size=2)
    a.train.steps = 2
    with Trainer(a) as tr:
        tr.run()
    assert Manifest.read(latest_checkpoint(a.checkpoint_root)).rows == 8
    b = _finetune_cfg(tmp_path / "b", str(tmp_path / "pc"), tok, micro_batches=1, micro_batch_size=2)
    b.train.steps = 4
    with Trainer(b) as tr:
        tr.restore(a.train.run_dir)
        seen = [tr.corpus.batches(s) for s in (2, 3)]
        epochs = [tr.corpus.epoch_of(s) for s in (2, 3)]
        tr.train_step(), tr.train_step()
        assert tr.save_checkpoint().path and Manifest.read(latest_checkpoint(b.checkpoint_root)).rows == 12
    data = open_corpus(b.data)
    straight = [data._row(g)[0] for g in range(8, 12)]  # the rows after the checkpoint's 8, in order
    got = [row for step in seen for x, _ in step for row in x.numpy()]
    assert len(got) == 4 and all(np.array_equal(g, s[:-1]) for g, s in zip(got, straight))
    assert epochs == [10 / data.rows_per_epoch, 12 / data.rows_per_epoch]  # on from the checkpoint's 8 rows


def test_rows_edited_with_their_old_time_and_rows_changed_before_a_resume_are_not_taken_silently(
    tmp_path, monkeypatch, caplog
):
    """Found from outside: rows edited in place at the same size with their modification time put
    back (cp -p, rsync -t, touch -r) were taken from the prepared-data cache as before (the old
    rows trained on); and rows grown between a checkpoint and its resume went on at the old row
    count over a reshuffled epoch without a word. The cache's key has the change time (no user
    sets it), and the checkpoint records the rows' content: a resume over other rows says so."""
    import logging

    from tiertrain.config import DataConfig
    from tiertrain.data.loader import open_corpus
    from tiertrain.training.trainer import Trainer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok = make_tokenizer(tmp_path / "tok")
    rows = tmp_path / "r.jsonl"
    write_jsonl(rows, [{"text": "hello world how are you"}] * 4)
    cfg = DataConfig(corpus=str(rows), tokenizer=tok, seq_len=8, micro_batch_size=1)
    first = open_corpus(cfg)
    st = os.stat(rows)
    write_jsonl(rows, [{"text": "world hello you are how"}] * 4)  # the same size, other rows
    os.utime(rows, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = open_corpus(cfg)
    assert second.data.path != first.data.path and second.identity != first.identity

    write_jsonl(tmp_path / "pc.jsonl", [r for r in ROWS if "prompt" in r])
    a = _finetune_cfg(tmp_path / "a", str(tmp_path / "pc.jsonl"), tok)
    with Trainer(a) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        saved = tr.save_checkpoint()
    caplog.set_level(logging.WARNING, logger="tiertrain")
    with Trainer(a) as tr:  # the same rows: nothing said
        tr.restore(saved.path)
    assert not [r for r in caplog.records if "data.corpus changed" in r.message]
    write_jsonl(tmp_path / "pc.jsonl", [r for r in ROWS if "prompt" in r] * 3)
    with Trainer(a) as tr:
        tr.restore(saved.path)
    said = [r.message for r in caplog.records if "data.corpus changed" in r.message]
    assert said and "since the checkpoint of step 1 (then: 8 examples" in said[0], said
    assert "now: 24 examples" in said[0] and "rows may be read twice or never" in said[0], said


def test_a_token_across_the_start_of_a_reply_is_scored_as_transformers_marks_it(tmp_path):
    """Found from outside: a template whose header ends with a newline, a reply that starts with
    one and a tokenizer with a '\\n\\n' token: that token holds the reply's first character and
    transformers' assistant mask (return_assistant_tokens_mask) marks it; it was left unscored."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from tiertrain.data.formats import Renderer
    from tiertrain.data.tokenizer import load_tokenizer

    special = ["</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["para one\n\npara two\n\n\nthree"] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", additional_special_tokens=special[1:])
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    fast.save_pretrained(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for reply in ("\n\npara two", "para two"):
        msgs = [{"role": "user", "content": "para"}, {"role": "assistant", "content": reply}]
        want = hf.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ex = Renderer(load_tokenizer(str(tmp_path / "tok")))("rows.jsonl, line 1", {"messages": msgs})
        assert ex.ids.tolist() == list(want["input_ids"])
        assert ex.mask.tolist() == list(want["assistant_masks"]), [hf.decode([i]) for i in ex.ids]
