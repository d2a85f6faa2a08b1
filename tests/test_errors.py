"""Every bad input is one clear line: the value, what is wrong, what to do; a non-zero exit
code; and nothing left behind."""

import json
import math
import os
import re

import pytest
import torch
from reference import tiny_flags

from tiertrain.cli import main


def one_line_error(capsys, argv, code=None):
    """Run the CLI; return its error line after checking it is the only one and no traceback."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("tiertrain:")]
    assert len(lines) == 1, err
    assert rc != 0 and (code is None or rc == code), (rc, err)
    return lines[0]


def nothing_left(tmp_path, *keep):
    left = sorted(set(os.listdir(tmp_path)) - set(keep))
    assert left == [], left


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny GPT-2 model directory (config.json and model.safetensors)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(d)
    return d


def copy_hf(src, dst):
    dst.mkdir()
    for n in os.listdir(src):
        (dst / n).write_bytes((src / n).read_bytes())
    return dst


@pytest.mark.parametrize(
    "damage,match",
    [
        ("garbage", r"model\.safetensors is not a readable safetensors file \(.*\); it is truncated or damaged"),
        ("truncated", r"model\.safetensors is not a readable safetensors file"),
        ("header-only", r"model\.safetensors is not a readable safetensors file"),
    ],
)
def test_damaged_safetensors(tmp_path, capsys, hf_dir, damage, match):
    d = copy_hf(hf_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(
        {
            "garbage": os.urandom(len(data)),
            "truncated": data[: len(data) // 2],
            "header-only": data[: 8 + int.from_bytes(data[:8], "little")],
        }[damage]
    )
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--model.hf_dir={d}")], 2)
    assert f"model.hf_dir = '{d}'" in line
    import re

    assert re.search(match, line), line
    nothing_left(tmp_path, "m")


def test_invalid_config_json_and_a_missing_shard(tmp_path, capsys, hf_dir):
    d = copy_hf(hf_dir, tmp_path / "m")
    (d / "config.json").write_text('{"model_type": "gpt2", ')
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--model.hf_dir={d}")], 2)
    assert f"model.hf_dir = '{d}': {d}/config.json is not valid JSON" in line
    d2 = copy_hf(hf_dir, tmp_path / "sharded")
    (d2 / "model.safetensors").rename(d2 / "model-00001-of-00002.safetensors")
    (d2 / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {  # a shard that is not there
                    "transformer.wte.weight": "model-00001-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--model.hf_dir={d2}")], 2)
    assert "model-00002-of-00002.safetensors, named in its index, is missing" in line
    nothing_left(tmp_path, "m", "sharded")


def test_kind_is_read_from_config_json_and_a_contradiction_is_refused(tmp_path, capsys, hf_dir):
    from tiertrain.config import load_config

    assert load_config(None, [f"--model.hf_dir={hf_dir}", "--data.seq_len=32"]).model.kind == "gpt2"
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--model.hf_dir={hf_dir}", "--model.kind=llama")], 2)
    assert (
        f"model.kind = 'llama': model.hf_dir = '{hf_dir}' holds a 'gpt2' model (config.json), which is kind 'gpt2'; "
        "leave model.kind at 'auto' or set it to 'gpt2'" in line
    )


@pytest.mark.parametrize("key", ["n_positions", "max_position_embeddings"])
def test_seq_len_beyond_the_models_position_limit(tmp_path, capsys, hf_dir, key):
    d = copy_hf(hf_dir, tmp_path / "m")
    cfg = json.load(open(d / "config.json"))
    if key == "max_position_embeddings":  # a Llama
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
        ).to_dict()
    else:
        cfg["n_positions"] = 16
    (d / "config.json").write_text(json.dumps(cfg))
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--model.hf_dir={d}")], 2)
    assert f"data.seq_len = 32 is longer than the model in {d} supports ({key} = 16 in its config.json)" in line


@pytest.mark.parametrize(
    "content,match",
    [
        (b"", "is not a tiertrain token file"),
        (b"garbage" * 100, "is not a tiertrain token file"),
        ("truncate", "is truncated: expected"),
        ("trailing", "bytes after its"),
    ],
)
def test_bad_token_files(tmp_path, capsys, content, match):
    from tiertrain.data import write_tokens

    f = tmp_path / "c.tokens"
    if isinstance(content, str):
        import numpy as np

        write_tokens(str(f), [np.arange(1000) % 256], 256)
        data = f.read_bytes()
        f.write_bytes(data[:-10] if content == "truncate" else data + b"\0\0")
    else:
        f.write_bytes(content)
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--data.corpus={f}")], 1)
    assert match in line and str(f) in line
    nothing_left(tmp_path, "c.tokens")


def test_text_corpus_not_utf8_and_a_directory_as_corpus(tmp_path, capsys):
    f = tmp_path / "c.txt"
    f.write_bytes(b"some text \xff\xfe more" * 100)
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--data.corpus={f}")], 2)
    assert f"data.corpus = '{f}' is not UTF-8 text" in line
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--data.corpus={tmp_path}")], 2)
    assert f"data.corpus = '{tmp_path}': is a directory" in line
    nothing_left(tmp_path, "c.txt")


def test_device_cuda_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, "--train.device=cuda")], 2)
    assert "train.device = 'cuda' but" in line and "use --train.device=cpu" in line
    nothing_left(tmp_path)


@pytest.fixture
def readonly_dir(tmpfs):
    return tmpfs("ro", 1024, readonly=True)


@pytest.mark.parametrize("field", ["io.paths", "train.run_dir"])
@pytest.mark.parametrize("where", ["a file", "under a file", "/proc", "read-only"])
def test_unusable_directories(tmp_path, capsys, field, where, request):
    f = tmp_path / "f"
    f.write_text("x")
    path = {"a file": f, "under a file": f / "sub", "/proc": "/proc/tiertrain-test", "read-only": None}[where]
    if where == "read-only":
        path = request.getfixturevalue("readonly_dir") / "sub"
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path), f"--{field}={path}"], 2)
    assert line.startswith(f"tiertrain: config error: {field} = '{path}'"), line
    assert {
        "a file": "is a file, not a directory",
        "under a file": f"cannot be made: {f} is a file",
        "/proc": "is inside /proc, a kernel filesystem",
        "read-only": "is on a read-only filesystem",
    }[where] in line or (where == "read-only" and "not writable" in line), line
    nothing_left(tmp_path, "f", "ro")


def test_out_of_space_at_start(tmp_path, capsys, tmpfs):
    d = tmpfs("small", 512)
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path), f"--io.paths={d}"], 1)
    assert f"tiertrain: not enough space on the filesystem of {d}" in line and "more or choose another path" in line
    assert os.listdir(d) == []
    nothing_left(tmp_path, "small")


def test_checksum_mismatch_on_resume_and_export_failures(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path)]) == 0
    ck = run / "checkpoints" / "step-00000002"
    f = ck / "exp_avg.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    line = one_line_error(capsys, ["train", f"--resume={run}", "--train.steps=3"], 1)
    assert f"checkpoint file {f} is corrupt: crc32c" in line and "use an earlier checkpoint" in line
    line = one_line_error(capsys, ["export", f"--checkpoint={tmp_path / 'nope'}", f"--out={tmp_path / 'e'}"], 1)
    assert f"export --checkpoint {tmp_path / 'nope'}: no such directory" in line
    line = one_line_error(capsys, ["export", f"--checkpoint={tmp_path}", f"--out={tmp_path / 'e'}"], 1)
    assert f"export --checkpoint {tmp_path}: no complete checkpoint there" in line
    p = ck / "params.bin"
    data = bytearray(p.read_bytes())
    data[100] ^= 1
    p.write_bytes(bytes(data))
    line = one_line_error(capsys, ["export", f"--checkpoint={ck}", f"--out={tmp_path / 'e'}"], 1)
    assert f"checkpoint file {p} is corrupt" in line
    assert not (tmp_path / "e").exists() and not [n for n in os.listdir(tmp_path) if "tmp-export" in n]


def test_prepare_errors(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 100)
    line = one_line_error(capsys, ["prepare", f"--input={text}", f"--output={text}"], 1)
    assert "is also an --input; it would overwrite the text" in line
    assert text.read_text() == "hello world " * 100
    binary = tmp_path / "b.txt"
    binary.write_bytes(bytes(range(256)) * 100)
    line = one_line_error(capsys, ["prepare", f"--input={binary}", f"--output={tmp_path / 'o.tokens'}"], 1)
    assert f"prepare --input {binary} is not UTF-8 text" in line
    assert sorted(os.listdir(tmp_path)) == ["b.txt", "t.txt"]  # no output, no temporary file
    line = one_line_error(capsys, ["prepare", f"--input={tmp_path / 'none.txt'}", f"--output={tmp_path / 'o'}"], 1)
    assert f"prepare --input = '{tmp_path / 'none.txt'}': no such file" in line
    line = one_line_error(capsys, ["prepare", f"--input={text}", f"--output={tmp_path / 'no' / 'o.tokens'}"], 1)
    assert f"directory {tmp_path / 'no'} does not exist; create it first" in line
    (tmp_path / "tok").mkdir()
    line = one_line_error(
        capsys, ["prepare", f"--input={text}", f"--output={tmp_path / 'o'}", f"--tokenizer={tmp_path / 'tok'}"], 2
    )
    assert f"prepare --tokenizer = '{tmp_path / 'tok'}' has no tokenizer files" in line


def test_tokenizer_for_a_token_file_and_bf16_on_a_slow_cpu_are_said(tmp_path, caplog, monkeypatch):
    import logging

    import numpy as np

    from tiertrain.config import ConfigError, DataConfig
    from tiertrain.data import Corpus, write_tokens
    from tiertrain.device import core as device

    f = tmp_path / "c.tokens"
    write_tokens(str(f), [np.arange(1000) % 256], 256)
    (tmp_path / "tok").mkdir()
    # a token file's tokenizer is checked against it (once "not used", said): here it has none
    with pytest.raises(ConfigError, match=r"data.tokenizer = .*/tok' has no tokenizer files"):
        Corpus(DataConfig(corpus=str(f), tokenizer=str(tmp_path / "tok")))
    with caplog.at_level(logging.WARNING, logger="tiertrain"):
        monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: False)
        assert device.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert "train.param_dtype = 'bfloat16' on a CPU without bf16 instructions" in caplog.text


def test_messages_that_used_to_mislead(tmp_path, capsys):
    """A checkpoint of another d_model names two different layouts; an init_from mismatch
    names model.init_from; one step is "1 step"; train --help explains the override flags."""
    from safetensors.torch import save_file

    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0
    assert "done: 1 step:" in capsys.readouterr().err
    line = one_line_error(
        capsys, ["train", f"--resume={tmp_path / 'run'}", "--model.d_model=128", "--train.steps=2"], 1
    )
    a, b = line.split("(")[1].split(")")[0], line.split("(")[2].split(")")[0]
    assert "written for another model or precision" in line and a != b, line
    save_file({"embed.wte.weight": torch.zeros(3, 3)}, str(tmp_path / "w.safetensors"))
    line = one_line_error(
        capsys, ["train", *tiny_flags(tmp_path / "x", f"--model.init_from={tmp_path / 'w.safetensors'}")], 2
    )
    assert f"model.init_from = '{tmp_path / 'w.safetensors'}': weight 'embed.wte.weight' has shape (3, 3)" in line
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--section.field=value" in capsys.readouterr().out


def test_careless_inputs_of_round_two(tmp_path, capsys):
    """--nproc 0 and -2 are refused (they ran one process); a dict section that is not a table
    is refused by the API as TOML's is (it was a raw TypeError); `eval --checkpoint` and
    `generate --checkpoint` of a directory without one name --checkpoint (they said --resume);
    non-finite sampling settings are refused by the command; memory.kv_host_mib = 0 (the
    whole cache on the storage tier, as documented) is taken from a flag as from an object; a
    host budget above the available memory is said, with the figure."""
    import psutil

    import tiertrain
    from tiertrain.config import ConfigError, load_config

    for n in ("0", "-2"):
        line = one_line_error(capsys, ["train", "--nproc", n, *tiny_flags(tmp_path)], 1)
        assert f"--nproc {n}: the number of ranks must be at least 1" in line
    nothing_left(tmp_path)
    with pytest.raises(ConfigError, match=r"\[data\] must be a table of fields, got 5"):
        tiertrain.train({"data": 5})
    (tmp_path / "empty").mkdir()
    for cmd in (["eval"], ["generate", "--prompt", "hi"]):
        line = one_line_error(capsys, [*cmd, "--checkpoint", str(tmp_path / "empty")], 1)
        assert line.startswith(f"tiertrain: --checkpoint {tmp_path / 'empty'}: no complete checkpoint there"), line
    for flag in ("--temperature", "--top-p"):
        for bad in ("nan", "inf"):  # refused before any model is built (a traceback from torch.multinomial)
            line = one_line_error(capsys, ["generate", "--prompt", "hi", flag, bad, *tiny_flags(tmp_path)], 2)
            assert "sampling settings must be finite numbers" in line, line
    assert load_config(None, ["--memory.kv_host_mib=0"]).memory.kv_host_mib == 0
    with pytest.raises(ConfigError, match=r"memory.kv_host_mib = -1: must be >= 0"):
        load_config(None, ["--memory.kv_host_mib=-1"])
    huge = psutil.virtual_memory().total // 2**20 * 4
    capsys.readouterr()
    assert main(["plan", "--probe-mib=1", f"--memory.host_mib={huge}", *tiny_flags(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"WARNING memory.host_mib = {huge:,} MiB is more than the" in err and "available now" in err, err


def test_a_config_object_edited_after_it_was_made_is_checked_as_flags_are(tmp_path):
    """Fields set on the objects skip their section's checks; every driver checks again."""
    from reference import small_config

    from tiertrain.config import ConfigError
    from tiertrain.inference.generate import Sampling, generate
    from tiertrain.training.trainer import Trainer

    cfg = small_config(tmp_path)
    cfg.memory.device_slots = 1
    with pytest.raises(ConfigError, match=r"memory.device_slots = 1: must be between 2 and 64"):
        Trainer(cfg)
    with pytest.raises(ConfigError, match=r"memory.device_slots = 1"):
        generate(cfg, [[1, 2]], Sampling(max_new_tokens=2))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"sampling settings must be finite numbers"):
            Sampling(temperature=bad)


