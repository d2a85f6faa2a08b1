"""The Python API (`tiertrain.train`, `Trainer`), `tiertrain plot`, TensorBoard event files, and
`tiertrain prepare` / `tiertrain train` on fine-tuning rows from the command line."""

import json
import os
import subprocess
import sys

import pytest
from reference import tiny_flags
from test_finetune_data import CHAT, make_tokenizer, write_jsonl

from tiertrain.cli import main
from tiertrain.errors import TiertrainError

TINY = {
    "model": {"n_layers": 2, "d_model": 64},
    "data": {"seq_len": 32, "micro_batch_size": 2, "micro_batches": 2},
    "train": {"steps": 3, "predict": False, "progress": False},
}


def _tree(tmp_path, **sections):
    tree = {k: dict(v) for k, v in TINY.items()}
    tree["io"] = {"paths": [str(tmp_path / "ssd")]}
    tree["train"]["run_dir"] = str(tmp_path / "run")
    for k, v in sections.items():
        tree.setdefault(k, {}).update(v)
    return tree


def test_train_from_a_dict_with_overrides_returns_the_records(tmp_path):
    import gc

    import tiertrain
    from tiertrain.training.trainer import Trainer

    recs = tiertrain.train(_tree(tmp_path), "--train.steps=2", "--optim.lr=1e-3")
    # the run's Trainer freed once train() returns (its parts hold each other: it lived on, with
    # its pools, until a collection, and the next run's budget was half of what it still held)
    assert not [o for o in gc.get_objects() if type(o) is Trainer]
    assert [r.step for r in recs] == [1, 2] and all(r.loss > 0 for r in recs)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in lines] == [r.loss for r in recs]
    # resumed from its checkpoint, two more steps; a Config is taken as it is
    from tiertrain import Config

    more = tiertrain.train(Config.from_dict(_tree(tmp_path, train={"steps": 4})), resume=str(tmp_path / "run"))
    assert [r.step for r in more] == [3, 4]
    with pytest.raises(TypeError, match="config must be a Config, a dict of sections, a TOML path or None, not int"):
        tiertrain.train(5)
    from tiertrain.config import ConfigError

    with pytest.raises(ConfigError, match="train.steps"):
        tiertrain.train(_tree(tmp_path), "--train.steps=0")


def test_the_trainer_runs_step_by_step(tmp_path):
    from tiertrain import Config, Trainer

    with Trainer(Config.from_dict(_tree(tmp_path))) as tr:
        tr.initialize(progress=False)
        losses = [tr.train_step().loss for _ in range(2)]
    assert len(losses) == 2 and losses[1] < losses[0] + 1.0
    with Trainer(_tree(tmp_path)) as tr:  # a dict of sections too
        tr.initialize(progress=False)
        assert tr.train_step().loss == losses[0]
        for _ in range(2):
            tr.train_step()
        # past train.steps it was "step 4/3" at the schedule's last rate, a step no resume repeats
        with pytest.raises(TiertrainError, match=r"train.steps = 3 steps are done; to train on, make the Trainer"):
            tr.train_step()


@pytest.mark.slow
def test_the_readme_python_example_runs(tmp_path):
    """The README's first ```python block, as it is, in a fresh process in an empty directory."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    start = readme.index("```python\n") + len("```python\n")
    code = readme[start : readme.index("```", start)]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "final loss" in run.stdout
    assert " WARNING " not in run.stderr, run.stderr[-3000:]  # (its warm-up was the whole run: said so)


@pytest.mark.slow
def test_the_callers_logging_takes_the_lines(tmp_path):
    """A script that configured logging (logging.basicConfig(filename=...)) got none of
    tiertrain.train()'s lines in its file: a stderr handler of tiertrain's took them, and one
    of the caller's own on the tiertrain logger then printed each twice."""
    log_file = tmp_path / "mine.log"
    code = (
        "import logging, sys, tiertrain\n"
        f"logging.basicConfig(filename={str(log_file)!r}, level=logging.INFO)\n"
        f"tiertrain.train({_tree(tmp_path)!r}, '--train.steps=1', progress=False)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 1/1 | loss" in log_file.read_text() and "step 1/1" not in run.stderr


@pytest.mark.slow
def test_plot_draws_several_runs_with_validation(tmp_path):
    import tiertrain

    tiertrain.train(_tree(tmp_path, data={"eval_corpus": "bundled"}, train={"eval_every": 1}))
    tiertrain.train(_tree(tmp_path, train={"run_dir": str(tmp_path / "run2")}))
    out = tmp_path / "curves.png"
    assert main(["plot", str(tmp_path / "run"), str(tmp_path / "run2"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["plot", str(tmp_path / "run")]) == 0 and (tmp_path / "run" / "curves.png").exists()
    assert main(["plot", str(tmp_path / "run2"), "--out", str(out)]) == 0  # an earlier plot: replaced
    # any other file of a .png name was replaced without a word (found from outside)
    (tmp_path / "photo.png").write_text("not a plot")
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "photo.png")]) == 1
    assert (tmp_path / "photo.png").read_text() == "not a plot"
    from tiertrain.errors import UsageError
    from tiertrain.plot import plot_runs, read_metrics

    assert len(read_metrics(str(tmp_path / "run"))) == 3
    with pytest.raises(UsageError, match=r"has no metrics\.jsonl; give a run directory"):
        plot_runs([str(tmp_path / "nothing")], str(out))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\nnot json\n')
    with pytest.raises(UsageError, match=r"metrics\.jsonl, line 2: not a step record"):
        read_metrics(str(tmp_path / "bad"))


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import tiertrain

    recs = tiertrain.train(
        _tree(tmp_path, data={"eval_corpus": "bundled"}, train={"eval_every": 2, "tensorboard": True})
    )
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("loss/train")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r.loss for r in recs], rel=1e-6)
    assert [e.step for e in acc.Scalars("loss/validation")] == [2, 3]
    assert {"optim/lr", "speed/tokens_per_s", "memory/peak_host_mib"} <= set(acc.Tags()["scalars"])


