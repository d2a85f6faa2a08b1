"""`tiertrain eval`: a model's loss and perplexity on a text, forward only, from a Hugging Face
directory (Llama, GPT-2) or a tiertrain checkpoint: the loss transformers' own model gives on
the same windows, bit for bit in fp32; a checkpoint gives the validation loss its run logged;
damage and bad input are named."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from reference import small_config

from tiertrain.config import DataConfig, ModelConfig
from tiertrain.data import EvalSet
from tiertrain.inference.evaluate import evaluate
from tiertrain.models import hf_config_from

TEXT = "".join(f"{i} a held-out line of text, {i * 13 % 7} words long or so.\n" for i in range(80))


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "tiertrain", "eval", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _text(tmp_path) -> str:
    path = tmp_path / "held_out.txt"
    path.write_text(TEXT)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_eval_of_a_hf_directory_is_transformers_loss(tmp_path, kind):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    if kind == "llama":
        hf = AutoModelForCausalLM.from_config(
            hf_config_from(ModelConfig(kind="llama", n_layers=2, d_model=64, n_heads=4, vocab_size=256))
        )
    else:
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128))
    hf.save_pretrained(tmp_path / "hf")
    text = _text(tmp_path)
    data = ["--data.seq_len=32", "--data.micro_batch_size=2", "--data.micro_batches=3"]
    r = _cli(
        f"--model.hf_dir={tmp_path / 'hf'}",
        f"--data.eval_corpus={text}",
        *data,
        f"--io.paths={tmp_path / 'ssd'}",
        "--out",
        str(tmp_path / "res.json"),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "res.json").read_text())
    es = EvalSet(DataConfig(eval_corpus=text, seq_len=32, micro_batch_size=2, eval_micro_batches=0))
    assert res["micro_batches"] == es.count >= 5 and res["tokens"] == es.count * 2 * 32
    hf.eval()
    with torch.no_grad():
        want = sum(float(hf(input_ids=x, labels=y, shift_labels=y).loss) for x, y in es.micro_batches()) / es.count
    assert res["loss"] == want
    assert res["perplexity"] == pytest.approx(math.exp(want), rel=1e-6)
    assert f"loss {res['loss']:.4f} | perplexity {res['perplexity']:.2f}" in r.stdout
    assert not os.path.exists(tmp_path / "ssd")  # forward only: no state file, nothing written


@pytest.mark.slow
def test_eval_of_a_checkpoint_is_its_runs_validation_loss_and_damage_is_named(tmp_path):
    from tiertrain.training.trainer import Trainer

    cfg = small_config(tmp_path, kind="llama", layers=2, micro_batches=2, steps=2)
    cfg.data.eval_corpus, cfg.data.eval_micro_batches, cfg.train.eval_every = _text(tmp_path), 4, 2
    with Trainer(cfg) as tr:
        logged = tr.run()[-1].extra["eval_loss"]
    run = cfg.train.run_dir
    r = _cli(
        "--checkpoint",
        run,
        "--data.eval_micro_batches=4",
        f"--data.eval_corpus={_text(tmp_path)}",
        "--out",
        str(tmp_path / "res.json"),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "res.json").read_text())["loss"] == logged  # the same windows, the same weights
    # its weights are laid out by its run's units: cut otherwise, refused by name (was a KeyError)
    cut = _cli("--checkpoint", run, "--model.layer_pieces=2", f"--data.eval_corpus={_text(tmp_path)}", cwd=tmp_path)
    assert cut.returncode == 2 and "Traceback" not in cut.stderr, cut.stderr[-3000:]
    assert "model.layer_pieces = 2 with --checkpoint: the checkpoint's weights are laid out" in cut.stderr
    ck = os.path.join(run, "checkpoints", "step-00000002")
    weights = next(n for n in os.listdir(ck) if n in ("params.bin", "master.bin"))
    with open(os.path.join(ck, weights), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    bad = _cli("--checkpoint", ck, f"--data.eval_corpus={_text(tmp_path)}", cwd=tmp_path)
    assert bad.returncode != 0 and "its weights are corrupt" in bad.stderr and "use an earlier checkpoint" in bad.stderr


@pytest.mark.slow
def test_eval_bad_input_is_named(tmp_path):
    cfg = small_config(tmp_path)
    with pytest.raises(Exception, match="data.eval_corpus is not set: give the text to evaluate on"):
        evaluate(cfg)
    r = _cli(f"--data.eval_corpus={tmp_path / 'missing.txt'}", cwd=tmp_path)
    assert r.returncode == 2 and "data.eval_corpus = " in r.stderr and "no such file" in r.stderr
    import numpy as np

    from tiertrain.data import write_tokens

    big = str(tmp_path / "big.bin")
    write_tokens(big, [np.arange(5000) % 4000], vocab_size=4000)
    cfg.data.eval_corpus = big
    with pytest.raises(Exception, match=r"its tokenizer has 4000 tokens, the model's vocabulary 256"):
        evaluate(cfg)


def test_weights_converted_to_the_tier_once_give_the_same_loss(tmp_path, caplog):
    """io.weights = 'tier': the first run converts the weights into weights-<key>.bin (in the
    compute dtype, checksummed) and reads units from it with O_DIRECT: the loss of reading
    the safetensors; a second run reuses the file; a corrupted block is caught by its
    checksum; a changed source makes a new file (and the earlier one goes). Paths with glob
    characters (the model's safetensors went unfound; copies in another directory that the
    pattern matched were removed)."""
    import logging

    from transformers import AutoModelForCausalLM

    tmp_path = tmp_path / "run[0]"
    tmp_path.mkdir()
    torch.manual_seed(2)
    hf = AutoModelForCausalLM.from_config(
        hf_config_from(ModelConfig(kind="llama", n_layers=2, d_model=64, n_heads=4, vocab_size=256))
    )
    hf.save_pretrained(tmp_path / "hf")
    cfg = small_config(tmp_path)
    cfg.model, cfg.data.eval_corpus = ModelConfig(hf_dir=str(tmp_path / "hf")), _text(tmp_path)
    want = evaluate(cfg).loss
    cfg.io.weights = "tier"
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        first = evaluate(cfg).loss
        again = evaluate(cfg).loss
    assert first == again == want
    logs = [r.message for r in caplog.records if r.message.startswith("weights:")]
    assert logs[0].startswith("weights: converting") and "(converted before)" in logs[1], logs
    (made,) = (tmp_path / "ssd0").glob("weights-*.bin")
    with open(made, "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 16)
    with pytest.raises(Exception, match=r"(?i)checksum"):
        evaluate(cfg)
    os.utime(tmp_path / "hf" / "model.safetensors", ns=(1, 1))  # the source changed: converted anew
    assert evaluate(cfg).loss == want and len(list((tmp_path / "ssd0").glob("weights-*.bin"))) == 1
    assert not made.exists()  # the copy of the source's earlier content: removed once the new one is made
    # a conversion killed (kill -9) left its partial copy for good, the whole copy's size: removed
    # at the next run (a live process's, being made now, left alone)
    import subprocess
    import sys
    import time

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    partial = tmp_path / "ssd0" / f"weights-x-y.bin.tmp-{int(dead.stdout)}"
    live = tmp_path / "ssd0" / f"weights-x-z.bin.tmp-{os.getpid()}"
    young = tmp_path / "ssd0" / f"weights-x-w.bin.tmp-{int(dead.stdout)}"  # (another host's, being written)
    # this host's, killed a moment ago (a rerun at once was refused for space, the partial not named)
    from tiertrain.inference.weights import _HOST

    just = tmp_path / "ssd0" / f"weights-x-v.bin.tmp-{_HOST}-{int(dead.stdout)}"
    for f in (partial, partial.with_name(partial.name + ".crc"), live, young, just):
        f.write_bytes(b"\0" * 8192)
        if f not in (young, just):
            os.utime(f, (time.time() - 3600, time.time() - 3600))
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        assert evaluate(cfg).loss == want
    assert not partial.exists() and not partial.with_name(partial.name + ".crc").exists() and live.exists()
    assert young.exists() and not just.exists()
    assert f"removed {partial}, a partial copy a killed conversion left" in caplog.text
    # other weights of the same sizes copied in with the old file's times (cp -p, rsync -a): the
    # copy was taken for theirs, and the loss was the earlier model's
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(hf.config).save_pretrained(tmp_path / "other")
    src = tmp_path / "hf" / "model.safetensors"
    times = os.stat(src)
    os.replace(tmp_path / "other" / "model.safetensors", src)
    os.utime(src, ns=(times.st_atime_ns, times.st_mtime_ns))
    cfg.io.weights = "source"
    theirs = evaluate(cfg).loss
    cfg.io.weights = "tier"
    assert theirs != want and evaluate(cfg).loss == theirs


def test_generation_reads_the_same_tokens_from_the_tier(tmp_path):
    from transformers import AutoModelForCausalLM

    from tiertrain.inference.generate import Sampling, generate

    torch.manual_seed(4)
    hf = AutoModelForCausalLM.from_config(
        hf_config_from(ModelConfig(kind="llama", n_layers=2, d_model=64, n_heads=4, vocab_size=256))
    )
    hf.save_pretrained(tmp_path / "hf")
    cfg = small_config(tmp_path)
    cfg.model = ModelConfig(hf_dir=str(tmp_path / "hf"))
    want = generate(cfg, [[1, 2, 3], [4, 5]], Sampling(max_new_tokens=6))
    cfg.io.weights = "tier"
    assert generate(cfg, [[1, 2, 3], [4, 5]], Sampling(max_new_tokens=6)) == want
    # eval of the same model reads the copy generate made (it made its own: eval leaves the
    # vocabulary's pieces to the planner, generate sets 1, and the copy's key held that setting)
    copies = lambda: sorted(n for n in os.listdir(cfg.io.paths[0]) if n.startswith("weights-") and n.endswith(".bin"))  # noqa: E731
    made = copies()
    cfg.data.eval_corpus = "bundled"
    cfg.data.eval_micro_batches = 1
    evaluate(cfg)
    assert len(made) == 1 and copies() == made


def test_a_converted_copy_is_its_checkpoints_and_a_damaged_one_is_made_again(tmp_path, capsys):
    """`eval --checkpoint RUN --io.weights=tier` kept its converted copy under a key of the path
    as typed and the step: a run trained again into the same directory was evaluated with the
    first run's weights, without a word. The copy now follows the checkpoint's weights file (its
    path, size, time and CRC32C), and the copy of its earlier content goes (one of other
    settings stays). A copy cut short or without its checksums is made again; a
    flipped byte, found while reading, is named with what to do."""
    from reference import tiny_flags

    from tiertrain.cli import main

    text, run, out = _text(tmp_path), str(tmp_path / "run"), str(tmp_path / "res.json")

    def loss(*extra):
        argv = ["eval", "--checkpoint", run, f"--data.eval_corpus={text}", "--data.eval_micro_batches=2"]
        assert main([*argv, f"--io.paths={tmp_path / 'ssd'}", "--out", out, *extra]) == 0, capsys.readouterr().err
        return json.loads(open(out).read())["loss"]

    assert main(["train", *tiny_flags(tmp_path)]) == 0
    copies = lambda: set((tmp_path / "ssd").glob("weights-*.bin"))  # noqa: E731
    first = loss("--io.weights=tier")
    (fp32,) = copies()
    loss("--io.weights=tier", "--train.param_dtype=bfloat16")  # a copy of other settings
    (bf16,) = copies() - {fp32}
    assert main(["train", *tiny_flags(tmp_path, "--optim.lr=3e-2", "--train.overwrite=true")]) == 0
    second = loss()
    assert second != first and loss("--io.weights=tier") == second
    # the first run's copy (an earlier content of the same checkpoint file) went; the bf16 one stays
    (newest,) = copies() - {bf16}
    assert fp32 not in copies() and bf16 in copies() and not os.path.exists(f"{fp32}.crc")
    os.truncate(newest, os.path.getsize(newest) // 2)
    capsys.readouterr()
    assert loss("--io.weights=tier") == second
    err = capsys.readouterr().err
    assert "is damaged" in err and "converted again" in err, err
    os.remove(f"{newest}.crc")
    assert loss("--io.weights=tier") == second
    with open(newest, "r+b") as f:
        f.seek(os.path.getsize(newest) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    argv = ["eval", "--checkpoint", run, f"--data.eval_corpus={text}", f"--io.paths={tmp_path / 'ssd'}"]
    assert main([*argv, "--io.weights=tier"]) == 1
    err = capsys.readouterr().err
    assert "converted copy of the weights (io.weights = 'tier'): delete it and run again" in err, err


def test_a_validation_over_part_of_the_text_says_how_much(tmp_path, caplog):
    """data.eval_micro_batches (8 by default) took a part of a long eval_corpus without a word: a
    6,000-row and a 400-row text gave the same validation losses."""
    import logging

    text = _text(tmp_path)
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        whole = EvalSet(DataConfig(eval_corpus=text, seq_len=32, micro_batch_size=1, eval_micro_batches=0))
        assert "validation:" not in caplog.text
        EvalSet(DataConfig(eval_corpus=text, seq_len=32, micro_batch_size=2, eval_micro_batches=2))
    rows = whole.count
    assert f"validation: 2 micro-batches of 2 rows, 4 of the {rows} rows data.eval_corpus gives" in caplog.text
    # rows that do not fill the last micro-batch were left out without a word
    B = next(b for b in range(3, rows) if rows % b)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        part = EvalSet(DataConfig(eval_corpus=text, seq_len=32, micro_batch_size=B, eval_micro_batches=0))
    assert part.count == rows // B
    assert (
        f"validation: the last {rows % B} of the {rows} rows data.eval_corpus gives do not fill a micro-batch of {B} "
        f"and are left out; a data.micro_batch_size dividing {rows} evaluates them all" in caplog.text
    )
    # with ranks, the micro-batches past the last whole round of them were left out without a word
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiertrain"):
        EvalSet(DataConfig(eval_corpus=text, seq_len=32, micro_batch_size=2, eval_micro_batches=6), world=3)
        assert "round" not in caplog.text
        EvalSet(DataConfig(eval_corpus=text, seq_len=32, micro_batch_size=2, eval_micro_batches=5), world=3)
    assert (
        "validation: the last 2 of the 5 micro-batches do not make a round of the 3 ranks (each takes as many) and "
        "are left out; data.eval_micro_batches a multiple of 3 evaluates all it takes" in caplog.text
    )


def test_ctrl_c_during_a_validation_cuts_it_short(tmp_path, caplog):
    """Ctrl-C while a step's validation ran waited for all of it (22 s on a long eval_corpus)
    before the run stopped. Asked between its passes, it cuts the validation short: the step
    has no validation loss, said; the next step's (no Ctrl-C) has its whole one."""
    import logging
    import signal

    from tiertrain.training.interrupt import StopFlag
    from tiertrain.training.trainer import Trainer

    cfg = small_config(tmp_path, kind="llama", layers=2, micro_batches=1, steps=3)
    cfg.data.eval_corpus, cfg.data.eval_micro_batches, cfg.train.eval_every = _text(tmp_path), 4, 1
    with Trainer(cfg) as tr, caplog.at_level(logging.WARNING, logger="tiertrain"):
        tr.initialize(progress=False)
        flag = StopFlag()
        flag.set, flag.signum = "Ctrl-C", signal.SIGINT
        tr._stop = flag
        assert "eval_loss" not in tr.train_step().extra
        assert "step 1: its validation cut short by Ctrl-C (no validation loss)" in caplog.text
        tr._stop = None
        assert math.isfinite(tr.train_step().extra["eval_loss"])
        # a signal to another rank (the ranks agree on the largest): named as such (it read
        # "cut short by  " on every rank the signal did not reach)
        tr._stop, tr.group.max = StopFlag(), lambda value: max(value, int(signal.SIGTERM))
        caplog.clear()
        assert "eval_loss" not in tr.train_step().extra
        assert "step 3: its validation cut short by SIGTERM to another rank (no validation loss)" in caplog.text


def test_eval_takes_the_config_files_number_of_micro_batches(tmp_path, capsys):
    """`eval --config FILE` with data.eval_micro_batches in the file scored the whole text: the
    command's default (all of it) was put on top as a flag."""
    from tiertrain.cli import main

    conf = tmp_path / "ev.toml"
    conf.write_text(f'[data]\neval_corpus = "{_text(tmp_path)}"\neval_micro_batches = 1\nseq_len = 32\n')
    model = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4"]
    assert main(["eval", "--config", str(conf), *model]) == 0
    assert "in 1 micro-batches" in capsys.readouterr().out