def test_a_corrupt_checkpoints_hint_names_the_newest_intact_one_and_works_as_printed(tmp_path, capsys):
    """Resuming from a damaged checkpoint suggested resuming the run again, which took the same
    damaged checkpoint: the hint names the newest intact one before it, and its command works."""
    import re
    import shlex

    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=1", "--checkpoint.keep=3", steps=3)]) == 0
    cks = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in cks] == ["step-00000001", "step-00000002", "step-00000003"]
    for damaged in (cks[2], cks[1]):  # the newest, then the one before it too
        f = damaged / "exp_avg.bin"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x40
        f.write_bytes(bytes(data))
    line = one_line_error(capsys, ["train", f"--resume={run}", "--train.steps=4"], 1)
    assert f"checkpoint file {cks[2] / 'exp_avg.bin'} is corrupt" in line
    assert f"the newest intact checkpoint before it is {cks[0]}:" in line, line
    cmd = shlex.split(re.search(r"`(tiertrain train [^`]*)`", line).group(1))
    assert cmd == ["tiertrain", "train", "--resume", str(cks[0])]
    assert main([*cmd[1:], "--train.steps=4"]) == 0


def test_a_failed_save_of_a_resumed_run_points_at_its_last_checkpoint(tmp_path, capsys, monkeypatch):
    """A resumed run whose later save failed (out of space) was told the checkpoint it resumed
    from was damaged and pointed at the one before it: resuming there marks the newer, intact
    one as a later course of the run, and its first save deletes it."""
    from tiertrain.checkpoint import CheckpointError, saver

    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=1", "--checkpoint.keep=3", steps=2)]) == 0

    def full(*args, **kwargs):
        raise CheckpointError("not enough space for the checkpoint of step 3 (a stand-in)")

    monkeypatch.setattr(saver.CheckpointIO, "save", full)
    line = one_line_error(capsys, ["train", f"--resume={run}", "--train.steps=3"], 1)
    assert f"(the last checkpoint is {run / 'checkpoints' / 'step-00000002'}:" in line and "before it" not in line, line