def test_prepare_and_train_on_chat_rows_from_the_command_line(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok")
    rows = write_jsonl(tmp_path / "chat.jsonl", [CHAT] * 6)
    assert main(["prepare", "--input", rows, "--output", str(tmp_path / "prep"), "--tokenizer", tok]) == 0
    meta = json.loads((tmp_path / "prep" / "meta.json").read_text())
    assert meta["kind"] == "chat" and meta["examples"] == 6 and 0 < meta["scored"] < meta["tokens"]
    flags = tiny_flags(
        tmp_path,
        f"--data.corpus={tmp_path / 'prep'}",
        f"--data.tokenizer={tok}",
        "--model.vocab_size=32",
        f"--data.eval_corpus={tmp_path / 'prep'}",
        "--train.eval_every=1",
        "--data.seq_len=16",
    )
    assert main(["train", *flags]) == 0
    rec = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rec) == 2 and all("eval_loss" in r["extra"] and r["extra"]["epoch"] > 0 for r in rec)
    capsys.readouterr()
    assert main(["prepare", "--input", rows, "--input", str(tmp_path / "x.txt"), "--output", str(tmp_path / "p2")]) != 0
    assert "prepare: give either text files (.txt: a token file) or rows" in capsys.readouterr().err


def test_the_apis_functions_take_the_configs_train_takes_and_name_wrong_arguments(tmp_path):
    """tiertrain.train(cfg, ["--a=1"]) and evaluate({...}) were AttributeErrors, generate(cfg,
    "hello") a TypeError from inside its loop: each now takes what train takes or names the
    argument and its form."""
    import tiertrain
    from tiertrain.config import ConfigError

    tree = _tree(tmp_path)
    for bad in (["--train.steps=1"], 5):
        with pytest.raises(TypeError, match=r"overrides are strings such as '--train.steps=3', each its own argument"):
            tiertrain.train(tree, bad)
    tree["data"] = {**tree.get("data", {}), "eval_corpus": "bundled", "eval_micro_batches": 1}
    res = tiertrain.evaluate(tree)  # a dict of sections, as train takes
    assert res.loss > 0
    for prompts, got in (("hello", "not str"), ([104, 105], "not a list holding int 104"), (None, "not NoneType")):
        with pytest.raises(TypeError, match=rf"prompts are a list of token-id lists, one a prompt, {got}; tokenize"):
            tiertrain.generate(tree, prompts)
    with pytest.raises(ConfigError, match=r"generate: no prompt given \(an empty list\)"):
        tiertrain.generate(tree, [])
    assert len(tiertrain.generate(tree, [[1, 2, 3]], tiertrain.Sampling(max_new_tokens=2))[0]) == 2
    import numpy as np  # ids as numpy gives them are ids

    assert len(tiertrain.generate(tree, [list(np.array([1, 2, 3]))], tiertrain.Sampling(max_new_tokens=1))[0]) == 1
    # found from outside: each of these was a traceback from inside the loop, or a row that never
    # met its end-of-sequence id
    with pytest.raises(TypeError, match=r"on_tokens is a function of each row's new token, not 5"):
        tiertrain.generate(tree, [[1, 2]], on_tokens=5)
    with pytest.raises(ConfigError, match=r"tokenizer_vocab = 'x': the tokenizer's size, a positive integer"):
        tiertrain.generate(tree, [[1, 2]], tokenizer_vocab="x")
    with pytest.raises(ConfigError, match=r"eos = \(999,\): outside the model's vocabulary \(0 to 255\)"):
        tiertrain.generate(tree, [[1, 2]], eos=(999,))


