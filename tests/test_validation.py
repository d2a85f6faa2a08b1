"""The validation loss: the executor's forward alone (``evaluate``) gives a training step's
losses on the same batches, bit for bit; ``train.eval_every`` takes plain PyTorch's loss on
the held-out windows of ``data.eval_corpus``; bad settings and corpora are named."""

import json
import os

import pytest
import torch
from reference import HFWrapper, reference_model, reference_train, small_config, weights_of
from test_dist_group import spawn

from tiertrain.config import Config, ConfigError, DataConfig
from tiertrain.data import EvalSet
from tiertrain.device import AsyncCpuDevice
from tiertrain.dist import RankGroup
from tiertrain.models import build_model, tensor_source
from tiertrain.training.trainer import Trainer

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n" for i in range(60))


def _held_out(tmp_path) -> str:
    path = tmp_path / "held_out.txt"
    path.write_text(TEXT)
    return str(path)


@pytest.mark.parametrize("case", ["gpt", "llama-pieces", "overlap", "separate"])
def test_evaluate_gives_the_training_steps_losses(tmp_path, case):
    """Before each step, ``evaluate`` on the step's batches gives the losses the step then
    reports, bit for bit: the same kernels, layer-major; with the vocabulary cut into pieces,
    with the overlapped update still writing the units it loads, on a separate-memory device."""
    kind = "gpt" if case == "gpt" else "llama"
    cfg = small_config(tmp_path, kind=kind, layers=2, micro_batches=2, steps=3)
    if case == "llama-pieces":
        cfg.model.vocab_pieces = 3
    if case == "overlap":
        cfg.update.mode = "overlap"
    dev = AsyncCpuDevice(delay=0.001) if case == "separate" else None
    with Trainer(cfg, device=dev) as tr:
        tr.initialize(progress=False)
        for step in range(cfg.train.steps):
            ev = tr.executor.evaluate(tr.corpus.batches(step))
            rec = tr.train_step()
            assert ev == rec.extra["losses"], (step, ev, rec.extra["losses"])