def test_non_finite_settings_are_refused_and_a_non_finite_loss_stops_the_run_unsaved(tmp_path, capsys, monkeypatch):
    """nan and inf are refused for every float field (nan passed every range check); a step
    whose loss (or gradient norm) is not finite ends the run at that step, one line, with the
    last good checkpoint kept as the newest and nothing of that step saved; a loss rising over
    10x its lowest warns once."""
    import math

    from tiertrain.training.trainer import Trainer

    for flag in ("--optim.weight_decay=nan", "--optim.grad_clip=nan", "--optim.lr=inf", "--adapter.alpha=-inf"):
        line = one_line_error(capsys, ["train", *tiny_flags(tmp_path), flag], 2)
        assert f"{flag[2:].replace('=', ' = ')}: expected a finite number" in line, line
    nothing_left(tmp_path)
    losses = iter([5.0, 4.0, 41.0, 50.0, math.nan, 3.0])
    step = Trainer.train_step

    def poisoned(self):
        rec = step(self)
        rec.loss = next(losses)  # the loss the step line, the guard and the metrics see
        return rec

    monkeypatch.setattr(Trainer, "train_step", poisoned)
    run = tmp_path / "run"
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=2", steps=6)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("the run may be diverging") == 1, err
    assert "step 3: the loss 41.0000 is over 10x its lowest so far (4.0000 at step 2)" in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("tiertrain:")]
    assert line.startswith("tiertrain: step 5: the loss nan is not finite; the run stopped without saving this step")
    assert f"(the last checkpoint is {run / 'checkpoints' / 'step-00000004'}" in line, line
    from tiertrain.checkpoint import list_checkpoints

    assert [os.path.basename(p) for p in list_checkpoints(str(run / "checkpoints"))] == [
        "step-00000002",
        "step-00000004",
    ]
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    monkeypatch.undo()


