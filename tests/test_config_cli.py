"""The config tree (TOML, flags, validation) and the command line."""

import json
import os
import re
import subprocess
import sys

import pytest
from reference import ON_SSD

from tiertrain.cli import main
from tiertrain.config import Config, ConfigError, IOConfig, config_reference, load_config, parse_overrides


def test_defaults_are_the_main_job():
    cfg = Config()
    assert cfg.model.kind == "gpt" and cfg.data.corpus == "bundled" and cfg.io.paths == ["./tiertrain-scratch"]


def test_toml_then_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[optim]\nlr = 1e-3\n[io]\npaths = ["/a", "/b"]\n[model]\nkind = "llama"\n')
    cfg = load_config(
        str(f), ["--optim.lr=5e-4", "--data.micro_batches", "8", "--train.progress=false", "--model.n_kv_heads=none"]
    )
    assert cfg.optim.lr == 5e-4 and cfg.io.paths == ["/a", "/b"] and cfg.model.kind == "llama"
    assert cfg.data.micro_batches == 8 and cfg.train.progress is False and cfg.model.n_kv_heads is None
    assert load_config(None, ["--io.paths=/x,/y"]).io.paths == ["/x", "/y"]


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--optim.lr=-1"], r"optim\.lr = -1(\.0)?: must be between 0.0 and 10.0"),
        (["--memory.device_slots=1"], r"memory\.device_slots = 1: must be between 2 and 64"),
        (["--model.kind=bert"], r"model\.kind = 'bert': must be one of 'auto', 'gpt', 'llama', 'gpt2'"),
        (
            ["--model.d_model=100", "--model.n_heads=3"],
            r"model\.d_model = 100: must be divisible by model\.n_heads \(3\)",
        ),
        (["--io.chunk_kib=10"], r"io\.chunk_kib = 10: must be a positive multiple of 4"),
        (["--io.checksum_block_kib=3072"], r"io\.checksum_block_kib = 3072: must divide io\.chunk_kib"),
        (["--data.seq_len=2048"], r"data\.seq_len = 2048 is longer than model\.max_seq_len = 1024"),
        (["--data.corpus=/no/such/file"], r"data\.corpus = '/no/such/file': no such file"),
        (["--model.hf_dir=/tmp"], r"model\.hf_dir = '/tmp': no config.json there"),
        (["--optim.lr=fast"], r"optim\.lr = 'fast': expected a number"),
        (["--train.steps=1.5"], r"train\.steps = 1\.5: expected an integer"),
        (["--train.progres=false"], r"unknown field train\.progres; did you mean 'progress'\?"),
        (["--trian.steps=3"], r"unknown config section \[trian\]; did you mean 'train'\?"),
        (["--train.steps"], r"--train\.steps needs a value"),
        # the next flag is never taken for a value (it ran in a directory named '--train.steps=1')
        (["--train.run_dir", "--train.steps=1"], r"^--train\.run_dir needs a value: --train\.run_dir=VALUE$"),
        (["--train.overwrite", "--train.steps=3"], r"^--train\.overwrite needs a value"),
        (["steps=3"], r"unexpected argument 'steps=3': overrides look like --section\.field=value"),
        # a negative data seed failed at the first step, leaving a run directory that refused the next run;
        # a seed past 64 bits overflowed; a Llama with heads of odd size failed in its rotary embedding
        (["--data.seed=-1"], r"data\.seed = -1: must be between 0 and 9223372036854775807"),
        (["--train.seed=99999999999999999999"], r"train\.seed = 99999999999999999999: must be between 0 and"),
        (
            ["--model.kind=llama", "--model.d_model=12", "--model.n_heads=4"],
            r"model\.d_model = 12: gives heads of 3 \(/ model\.n_heads\): a Llama's rotary embeddings need an even",
        ),
    ],
)
def test_bad_configs_name_field_value_and_fix(flags, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, flags)


def test_a_text_field_keeps_the_flags_own_text():
    """Flags are TOML values, so --train.run_dir=1e-3 named the directory '0.001' and 2024#1
    '2024' (a comment); a text field takes the flag's text, numbers still parse (0x10 is 16)."""
    cfg = load_config(None, ["--train.run_dir=1e-3", "--train.steps=0x10", "--checkpoint.dir=runs/2024#1"])
    assert cfg.train.run_dir == "1e-3" and cfg.train.steps == 16 and cfg.checkpoint.dir == "runs/2024#1"
    assert load_config(None, ['--train.run_dir="a b"']).train.run_dir == "a b"  # a quoted TOML string: its text
    assert load_config(None, ["--checkpoint.dir=none"]).checkpoint.dir is None