def test_validation_loss_is_plain_pytorchs_on_the_held_out_windows(tmp_path):
    """eval_every = 2 over 4 steps: validation after steps 2 and 4, in the record, the per-step
    line and metrics.jsonl; after step 4 it is plain PyTorch's mean loss on the same windows
    with the weights plain training reached, bit for bit in fp32."""
    cfg = small_config(tmp_path, kind="llama", layers=2, micro_batches=2, steps=4)
    cfg.data.eval_corpus, cfg.data.eval_micro_batches, cfg.train.eval_every = _held_out(tmp_path), 3, 2
    ref_model = reference_model(cfg)
    init = weights_of(ref_model)
    _, trained = reference_train(cfg, ref_model)  # on a copy: its final weights by name
    (ref_model.hf if isinstance(ref_model, HFWrapper) else ref_model).load_state_dict(trained)
    evalset = EvalSet(cfg.data)
    assert evalset.count == 3
    ref_model.eval()
    with torch.no_grad():
        want = sum(float(ref_model(x, y)) for x, y in evalset.micro_batches()) / 3
    skeleton, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    with Trainer(cfg, weights=tensor_source(skeleton, init)) as tr:
        records = tr.run()
    got = {r.step: r.extra.get("eval_loss") for r in records}
    assert got[1] is None and got[3] is None and got[2] is not None
    assert got[4] == want and got[2] > got[4]
    assert f"val {got[4]:.4f}" in records[-1].line(4)
    with open(os.path.join(cfg.train.run_dir, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [r.get("extra", r).get("eval_loss") for r in logged][1] == got[2]


def test_eval_set_windows_are_consecutive_and_split_over_ranks(tmp_path):
    cfg = DataConfig(
        corpus="bundled",
        eval_corpus=_held_out(tmp_path),
        seq_len=16,
        micro_batch_size=3,
        micro_batches=2,
        eval_micro_batches=0,
    )
    es = EvalSet(cfg)
    tokens = torch.from_numpy(es.corpus.tokens.astype("int64"))
    assert es.count == ((len(tokens) - 1) // 16) // 3 and es.count >= 5
    whole = es.micro_batches()
    xs = torch.cat([x.reshape(-1) for x, _ in whole])
    assert torch.equal(xs, tokens[: es.count * 3 * 16])  # every window once, in order
    assert all(torch.equal(y[:, :-1], x[:, 1:]) for x, y in whole)
    parts = [es.micro_batches(r, 3) for r in range(3)]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == es.count // 3  # as many on every rank
    assert torch.equal(parts[1][0][0], whole[1][0]) and torch.equal(parts[0][1][0], whole[3][0])


def test_bad_validation_settings_are_named(tmp_path):
    cfg = small_config(tmp_path)
    tree = cfg.to_dict()
    tree["train"]["eval_every"] = 2
    with pytest.raises(ConfigError, match=r"train.eval_every = 2 needs data.eval_corpus"):
        Config.from_dict(tree)
    with pytest.raises(ConfigError, match=r"data.eval_corpus = '.*nope.txt': no such file"):
        DataConfig(eval_corpus=str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match="data.eval_micro_batches = -1: must be >= 0"):
        DataConfig(eval_micro_batches=-1)
    short = tmp_path / "short.txt"
    short.write_text("x" * 40)
    with pytest.raises(ConfigError, match=r"data.eval_corpus: .*short.txt has 40 tokens, fewer than data.seq_len \+ 1"):
        EvalSet(DataConfig(eval_corpus=str(short), seq_len=64))
    two = tmp_path / "two_windows.txt"
    two.write_text("y" * 70)  # two windows of 33 tokens (stride 32): no micro-batch of 4
    with pytest.raises(
        ConfigError, match=r"too few for one micro-batch of 4 windows of 33; .*lower data.micro_batch_size"
    ):
        EvalSet(DataConfig(eval_corpus=str(two), seq_len=32, micro_batch_size=4))


def _ranks(rank, world, port, out_dir, tree, init_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = Config.from_dict(tree)
    skeleton, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    with RankGroup(rank, world, timeout_s=120) as g:
        with Trainer(cfg, weights=tensor_source(skeleton, torch.load(init_path)), group=g) as tr:
            tr.initialize(progress=False)
            vals = [tr.train_step().extra["eval_loss"] for _ in range(cfg.train.steps)]
    torch.save({"vals": vals}, os.path.join(out_dir, f"{rank}.pt"))


@pytest.mark.slow
def test_ranks_take_the_one_rank_validation_loss(tmp_path):
    """2 ranks, each its share of the held-out micro-batches, summed in rank order: the
    validation loss of one rank training the same global batch (within the rounding of
    another summation order), the same value on both ranks."""
    one = small_config(tmp_path / "one", kind="llama", layers=2, micro_batches=4, steps=2)
    one.data.eval_corpus, one.data.eval_micro_batches, one.train.eval_every = _held_out(tmp_path), 4, 1
    ref_model = reference_model(one)
    init = weights_of(ref_model)
    skeleton, _ = build_model(one.model, param_dtype=torch.float32, seed=0)
    with Trainer(one, weights=tensor_source(skeleton, init)) as tr:
        tr.initialize(progress=False)
        single = [tr.train_step().extra["eval_loss"] for _ in range(2)]
    two = small_config(tmp_path / "two", kind="llama", layers=2, micro_batches=2, steps=2)
    two.data.eval_corpus, two.data.eval_micro_batches, two.train.eval_every = _held_out(tmp_path), 4, 1
    torch.save(init, tmp_path / "init.pt")
    (tmp_path / "out").mkdir()
    out = spawn(_ranks, 2, tmp_path / "out", two.to_dict(), str(tmp_path / "init.pt"))
    assert out[0]["vals"] == out[1]["vals"]
    assert out[0]["vals"] == pytest.approx(single, rel=1e-6, abs=0)  # 2e-9 measured: the weights' last bits