def test_a_nan_in_the_weights_stops_at_the_first_step(tmp_path, capsys, caplog):
    """A real non-finite value (a NaN weight given by model.init_from): step 1 ends the run,
    no checkpoint is written, not even the final one."""
    from safetensors.torch import load_file, save_file

    from tiertrain.checkpoint.export import export_checkpoint

    assert main(["train", *tiny_flags(tmp_path / "a", steps=1)]) == 0
    out = export_checkpoint(str(tmp_path / "a" / "run"), str(tmp_path / "w"))
    shard = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))[1]
    tensors = load_file(os.path.join(out, shard))
    name = next(iter(tensors))
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
    capsys.readouterr()
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path / "b", f"--model.init_from={out}", steps=3)], 1)
    assert line.startswith("tiertrain: step 1: the loss nan and the gradient norm nan are not finite"), line
    assert not os.path.exists(tmp_path / "b" / "run" / "checkpoints")
    # eval of those weights: its perplexity was inf (as of a model merely bad), the --out file null
    res = tmp_path / "eval.json"
    model = [f for f in tiny_flags(tmp_path / "c") if f.startswith(("--model.", "--data.seq_len", "--io."))]
    flags = [*model, f"--model.init_from={out}", "--data.eval_corpus=bundled", "--data.eval_micro_batches=1"]
    assert main(["eval", *flags, f"--out={res}"]) == 0
    said = capsys.readouterr()
    assert "loss nan | perplexity nan" in said.out and "the weights hold non-finite values" in said.err, said
    assert json.loads(res.read_text())["perplexity"] is None