def test_sections_made_in_python_are_checked_as_the_files_are():
    """ModelConfig(n_layers="2") was a TypeError from a comparison inside the checks, a numpy
    integer a ConfigError, a pathlib.Path a path kept as an object: each field now takes the
    value a TOML file or a flag would give it, or names itself."""
    import pathlib

    import numpy as np

    from tiertrain.config import ConfigError, IOConfig, ModelConfig, OptimConfig, TrainConfig

    assert ModelConfig(n_layers="2").n_layers == 2
    assert TrainConfig(steps=np.int64(3)).steps == 3 and type(OptimConfig(lr=np.float32(0.5)).lr) is float
    assert IOConfig(paths=[pathlib.Path("/tmp/x")]).paths == ["/tmp/x"]
    assert TrainConfig(run_dir=pathlib.Path("runs/a")).run_dir == "runs/a"
    for make, message in (
        (lambda: ModelConfig(n_layers="two"), r"model.n_layers = 'two': expected an integer"),
        (lambda: TrainConfig(steps=2.5), r"train.steps = 2.5: expected an integer"),
        (lambda: OptimConfig(lr=True), r"optim.lr = True: expected a number"),
    ):
        with pytest.raises(ConfigError, match=message):
            make()


def test_prepare_examples_names_a_string_given_for_its_list(tmp_path):
    """prepare_examples("rows.jsonl", out) read the string a character at a time: "no such file
    'r'"; a list of pathlib paths is taken."""
    import pathlib

    from tiertrain import prepare_examples

    rows = write_jsonl(tmp_path / "rows.jsonl", [{"text": "In the beginning"}] * 3)
    with pytest.raises(TypeError, match=r"inputs are a list of paths, not '.*rows.jsonl'"):
        prepare_examples(str(rows), str(tmp_path / "out"), progress=False)
    meta = prepare_examples([pathlib.Path(rows)], tmp_path / "out", progress=False)
    assert meta["examples"] == 3


def test_the_api_names_a_bad_device_or_config(tmp_path):
    """Found from outside: generate(device='tpu') was an AttributeError deep inside, Trainer(None)
    one about 'absolute'."""
    import pytest

    from tests.reference import small_config
    from tiertrain.config import ConfigError
    from tiertrain.runtime import Runtime
    from tiertrain.training.trainer import Trainer

    with pytest.raises(ConfigError, match=r"device = 'tpu': give a tiertrain Device"):
        Runtime(small_config(tmp_path), device="tpu")
    with pytest.raises(ConfigError, match=r"Trainer\(cfg = None\): give a Config or a dict of sections"):
        Trainer(None)


def test_the_apis_config_forms_and_logging_set_up_after_a_first_run(tmp_path):
    """Found from outside: a pathlib.Path of a TOML file was refused where its text was taken;
    as_config(cfg, "--train.steps=3") said "unexpected argument '-'"; a dict with a section
    named 1 was difflib's TypeError; Trainer.pool_bytes after close() an AttributeError; and
    logging set up by the caller after a first train() never got tiertrain's lines."""
    import logging
    import pathlib

    import tiertrain
    from tiertrain import Trainer, as_config
    from tiertrain.config import ConfigError

    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nsteps = 3\n")
    assert as_config(pathlib.Path(toml)).train.steps == 3
    assert as_config(None, "--train.steps=5").train.steps == 5
    with pytest.raises(ConfigError, match=r"config section 1: section names are text"):
        as_config({1: {}})
    with Trainer(_tree(tmp_path)) as tr:
        pass
    with pytest.raises(TiertrainError, match=r"Trainer.pool_bytes: this Trainer is closed"):
        tr.pool_bytes.keys()
    root, log = logging.getLogger(), logging.getLogger("tiertrain")
    saved = root.handlers[:], log.handlers[:], log.propagate, log.level
    try:
        root.handlers[:] = []
        log.handlers[:] = []
        tiertrain.train(_tree(tmp_path), "--train.steps=1")
        logfile = tmp_path / "user.log"
        handler = logging.FileHandler(logfile)
        root.addHandler(handler)  # the caller's logging, set up after the first run
        tiertrain.train(_tree(tmp_path, train={"run_dir": str(tmp_path / "run2")}), "--train.steps=1")
        handler.close()
        assert "step 1/1 | loss" in logfile.read_text()
    finally:
        root.handlers[:], log.handlers[:] = saved[0], saved[1]
        log.propagate, log.level = saved[2], saved[3]


def test_a_trained_run_is_exported_from_python_and_init_from_a_run_names_the_way(tmp_path):
    """Found from outside: no function of the Python API exported a checkpoint, and
    model.init_from = a run directory said only "no model.safetensors there"."""
    import pathlib

    import tiertrain
    from tiertrain.config import ConfigError

    tiertrain.train(_tree(tmp_path), "--train.steps=1")
    out = tiertrain.export(pathlib.Path(tmp_path / "run"), tmp_path / "exported")
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    with pytest.raises(ConfigError, match=r"it is a tiertrain run or checkpoint: export it first"):
        tiertrain.train(
            _tree(tmp_path, model={"init_from": str(tmp_path / "run")}, train={"run_dir": str(tmp_path / "b")})
        )
    recs = tiertrain.train(
        _tree(tmp_path, model={"init_from": out}, train={"run_dir": str(tmp_path / "c")}), "--train.steps=1"
    )
    assert recs[0].step == 1