def test_bad_toml_is_reported(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[optim\nlr = 1")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(str(f))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "none.toml"))
    # each once a traceback or a misleading line
    with pytest.raises(ConfigError, match=r"is a directory; give a TOML file"):
        load_config(str(tmp_path))
    for name, body, match in [
        ("bom.toml", b"\xef\xbb\xbf[train]\nsteps = 3\n", r"starts with a UTF-8 byte-order mark, which TOML forbids"),
        ("latin.toml", b'[train]\nrun_dir = "\xe9"\n', r"is not UTF-8 \(invalid continuation byte at byte 19\)"),
        (
            "top.toml",
            b"steps = 3\n",
            r"^steps = 3 is outside any section: every field belongs to a table; it is \[train\]'s",
        ),
    ]:
        (tmp_path / name).write_bytes(body)
        with pytest.raises(ConfigError, match=match):
            load_config(str(tmp_path / name))


def test_every_field_is_documented():
    ref = config_reference()
    for section in ("io", "model", "data", "optim", "memory", "update", "checkpoint", "train"):
        assert f"### [{section}]" in ref
    assert "| `threads` | `8` |" in ref
    rows = [line for line in ref.splitlines() if line.startswith("| `")]
    assert rows and all(not line.rstrip().endswith("|  |") for line in rows)


def test_cli_config_errors_exit_2_with_the_message(capsys):
    assert main(["train", "--optim.lr=-3"]) == 2
    assert "config error: optim.lr = -3" in capsys.readouterr().err


def test_cli_prints_resolved_config(capsys):
    assert main(["config", "--optim.lr=0.01"]) == 0
    out = capsys.readouterr().out
    assert "[optim]" in out and "lr = 0.01" in out


@pytest.mark.slow
def test_cli_trains_and_writes_metrics(tmp_path):
    run = tmp_path / "run"
    args = [
        "train",
        f"--io.paths={tmp_path / 'ssd'}",
        f"--train.run_dir={run}",
        "--train.steps=3",
        "--model.n_layers=2",
        "--model.d_model=64",
        "--data.seq_len=32",
        "--data.micro_batches=2",
        "--train.progress=false",
        *ON_SSD,
    ]
    r = subprocess.run([sys.executable, "-m", "tiertrain.cli", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [d["step"] for d in lines] == [1, 2, 3]
    for key in (
        "loss",
        "tokens_per_s",
        "ssd_read_bytes",
        "ssd_write_bytes",
        "ssd_read_gbps",
        "peak_host_bytes",
        "io_wait_s",
    ):
        assert key in lines[0]
    # (the update path is auto: overlapped here, step k's update moves its bytes in step k+1's line)
    assert lines[0]["ssd_read_bytes"] > 0 and lines[1]["ssd_write_bytes"] > 0
    assert "step 3/3 | loss" in r.stderr and "tok/s" in r.stderr and "ssd r" in r.stderr
    assert "scratch space needed" in r.stderr and "done: 3 steps" in r.stderr
    assert "exp_avg.bin" in r.stderr  # planned and used on the scratch tier ...
    assert not (tmp_path / "ssd").exists()  # ... and removed with the scratch directory the run made


def test_io_config_validation_standalone():
    with pytest.raises(ConfigError, match=r"io\.paths = \[\]: give at least one directory"):
        IOConfig(paths=[])
    with pytest.raises(ConfigError, match="paths must be distinct"):
        IOConfig(paths=["/a", "/a/"])
    assert parse_overrides(["--a.b=[1, 2]"]) == {"a": {"b": [1, 2]}}


def test_the_reference_page_is_the_config_reference_and_the_readme_is_short():
    """docs/reference.md ends with `tiertrain config --reference`, to the letter: a changed
    default or doc string must be regenerated there. The README stays a page a new user reads
    (the two commands, what it does, one walk-through, links), not the manual."""
    root = os.path.join(os.path.dirname(__file__), "..")
    ref = open(os.path.join(root, "docs", "reference.md")).read()
    assert ref.endswith(config_reference().rstrip() + "\n"), (
        "docs/reference.md out of date: regenerate it from `tiertrain config --reference`"
    )
    readme = open(os.path.join(root, "README.md")).read().splitlines()
    assert len(readme) <= 200, f"README.md has {len(readme)} lines: move details into docs/"
    assert (
        readme[0] == "# tiertrain" and "make train" in "\n".join(readme[:20]) and "make test" in "\n".join(readme[:20])
    )


def test_readme_links_resolve_and_docs_are_the_projects_own():
    """Every relative link in the README and docs/ points at a file of the repository, and no
    file points at the team's notes outside it (users do not have them)."""
    import re
    import subprocess

    root = os.path.join(os.path.dirname(__file__), "..")
    docs = [
        os.path.relpath(os.path.join(d, n), root)
        for d, _, names in os.walk(os.path.join(root, "docs"))
        for n in names
        if n.endswith(".md")
    ]
    assert "docs/DESIGN.md" in docs
    for doc in ["README.md", *docs]:
        text = open(os.path.join(root, doc)).read()
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if "://" not in target:
                assert os.path.exists(os.path.join(root, os.path.dirname(doc), target)), (doc, target)
    r = subprocess.run(
        ["git", "grep", "-n", "-I", "-E", r"\.\./shared|SYSTEM\.md", "--", ".", ":!tests/test_config_cli.py"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if r.returncode == 128:  # not a git checkout (an sdist): nothing to grep
        pytest.skip(f"git grep unavailable here: {r.stderr.strip()}")
    assert r.returncode == 1 and r.stdout == "", r.stdout  # 1: no match


def test_values_of_another_type_are_refused_not_turned_into_text_or_numbers(tmp_path):
    """Found from outside: `paths = [["x"], {a=1}]` made the directories "['x']" and "{'a': 1}",
    `run_dir = ["a", "b"]` the directory "['a', 'b']", `lr = true` a learning rate of 1.0."""
    import pytest

    from tiertrain.config import ConfigError, load_config

    for text, said in (('[io]\npaths = [["x"], {a=1}]\n', "io.paths = ['x']: expected text"),
                       ('[train]\nrun_dir = ["a", "b"]\n', "train.run_dir = ['a', 'b']: expected text"),
                       ("[optim]\nlr = true\n", "optim.lr = True: expected a number")):  # fmt: skip
        f = tmp_path / "c.toml"
        f.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_config(str(f))
    with pytest.raises(ConfigError, match=re.escape("optim.lr = True: expected a number")):
        load_config(None, ["--optim.lr=true"])
    assert load_config(None, ["--train.run_dir=5"]).train.run_dir == "5"  # a flag's text is text