def test_a_step_or_a_save_before_the_weights_are_given_is_refused(tmp_path):
    """Python API: Trainer.train_step() without initialize() trained a model of zeros (the
    states are allocated zeroed): the loss was exactly ln(vocabulary), and an hf_dir's weights
    were never read. Now refused by name, as a checkpoint of those zeros is; and so is any of
    them once the Trainer is closed."""
    from reference import small_config

    from tiertrain.errors import TiertrainError
    from tiertrain.training.trainer import Trainer

    with Trainer(small_config(tmp_path, steps=1)) as tr:
        for call, name in ((tr.train_step, "train_step()"), (tr.save_checkpoint, "save_checkpoint()")):
            with pytest.raises(TiertrainError, match=rf"Trainer.{re.escape(name)}: no weights yet; call initialize"):
                call()
        tr.initialize(progress=False)
        assert math.isfinite(tr.train_step().loss)
    # closed: states kept in memory stepped on with no storage tier behind them and nowhere to save
    for call, name in ((tr.train_step, "train_step()"), (tr.save_checkpoint, "save_checkpoint()"),
                       (tr.initialize, "initialize()"), (tr.weights, "weights()")):  # fmt: skip
        with pytest.raises(TiertrainError, match=rf"Trainer.{re.escape(name)}: this Trainer is closed"):
            call()


@pytest.mark.parametrize("mode", ["baseline", "overlap"])
def test_a_step_cut_short_by_hand_is_never_saved_torn_nor_stepped_on(tmp_path, monkeypatch, mode):
    """Found from outside: a notebook's interrupt in train_step()'s update (baseline) left some
    units updated; save_checkpoint() labelled them the last step's (the resumed run ended 1.4e-4
    away), and train_step() applied their update twice; cut in the forward, every later step
    was an IllegalTransition traceback. Now: cut in the update, the states are never saved nor
    stepped on; cut before it, they are saved whole (restored bit for bit), and no step follows."""
    import dataclasses

    from reference import small_config

    from tiertrain import faults
    from tiertrain.errors import TiertrainError
    from tiertrain.training.trainer import Trainer

    def cfg(name):
        c = small_config(tmp_path / name, steps=4)
        return dataclasses.replace(c, update=dataclasses.replace(c.update, mode=mode))

    with Trainer(cfg("straight")) as tr:
        tr.initialize(progress=False)
        straight = [tr.train_step().loss for _ in range(4)]
        want = tr.weights()
    real = faults.point

    def cut_at(where, n):
        seen = [0]

        def point(name):
            if name == where:
                seen[0] += 1
                if seen[0] == n:
                    raise KeyboardInterrupt
            return real(name)

        monkeypatch.setattr(faults, "point", point)

    # cut in the forward of step 3: step 2's states kept whole, saved, resumed bit for bit
    with Trainer(cfg("cut")) as tr:
        tr.initialize(progress=False)
        got = [tr.train_step().loss for _ in range(2)]
        cut_at("forward", 2)
        with pytest.raises(KeyboardInterrupt):
            tr.train_step()
        monkeypatch.setattr(faults, "point", real)
        with pytest.raises(TiertrainError, match=r"train_step\(\): step 3 was cut short \(KeyboardInterrupt\) and this "
                           r"Trainer cannot step on; save_checkpoint\(\) keeps the states of step 2 whole"):  # fmt: skip
            tr.train_step()
        saved = tr.save_checkpoint()
    with Trainer(cfg("cut")) as tr:
        tr.restore(saved.path)
        got += [tr.train_step().loss for _ in range(2)]
        assert got == straight
        assert all(torch.equal(v, want[k]) for k, v in tr.weights().items())
    if mode == "overlap":  # its update runs in its own thread, under the next step's forward
        return
    # cut in the update of step 3: some units updated, others not; nothing of them saved or stepped on
    with Trainer(cfg("torn")) as tr:
        tr.initialize(progress=False)
        [tr.train_step() for _ in range(2)]
        cut_at("update", 3)
        with pytest.raises(KeyboardInterrupt):
            tr.train_step()
        monkeypatch.setattr(faults, "point", real)
        for call, name in ((tr.save_checkpoint, "save_checkpoint()"), (tr.train_step, "train_step()"),
                           (tr.weights, "weights()"), (lambda: tr.restore(saved.path), "restore()")):  # fmt: skip
            with pytest.raises(TiertrainError, match=rf"Trainer.{re.escape(name)}: step 3 was cut short in its update "
                               r"\(KeyboardInterrupt\): some units hold its update and others not"):  # fmt: skip
                call()
        assert not os.path.exists(tmp_path / "torn" / "run" / "checkpoints")


def test_a_trainer_by_hand_never_replaces_another_runs_checkpoints_nor_starts_over_at_a_step(tmp_path):
    """Found from outside: Trainer(...).initialize() into the run directory of an earlier run, then
    save_checkpoint(), replaced its step-4 checkpoint without a word (train() and the command
    refuse that): refused at the save (initialize() then restore() of its own checkpoint goes
    on); initialize() again after steps put the initial weights back at step 3."""
    from reference import small_config

    from tiertrain.errors import TiertrainError
    from tiertrain.training.rundir import RunDirError
    from tiertrain.training.trainer import Trainer

    with Trainer(small_config(tmp_path, steps=2)) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        saved = tr.save_checkpoint()
        with pytest.raises(TiertrainError, match=r"initialize\(\): this Trainer is at step 1; initial weights now"):
            tr.initialize(progress=False)
    with Trainer(small_config(tmp_path, steps=2)) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        with pytest.raises(RunDirError, match=r"already holds a run \(step-00000001\)"):
            tr.save_checkpoint()
    with Trainer(small_config(tmp_path, steps=2)) as tr:
        tr.initialize(progress=False)  # (a frozen base's weights, say, before the checkpoint's adapters)
        tr.restore(saved.path)  # its own run: continued
        assert tr.step == 1
        tr.train_step()
        assert tr.save_checkpoint() is not None
    other = small_config(tmp_path / "b", steps=2)
    other.train.run_dir = str(tmp_path / "run")
    with Trainer(other) as tr:  # another run's checkpoint into it: asked as run(resume=) asks
        with pytest.raises(RunDirError, match=r"already holds a run"):
            tr.restore(_copied(saved.path, tmp_path / "x"))
    assert os.path.isdir(saved.path)


def _copied(path, where):
    import shutil

    dest = os.path.join(where, os.path.basename(path))
    shutil.copytree(path, dest)
    return dest


def test_run_on_a_trainer_that_has_trained_is_refused_and_its_run_kept(tmp_path):
    """Python API: run() again on the Trainer that ran, with train.overwrite, deleted the run it
    had just finished and trained nothing; run() after train_step()s put the weights back to
    their start and kept the step count (losses 5.546, 5.284 where 4.934, 4.702). Refused, the
    run kept; and run() after close() was an AttributeError."""
    import os

    from reference import small_config

    from tiertrain.errors import TiertrainError
    from tiertrain.training.trainer import Trainer

    cfg = small_config(tmp_path, steps=2)
    cfg.train.overwrite = True
    with Trainer(cfg) as tr:
        tr.run(progress=False)
        with pytest.raises(TiertrainError, match=r"Trainer.run\(\): this Trainer ran, .* \(step 2\); make a new"):
            tr.run(progress=False)
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["step-00000002"]
    with Trainer(small_config(tmp_path / "b", steps=4)) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        with pytest.raises(TiertrainError, match=r"this Trainer ran, or took steps or a checkpoint \(step 1\)"):
            tr.run(progress=False)
    with pytest.raises(TiertrainError, match=r"Trainer.run\(\): this Trainer is closed"):
        tr.run(progress=False)
    # a start refused (the run directory holds a run) did nothing: asked again, refused for that again
    cfg.train.overwrite = False
    with Trainer(cfg) as tr:
        for _ in range(2):
            with pytest.raises(TiertrainError, match=r"already holds a run"):
                tr.run(progress=False)


def test_a_read_only_cache_or_prepare_output_and_paths_of_the_wrong_kind_are_one_line(
    tmp_path, capsys, readonly_dir, monkeypatch
):
    """Rows prepared into a read-only directory, or into a read-only cache (a home mounted
    read-only, as on some clusters): OSError tracebacks. A checkpoint's file given as the
    checkpoint said "no such directory"; --prompts-file /dev/null "no such file"."""
    rows = tmp_path / "r.jsonl"
    rows.write_text('{"text": "hello world this is text"}\n' * 30)
    line = one_line_error(capsys, ["prepare", "--input", str(rows), "--output", str(readonly_dir / "out")], 1)
    assert f"prepare --output = '{readonly_dir / 'out'}' is on a read-only filesystem" in line, line
    monkeypatch.setenv("XDG_CACHE_HOME", str(readonly_dir / "cache"))
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--data.corpus={rows}", "--data.seq_len=16")], 2)
    assert "the prepared-data cache for data.corpus ($XDG_CACHE_HOME, else ~/.cache: set XDG_CACHE_HOME" in line, line
    assert "is on a read-only filesystem" in line
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0
    ck = tmp_path / "run" / "checkpoints" / "step-00000001"
    capsys.readouterr()
    line = one_line_error(capsys, ["eval", "--checkpoint", str(ck / "manifest.json")], 1)
    assert f"--checkpoint {ck / 'manifest.json'} is a file (it is in the checkpoint {ck}); give a checkpoint" in line
    line = one_line_error(capsys, ["generate", "--checkpoint", str(ck), "--prompts-file", "/dev/null"], 2)
    assert "--prompts-file /dev/null: holds no prompt" in line, line


def test_prepare_refuses_a_device_and_draws_no_bar_into_a_log(tmp_path, capsys):
    """`prepare --input /dev/zero` read until interrupted (an endless stream of NULs); its bar
    was drawn into logs (stderr no terminal), where training's is not."""
    line = one_line_error(capsys, ["prepare", "--input", "/dev/zero", "--output", str(tmp_path / "z.tokens")], 1)
    assert "prepare --input = '/dev/zero' is a device, not a file" in line, line
    text = tmp_path / "t.txt"
    text.write_text("in the beginning " * 50)
    assert main(["prepare", "--input", str(text), "--output", str(tmp_path / "t.tokens")]) == 0
    err = capsys.readouterr().err
    assert "wrote 850 tokens" in err and "tokenize" not in err and "%|" not in err, err


def test_a_disk_probe_larger_than_the_disk_names_its_option(tmp_path, capsys):
    """`plan --probe-mib 100000000` said "free 95.3 TiB more or choose another path", never the
    option that asked for the 95 TiB; and nothing of the probe is left behind."""
    line = one_line_error(capsys, ["plan", "--probe-mib=100000000", *tiny_flags(tmp_path / "p")], 1)
    assert "--probe-mib = 100000000: the disk probe writes 100,000,000 MiB into" in line, line
    assert "give a smaller --probe-mib (default 256)" in line
    assert not (tmp_path / "p").exists()


def test_a_disk_probe_over_several_paths_asks_each_filesystem_its_share(tmpfs):
    """The probe's file is striped over io.paths: each filesystem holds its paths' shares (two
    disks of 3 MiB free were refused a 4 MiB probe, as if each held all of it)."""
    from tiertrain.cost.probe import probe_fits
    from tiertrain.errors import UsageError

    a, b = tmpfs("a", 3072), tmpfs("b", 3072)
    probe_fits(4, [str(a), str(b)], stripe_kib=1024)  # 2 MiB each, and a stripe to spare
    with pytest.raises(
        UsageError,
        match=r"into .*/a/x \(striped over the 2 io.paths: 6 MiB on this filesystem\), whose filesystem has 3 MiB",
    ):
        probe_fits(4, [str(a / "x"), str(a / "y")], stripe_kib=1024)  # one filesystem holds both shares
    with pytest.raises(UsageError, match=r"--probe-mib = 8: the disk probe writes 8 MiB into"):
        probe_fits(8, [str(a), str(b)], stripe_kib=1024)


def test_plan_checks_its_paths_and_plans_top_k_on_the_engines(tmp_path, capsys):
    """`plan --io.paths=FILE` ended in a FileExistsError traceback (/proc/x: "give a smaller
    --probe-mib"); `plan` of a valid engines run with top-k failed, comparing the other update
    paths, which cannot run top-k ("update.topk ... set update.mode = 'engines'")."""
    (tmp_path / "file").write_text("x")
    flags = [f for f in tiny_flags(tmp_path / "p") if not f.startswith("--io.paths")]
    line = one_line_error(capsys, ["plan", "--probe-mib=1", f"--io.paths={tmp_path / 'file'}", *flags])
    assert "io.paths" in line and str(tmp_path / "file") in line, line
    topk = ["--update.mode=engines", "--update.topk=0.1"]
    assert main(["plan", "--probe-mib=1", *tiny_flags(tmp_path / "q"), *topk]) == 0


def test_a_bad_peft_config_to_start_from_is_named(tmp_path):
    """adapter.init_from's adapter_config.json without "r" raised KeyError: 'r', one that is not
    an object an AttributeError; --adapter.init_from=none tried to open none/adapter_config.json."""
    from tiertrain.config import ConfigError, load_config

    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "lora_alpha": 8}')
    lora = ["--adapter.kind=lora", f"--adapter.init_from={tmp_path}"]
    with pytest.raises(ConfigError, match=r"adapter_config.json has no 'r'"):
        load_config(None, lora)
    (tmp_path / "adapter_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"adapter_config.json is not an object \(a list\)"):
        load_config(None, lora)
    assert load_config(None, ["--adapter.kind=lora", "--adapter.init_from=none"]).adapter.init_from is None


def test_a_failed_command_leaves_no_directory_it_made_for_its_output(tmp_path, capsys):
    """`eval --out NEW/a/b/res.json` made NEW/a/b before the work: a command that failed left them."""
    out = tmp_path / "new" / "a" / "b" / "res.json"
    line = one_line_error(capsys, ["eval", f"--out={out}", "--data.eval_corpus=/nonexistent"], 2)
    assert "/nonexistent" in line and not (tmp_path / "new").exists()
    (tmp_path / "text.txt").write_text("in the beginning was the word " * 50)
    model = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4", "--data.seq_len=32"]
    assert main(["eval", f"--out={out}", f"--data.eval_corpus={tmp_path / 'text.txt'}", *model]) == 0
    assert out.exists()  # (a command that succeeds keeps them, with its output)


def test_a_short_budget_never_halves_the_chunk_below_the_users_checksum_blocks(tmp_path, capsys):
    """The planner halves the I/O chunk where the fixed pools pass the budget: with 16 MiB
    checksum blocks it went to 8 MiB and the config refused a value the user never set
    ("io.checksum_block_kib = 16384: must divide io.chunk_kib (8192)")."""
    blocks = ["--io.checksum_block_kib=16384", "--io.stripe_kib=16384", "--memory.host_mib=150"]
    flags = [f for f in tiny_flags(tmp_path) if not f.startswith(("--io.", "--memory."))]  # the chunk its default
    code = main(["plan", "--probe-mib=1", f"--io.paths={tmp_path / 'ssd'}", *flags, *blocks])
    err = capsys.readouterr().err
    assert "must divide io.chunk_kib" not in err and "Traceback" not in err, err
    assert code == 0 or "memory.host_mib" in err, err


@pytest.mark.parametrize(
    "var, spec, said",
    [
        ("TIERTRAIN_KILL_AT", "forward:x", "expected point or point:n, e.g. update:3"),
        ("TIERTRAIN_KILL_AT", "foward:3", "no point 'foward'; the points are forward, backward, update"),
        ("TIERTRAIN_SLOW_AT", "forward:x", "expected point:seconds or point:seconds:n"),
        ("TIERTRAIN_SLOW_AT", "upate:0.1", "no point 'upate'"),
    ],
)
def test_a_fault_variable_that_does_not_parse_is_one_line_and_a_misspelt_point_is_refused(var, spec, said):
    """The fault hooks (tests' kill and slow points) printed a traceback per rank for a bad
    number, and a misspelt point never fired: the run the test meant to break passed."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", "import tiertrain.faults"], capture_output=True, text=True, env={**os.environ, var: spec}
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().startswith(f"tiertrain: {var}={spec!r}: ") and said in r.stderr, r.stderr


def test_a_trainer_left_open_is_named_as_this_process_and_lets_go_when_collected(tmp_path):
    """A notebook's Trainer never closed (a cell failed after making it, or `del t`): the next
    Trainer on its directories was told they were "in use by another tiertrain run" naming its
    own pid, and only a restart of the process freed them. Said as this process's, with the
    fix; once the Trainer is collected its directories are free."""
    import gc

    from reference import small_config

    from tiertrain.errors import TiertrainError
    from tiertrain.training.trainer import Trainer

    cfg = small_config(tmp_path, steps=1)
    left = Trainer(cfg)
    with pytest.raises(TiertrainError, match=r"this very process, since .*: a Trainer .* not closed; close\(\) it"):
        Trainer(cfg)
    del left
    gc.collect()
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        assert math.isfinite(tr.train_step().loss)


def test_restore_takes_a_run_directory_as_train_resume_does(tmp_path):
    """Python API: Trainer.restore(run_dir) failed with "not a complete checkpoint: it has no
    manifest.json", though train(resume=run_dir) takes a run directory (its latest checkpoint)."""
    from reference import small_config

    from tiertrain.training.trainer import Trainer

    cfg = small_config(tmp_path, steps=2)
    with Trainer(cfg) as tr:
        tr.run(progress=False)
        want = tr.weights()
    cfg.train.run_dir = str(tmp_path / "other")
    with Trainer(cfg) as tr:
        assert tr.restore(str(tmp_path / "run")).step == 2 and tr.step == 2
        got = tr.weights()
    with Trainer(cfg) as tr:  # the checkpoints directory itself, as train(resume=) takes it
        assert tr.restore(str(tmp_path / "run" / "checkpoints")).step == 2
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_damaged_manifest_names_the_newest_intact_checkpoint_before_it(tmp_path, capsys):
    """Found from outside: --resume of a run whose newest manifest is damaged said "use an earlier
    checkpoint", naming none (the other kinds of damage name it and the command)."""
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=1", steps=2)]) == 0
    manifest = tmp_path / "run" / "checkpoints" / "step-00000002" / "manifest.json"
    manifest.write_text(manifest.read_text()[:-40])
    capsys.readouterr()
    line = one_line_error(capsys, ["train", "--resume", str(tmp_path / "run"), "--train.steps=3"], 1)
    good = tmp_path / "run" / "checkpoints" / "step-00000001"
    assert line.endswith(f"(the newest intact checkpoint before it is {good}: `tiertrain train --resume {good}`)"), line
