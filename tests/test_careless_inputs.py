"""Careless inputs and full disks that ended in a traceback or in misleading advice: each is
one line naming the value or file and the fix, found before any work where it can be (issue
49, round three). The helpers are ``test_errors``'."""

import os
import re

import pytest
from reference import tiny_flags
from test_errors import nothing_left, one_line_error

from tiertrain.cli import main


def test_a_full_run_directory_is_one_line_naming_metrics_jsonl(tmp_path, capsys, tmpfs):
    """ENOSPC appending a step record: two tracebacks (the write's, then the close's), no file
    named. (Its checkpoints elsewhere: on that disk too, the run is refused at start, its first
    checkpoint would not fit.)"""
    full, ck = tmpfs("full", 16), tmp_path / "ck"
    flags = tiny_flags(tmp_path, f"--train.run_dir={full / 'run'}", f"--checkpoint.dir={ck}", steps=40)
    line = one_line_error(capsys, ["train", *flags], 1)
    assert f"writing the step records to {full / 'run' / 'metrics.jsonl'} failed: No space left on device" in line
    assert "free space on its filesystem or give the run another --train.run_dir" in line


def _state_bytes(flags):
    """Bytes of the states' files a run of ``flags`` claims (checksum sidecars not counted), as planned."""
    from tiertrain.config import load_config
    from tiertrain.runtime import Runtime
    from tiertrain.state.decl import SpacePlan
    from tiertrain.training.plan import plan_run

    cfg = load_config(None, flags).absolute()
    rt = Runtime(cfg)
    try:
        return SpacePlan(plan_run(cfg, rt).states).total
    finally:
        rt.close()


@pytest.mark.slow  # the engines are processes
def test_a_run_directory_too_full_for_its_config_is_one_line_naming_config_json(tmp_path, capsys, tmpfs):
    """config.json, written before the first step, on a full disk: one line naming it (a
    traceback), no temporary file left; a disk too full for the run directory's lock record:
    one line naming it (a traceback)."""
    full = tmpfs("full", 8)
    (full / "filler").write_bytes(bytes(4096))  # one page left: the lock file's
    (full / "run").mkdir()
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--train.run_dir={full / 'run'}")], 1)
    assert f"writing the run's config to {full / 'run' / 'config.json'} failed: No space left on device" in line, line
    assert [n for n in os.listdir(full / "run") if "tmp" in n] == []
    (full / "filler2").write_bytes(bytes(4096))  # no page left: the lock record itself does not fit
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--train.run_dir={full / 'run2'}")], 1)
    assert f"writing the lock record {full / 'run2' / '.tiertrain.lock'} failed: No space left on device" in line


def test_the_space_claimed_at_start_covers_the_checksum_sidecars(tmp_path, capsys, tmpfs):
    """A disk with room for the engines' files and not their .crc sidecars: the run started, and
    the engine's first save of a sidecar killed it with an OSError naming no file."""
    flags = tiny_flags(tmp_path, "--update.mode=engines")
    need = _state_bytes(flags)
    disk = tmpfs("disk", need // 1024 + 8)  # the files, the lock file and one 4 KiB block more
    line = one_line_error(capsys, ["train", *flags, f"--io.paths={disk / 'ssd'}"], 1)
    assert line.startswith(f"tiertrain: not enough space on the filesystem of {disk / 'ssd'}"), line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


def test_a_checksum_table_that_does_not_fit_is_named(tmp_path, tmpfs):
    from tiertrain.io import OutOfSpaceError
    from tiertrain.io.checksum import ChecksumTable

    disk = tmpfs("disk", 8)
    (disk / "filler").write_bytes(bytes(4096) * 2)  # the disk full
    with pytest.raises(OutOfSpaceError, match=rf"filesystem of {disk}/x\.crc: .*checksum table"):
        ChecksumTable(1 << 20, 4096).save(str(disk / "x.crc"))
    assert os.listdir(disk) == ["filler"]  # no temporary copy left


@pytest.mark.slow  # the engines are processes
def test_a_dead_engine_says_resume_only_where_a_checkpoint_exists(tmp_path, capsys, monkeypatch):
    """The engine's error said "resume from the last checkpoint" where there was none; the
    command line's hint names the checkpoint where there is one."""
    import tiertrain.faults  # noqa: F401 - read its environment now: the engines (new processes) are the ones killed

    monkeypatch.setenv("TIERTRAIN_KILL_AT", "update:1")
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, "--update.mode=engines")], 1)
    assert "update engine 0" in line and "died" in line and "last checkpoint" not in line, line
    assert (
        "stopped before its first checkpoint: there is nothing to resume; start it over with --train.overwrite" in line
    )
    monkeypatch.setenv("TIERTRAIN_KILL_AT", "update:30")  # after step 1 and its checkpoint
    flags = tiny_flags(tmp_path, "--update.mode=engines", "--checkpoint.every=1", "--train.overwrite=true", steps=4)
    line = one_line_error(capsys, ["train", *flags], 1)
    run = tmp_path / "run"
    assert re.search(
        rf"\(the last checkpoint is {run}/checkpoints/step-0000000[1-3]: `tiertrain train --resume {run}`\)$", line
    ), line


def test_a_run_killed_before_its_first_checkpoint_is_not_sent_in_a_circle(tmp_path, capsys):
    """A fresh start said "use --resume", --resume said "no complete checkpoint": each now says
    there is nothing to resume and how to start over, and that works."""
    import shutil

    assert main(["train", *tiny_flags(tmp_path)]) == 0
    run = tmp_path / "run"
    shutil.rmtree(run / "checkpoints")  # as a run killed before its first checkpoint leaves it
    advice = (
        "stopped before its first checkpoint: there is nothing to resume; start it over with --train.overwrite=true"
    )
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path)], 1)
    assert f"train.run_dir {run} already holds a run (metrics.jsonl, config.json); the run in {run} {advice}" in line
    assert "--resume" not in line.split(advice)[0], line
    for where, named in ((run, run), ("latest", run / "checkpoints"), (run / "checkpoints", run / "checkpoints")):
        line = one_line_error(capsys, ["train", *tiny_flags(tmp_path), f"--resume={where}"], 1)
        assert f"--resume {named}: no checkpoint there; the run in {run} {advice}" in line, line
    for cmd in ("eval", "generate"):  # (they were told to start the run over, without --resume)
        line = one_line_error(capsys, [cmd, f"--checkpoint={run}", *(["--prompt", "a"] if cmd == "generate" else [])])
        assert (
            f"--checkpoint {run}: no checkpoint there: the run in {run} stopped before its first checkpoint; give"
            in line
        ), line
    assert main(["train", *tiny_flags(tmp_path, "--train.overwrite=true")]) == 0
    # a run that stopped before its first step (a rank that failed at start: its config and an empty
    # metrics file) has nothing to keep: the same command starts over instead of being refused
    shutil.rmtree(run / "checkpoints")
    (run / "metrics.jsonl").write_text("")
    capsys.readouterr()
    assert main(["train", *tiny_flags(tmp_path)]) == 0
    assert (
        f"train.run_dir {run} holds a run that stopped before its first step (metrics.jsonl, config.json): started over"
        in capsys.readouterr().err
    )


@pytest.fixture
def no_generation(monkeypatch):
    """Generation fails the test: what is checked at start must be refused before it."""
    import tiertrain.inference.prompts as prompts

    def refuse(*args, **kwargs):
        raise AssertionError("generation ran before the input was checked")

    monkeypatch.setattr(prompts, "run_generate", refuse)


def test_generate_checks_out_and_the_prompts_file_before_any_work(tmp_path, capsys, tmpfs, no_generation):
    """--out read-only or a directory failed after generating, as a traceback; a binary
    --prompts-file was a UnicodeDecodeError."""
    ro = tmpfs("ro", 64, readonly=True)
    gen = ["generate", "--prompt", "hi", *tiny_flags(tmp_path)]
    (tmp_path / "d").mkdir()
    line = one_line_error(capsys, [*gen, f"--out={tmp_path / 'd'}"], 1)
    assert f"generate --out = '{tmp_path / 'd'}' is a directory; give a file name" in line
    for out in (ro / "x.jsonl", ro / "sub" / "x.jsonl"):
        line = one_line_error(capsys, [*gen, f"--out={out}"], 1)
        assert f"the directory of generate --out = '{out.parent}' is on a read-only filesystem ({ro})" in line, line
    binary = tmp_path / "p.txt"
    binary.write_bytes(b"\x00\xff\xfe\x80 a prompt")
    line = one_line_error(capsys, ["generate", f"--prompts-file={binary}", *tiny_flags(tmp_path)], 2)
    assert f"--prompts-file {binary} is not UTF-8 text (byte 1); give a text file" in line
    binary.write_bytes(b"a\x00b\n")
    line = one_line_error(capsys, ["generate", f"--prompts-file={binary}", *tiny_flags(tmp_path)], 2)
    assert f"--prompts-file {binary} holds NUL bytes: it is a binary file" in line
    nothing_left(tmp_path, "d", "ro", "p.txt")


def test_a_temperature_too_small_for_float32_is_refused_and_a_tiny_one_samples(tmp_path, capsys):
    """--temperature 1e-45 divided the logits into inf, and torch.multinomial raised on the NaN."""
    import torch

    from tiertrain.inference.generate import Sampling, _pick

    line = one_line_error(capsys, ["generate", "--prompt", "hi", "--temperature", "1e-45", *tiny_flags(tmp_path)], 2)
    assert "temperature = 1e-45 is below 1.18e-38, the smallest normal float32" in line
    assert "use 0 for greedy decoding" in line
    logits = torch.tensor([[100.0, 0.0, 99.0], [-5.0, 40.0, 39.0]])  # over the float32 range once divided
    gen = torch.Generator().manual_seed(0)
    assert _pick(logits, Sampling(temperature=1e-37), gen).tolist() == [0, 1]


def test_one_prompt_prints_its_prompt_as_several_do(tmp_path, capsys):
    flags = ["--max-new-tokens", "4", *tiny_flags(tmp_path)]
    assert main(["generate", "--prompt", "In the beginning", *flags]) == 0
    one = capsys.readouterr().out
    assert main(["generate", "--prompt", "In the beginning", "--prompt", "And God said", *flags]) == 0
    several = capsys.readouterr().out
    assert one.startswith("In the beginning") and one.count("\n") == 1, one
    assert several.startswith("In the beginning") and "\nAnd God said" in several, several


def test_generate_and_eval_of_a_checkpoint_refuse_another_model(tmp_path, capsys):
    """--model.hf_dir with --checkpoint ran the checkpoint's weights under the directory's config
    and tokenizer (or failed on a contradiction it did not name)."""
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0
    other = tmp_path / "other"
    other.mkdir()
    for cmd in (["generate", "--prompt", "hi"], ["eval"]):
        line = one_line_error(capsys, [*cmd, f"--checkpoint={tmp_path / 'run'}", f"--model.hf_dir={other}"], 2)
        assert f"model.hf_dir = '{other}' with --checkpoint: the model is the checkpoint's" in line, line
        assert "drop model.hf_dir, or leave out --checkpoint" in line


def test_plot_and_bench_io_refuse_a_bad_output_or_path_in_one_line(tmp_path, capsys, tmpfs, monkeypatch):
    """plot --out read-only: an OSError from savefig; bench io --path /proc/x: a FileNotFoundError
    from makedirs; both tracebacks. The benchmark's --out is checked before the benchmark."""
    import tiertrain.bench.io as bench_io

    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0
    ro = tmpfs("ro", 64, readonly=True)
    line = one_line_error(capsys, ["plot", str(tmp_path / "run"), f"--out={ro / 'c.png'}"], 1)
    assert f"the directory of plot --out = '{ro}' is on a read-only filesystem" in line, line
    line = one_line_error(capsys, ["plot", str(tmp_path / "run"), f"--out={tmp_path / 'c.txt'}"], 1)
    assert "matplotlib cannot write .txt files; give a name ending in .png" in line, line
    monkeypatch.setattr(bench_io, "run_io_bench", lambda *a, **k: pytest.fail("the benchmark ran before the checks"))
    line = one_line_error(capsys, ["bench", "io", "--path", "/proc/tiertrain-x", "--no-fio"], 1)
    assert "bench io --path = '/proc/tiertrain-x' is inside /proc, a kernel filesystem" in line, line
    line = one_line_error(capsys, ["bench", "io", "--path", str(tmp_path / "b"), "--out", str(ro / "r.md")], 1)
    assert f"the directory of bench io --out = '{ro}' is on a read-only filesystem" in line, line


@pytest.mark.parametrize("family", ["gpt_neox", "granitemoeshared"])
def test_a_model_tiertrain_does_not_run_is_refused_at_start_in_one_line(tmp_path, capsys, family):
    """GPT-NeoX, a family not checked (its forward may compute outside its layers: refused, not
    silently computed without it); Granite-MoE with shared experts, a mixture of experts not
    checked (mixtures of experts were refused as "weight ... is missing", a wrong diagnosis)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM

    sizes = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    made = {
        "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**sizes, **ids)),
        "granitemoeshared": lambda: GraniteMoeSharedForCausalLM(
            GraniteMoeSharedConfig(**sizes, **ids, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)
        ),
    }[family]()
    made.save_pretrained(tmp_path / "m")
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--model.hf_dir={tmp_path / 'm'}")], 2)
    arch = {
        "gpt_neox": "GPTNeoXForCausalLM ('gpt_neox')",
        "granitemoeshared": "GraniteMoeSharedForCausalLM ('granitemoeshared')",
    }
    why = {"gpt_neox": "a family tiertrain has not been checked on", "granitemoeshared": "a mixture of experts"}[family]
    assert f"model.hf_dir = '{tmp_path / 'm'}': {arch[family]} is not a model tiertrain runs ({why}" in line, line
    from tiertrain.models.families import supported_names

    assert f"supported: {supported_names()}" in line and "Qwen3-MoE" in supported_names(), line
    nothing_left(tmp_path, "m")


def test_nproc_beyond_the_cores_or_the_memory_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """--nproc 64 on 2 cores started 64 ranks, each importing torch."""
    import psutil

    import tiertrain.dist.launch as launch
    import tiertrain.ranks_fit as fit

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("ranks started"))
    monkeypatch.setattr(fit, "_cores", lambda: 2)
    line = one_line_error(capsys, ["train", "--nproc", "64", *tiny_flags(tmp_path)], 1)
    assert "--nproc 64: this machine has 2 cores for this process; each rank computes on one at least" in line
    assert "use --nproc 2 or fewer" in line
    monkeypatch.setattr(fit, "_cores", lambda: 64)
    half = (psutil.virtual_memory().available >> 20) // 2
    line = one_line_error(capsys, ["train", "--nproc", "4", f"--memory.host_mib={half}", *tiny_flags(tmp_path)], 1)
    assert (
        f"--nproc 4: 4 ranks need {4 * (half + 384):,} MiB (each 384 MiB for its process and memory.host_mib = " in line
    )
    assert "and their launcher 256 MiB" in line  # (measured from outside: 342 MiB a rank, 224 the launcher)
    assert "use --nproc 1 or fewer, or lower memory.host_mib" in line
    nothing_left(tmp_path)


def test_adapter_init_from_without_adapters_is_refused(tmp_path, capsys):
    """It was ignored: the model itself trained, from its own weights."""
    (tmp_path / "adapter").mkdir()
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, f"--adapter.init_from={tmp_path / 'adapter'}")], 2)
    assert (
        f"adapter.init_from = '{tmp_path / 'adapter'}': is a peft adapter to start from: set adapter.kind = 'lora'"
        in line
    )
    nothing_left(tmp_path, "adapter")


@pytest.mark.parametrize(
    "flag", ["--adapter.target_parameters=down_proj", "--adapter.rank=8", "--adapter.target=q_proj,v_proj"]
)
def test_adapter_settings_without_adapters_are_refused(tmp_path, capsys, flag):
    """They were ignored: the run fine-tuned every weight of the model, without a word."""
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, flag)], 2)
    name = flag.split("=")[0].removeprefix("--")
    assert line.startswith(f"tiertrain: config error: {name} = ") and "adapter.kind = 'none' trains the model" in line
    assert "set adapter.kind = 'lora' too, or unset it" in line
    nothing_left(tmp_path)


def test_an_export_has_one_file_mode(tmp_path):
    """The safetensors shards were 0600 (safetensors writes through a temporary file), the rest 0644."""
    mask = os.umask(0o022)
    try:
        assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0
        assert main(["export", f"--checkpoint={tmp_path / 'run'}", f"--out={tmp_path / 'e'}"]) == 0
    finally:
        os.umask(mask)
    modes = {n: oct(os.stat(tmp_path / "e" / n).st_mode & 0o777) for n in os.listdir(tmp_path / "e")}
    assert any(n.endswith(".safetensors") for n in modes) and set(modes.values()) == {"0o644"}, modes


def test_the_readmes_example_step_line_has_the_fields_a_run_prints(tmp_path, capsys):
    """The README's line had drifted from what `make train` prints (the overlapped update, the
    planner's choice for the default job, adds its thread's time): its fields, numbers aside."""
    import re

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    shown = re.search(r"```\n(step 40/40 \|[^\n]*)\n```", readme).group(1)
    assert main(["train", *tiny_flags(tmp_path, "--update.mode=overlap")]) == 0
    printed = [ln for ln in capsys.readouterr().err.splitlines() if " INFO step 2/2 |" in ln][0].split(" INFO ")[1]

    def fields(line):
        return re.sub(r"\d[\d,]*(\.\d+)?", "N", re.sub(r" +", " ", line))

    assert fields(shown) == fields(printed), (shown, printed)


def test_no_output_overwrites_what_the_command_reads_a_checkpoint_or_a_users_file(tmp_path, capsys):
    """`generate --out` the prompts file replaced the prompts by its JSONL; an --out inside a
    checkpoint destroyed it (eval then: "format version None"); `prepare --output` replaced a
    user's text by tokens; `eval --out DIR` raised IsADirectoryError after the whole eval."""
    assert main(["train", *tiny_flags(tmp_path, steps=1)]) == 0
    ck = str(tmp_path / "run" / "checkpoints" / "step-00000001")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\nhow are you\n")
    mine = tmp_path / "n.txt"
    mine.write_text("precious")
    capsys.readouterr()
    cases = [
        (["generate", "--checkpoint", ck, "--prompts-file", str(prompts), "--out", str(prompts)],
         "is also what the command reads; give another file"),
        (["generate", "--checkpoint", ck, "--prompt", "hi", "--out", f"{ck}/manifest.json"],
         f"is inside a checkpoint ({ck}): writing it would damage the checkpoint"),
        (["eval", "--checkpoint", ck, "--out", f"{ck}/eval.json"], "writing it would damage the checkpoint"),
        (["eval", "--checkpoint", ck, "--out", str(tmp_path)], "is a directory; give a file name"),
        (["prepare", "--input", str(prompts), "--output", str(mine)], "exists and is not a token file tiertrain wrote"),
    ]  # fmt: skip
    for argv, want in cases:
        assert main(argv) != 0, argv
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err and "loss" not in err, (argv, err)
    assert prompts.read_text() == "hello there\nhow are you\n" and mine.read_text() == "precious"
    assert "eval.json" not in os.listdir(ck)
    assert main(["eval", "--checkpoint", ck, "--data.eval_corpus=bundled", "--data.eval_micro_batches=1"]) == 0
    tok = tmp_path / "t.tok"
    assert main(["prepare", "--input", str(prompts), "--output", str(tok)]) == 0
    assert main(["prepare", "--input", str(prompts), "--output", str(tok)]) == 0  # a token file is replaced


def test_settings_without_effect_are_said(tmp_path, capsys):
    """Valid settings that do nothing as combined ran without a word: a warm-up as long as the
    run (the learning rate never reached optim.lr), an eval corpus with no eval_every, top-k /
    top-p at temperature 0, and eval / generate of a random model (only an INFO line said it)."""
    assert main(["train", *tiny_flags(tmp_path, "--data.eval_corpus=bundled", steps=2)]) == 0
    assert main(["generate", "--prompt", "hi", "--top-k", "5", "--max-new-tokens", "1"]) == 0
    assert main(["eval", "--data.eval_corpus=bundled", "--data.eval_micro_batches=1"]) == 0
    said = capsys.readouterr().err
    assert "optim.warmup_steps = 10 is at least train.steps = 2: the learning rate never reaches optim.lr" in said
    assert "data.eval_corpus = 'bundled' is set but train.eval_every = 0: no validation runs" in said
    assert said.count("top_k = 5, top_p = 1 have no effect at temperature 0") == 1
    for cmd in ("generate", "eval"):
        assert f"{cmd}: no --checkpoint, model.hf_dir or model.init_from: the model's weights are random" in said
    flags = tiny_flags(tmp_path / "b", "--optim.warmup_steps=1", "--train.eval_every=1", "--data.eval_corpus=bundled")
    assert main(["train", *flags, "--data.eval_micro_batches=1"]) == 0
    said = capsys.readouterr().err
    assert "warmup_steps" not in said and "no validation" not in said


def test_eval_of_a_lora_checkpoint_with_adapters_off_names_the_checkpoints_kind(tmp_path, capsys):
    """`eval --checkpoint LORA_RUN --adapter.kind=none` blamed `adapter.rank = 4`, a setting the
    user never gave (the checkpoint's), as if this were training."""
    assert main(["train", *tiny_flags(tmp_path, "--adapter.kind=lora", "--adapter.rank=4", steps=1)]) == 0
    capsys.readouterr()
    ev = ["eval", "--checkpoint", str(tmp_path / "run"), "--data.eval_corpus=bundled", "--data.eval_micro_batches=1"]
    assert main([*ev, "--adapter.kind=none"]) == 2
    err = capsys.readouterr().err
    assert (
        "adapter.kind = 'none' with --checkpoint: the checkpoint was trained with adapter.kind = 'lora' and is read"
        in err
    )
    assert "with its adapters; leave --adapter.kind out" in err
    assert "adapter.rank" not in err, err
    assert main(ev) == 0


def test_a_checkpoint_whose_model_directory_moved_runs_with_its_new_place(tmp_path, capsys, monkeypatch):
    """A run of a Hugging Face model whose directory then moved: eval, generate and export of
    its checkpoint failed ("no config.json there"), and giving the new place was refused ("drop
    model.hf_dir"); export took no such flag. The gone directory is named, and its new place
    taken where the recorded one is gone (and only there: the test above); the tokenizer its run
    found in that directory (data.tokenizer) moves with it (it was still read from the old place:
    "data.tokenizer = '.../model': not a directory")."""
    from test_eval import _text
    from test_finetune_data import make_tokenizer

    monkeypatch.chdir(tmp_path)
    flags = _hf_run_flags(tmp_path)
    make_tokenizer(tmp_path / "model")
    assert main(["train", *flags]) == 0
    os.mkdir("other")
    line = one_line_error(capsys, ["export", "--checkpoint=run", "--out=exp", "--model.hf_dir=other"], 2)
    assert "model.hf_dir = 'other' with export --checkpoint: the model is the checkpoint's" in line, line
    assert "which is still there); drop model.hf_dir" in line and "leave out" not in line, line  # export needs it
    os.rename("model", "moved")
    ev = ["eval", "--checkpoint=run", f"--data.eval_corpus={_text(tmp_path)}", "--data.eval_micro_batches=1"]
    line = one_line_error(capsys, ev, 2)
    assert "is gone: where it has moved, give its new place with --model.hf_dir=DIR" in line, line
    assert main([*ev, "--model.hf_dir=moved"]) == 0
    assert main(["generate", "--checkpoint=run", "--prompt", "hi", "--max-new-tokens=2", "--model.hf_dir=moved"]) == 0
    line = one_line_error(capsys, ["export", "--checkpoint=run", "--out=exp"], 2)
    assert "--model.hf_dir=DIR" in line, line
    assert main(["export", "--checkpoint=run", "--out=exp", "--model.hf_dir=moved"]) == 0
    assert os.path.isfile("exp/config.json") and os.path.isfile("exp/tokenizer.json")


def _hf_run_flags(tmp_path, *extra):
    """A run of a tiny Hugging Face Llama saved by transformers into ``tmp_path/model``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "model")  # fmt: skip
    flags = tiny_flags(tmp_path, "--model.kind=auto", f"--model.hf_dir={tmp_path / 'model'}", *extra, steps=1)
    return [f for f in flags if not f.startswith(("--model.n_layers", "--model.d_model"))]


def test_a_checkpoint_given_another_models_directory_of_the_same_sizes_is_refused(tmp_path, capsys):
    """A checkpoint of a Llama with a tied head resumed (or evaluated) with --model.hf_dir of
    the same shape untied: its units pad to the same sizes, so the layout check passed and the
    untied head was never restored (loss ln V, the head all zeros after a step)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiertrain.checkpoint import Manifest, latest_checkpoint

    torch.manual_seed(0)
    # the head (256 x 32) and the final norm fit in the padding of the tied model's last unit
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True)).save_pretrained(tmp_path / "tied")
    LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False)).save_pretrained(tmp_path / "untied")
    flags = [f for f in _hf_run_flags(tmp_path) if not f.startswith("--model.hf_dir")]
    assert main(["train", *flags, f"--model.hf_dir={tmp_path / 'tied'}"]) == 0
    man = Manifest.read(latest_checkpoint(str(tmp_path / "run" / "checkpoints")))
    assert man.params.startswith("20 tensors of ") and "sha256 " in man.params  # no head of its own: 20, not 21
    capsys.readouterr()
    other = f"--model.hf_dir={tmp_path / 'untied'}"
    line = one_line_error(capsys, ["train", "--resume", str(tmp_path / "run"), "--train.steps=2", other], 1)
    assert f"was written for a model with other parameters ({man.params}) than this run's (21 tensors of " in line
    assert "a tied head against an untied one" in line, line
    os.rename(tmp_path / "tied", tmp_path / "moved")  # eval takes another directory only for a moved model
    line = one_line_error(capsys, ["eval", f"--checkpoint={tmp_path / 'run'}", other], 1)
    assert f"holds a model with other parameters ({man.params}) than model.hf_dir {tmp_path / 'untied'}" in line, line


def test_eval_and_generate_of_a_checkpoint_read_its_base_as_it_trained(tmp_path, capsys):
    """A LoRA checkpoint of a bf16 base evaluated with --model.base_dtype=nf4 was quantized
    again without a word (its loss moved); an NF4 one given another dtype had the flag ignored."""
    lora = ("--adapter.kind=lora", "--adapter.rank=4", "--model.base_dtype=bfloat16")
    assert main(["train", *_hf_run_flags(tmp_path, *lora)]) == 0
    for cmd in (["eval"], ["generate", "--prompt", "hi"]):
        line = one_line_error(capsys, [*cmd, f"--checkpoint={tmp_path / 'run'}", "--model.base_dtype=nf4"], 2)
        assert "model.base_dtype = 'nf4' with --checkpoint: the checkpoint's base is read as its run trained it" in line
        assert "(model.base_dtype = 'bfloat16'); drop model.base_dtype" in line, line
    line = one_line_error(capsys, ["eval", f"--checkpoint={tmp_path / 'run'}", "--model.base_double_quant=true"], 2)
    assert "model.base_double_quant = True with --checkpoint" in line, line
    # a checkpoint without adapters has no frozen base: not advised to `export --merge` it (which
    # refuses a checkpoint without adapters)
    assert main(["train", *_hf_run_flags(tmp_path / "full")]) == 0
    line = one_line_error(capsys, ["eval", f"--checkpoint={tmp_path / 'full' / 'run'}", "--model.base_dtype=nf4"], 2)
    assert "model.base_dtype = 'nf4' is for a frozen model under adapters" in line and "--merge" not in line, line


def test_refusals_to_resume_advise_what_fits_the_run(tmp_path, capsys):
    """A Hugging Face model's run resumed cut otherwise was told to resume with the built-in
    GPT's shape (model.n_layers = 4, model.d_model = 256); a LoRA run resumed with another
    optimizer, to export and start from --model.hf_dir (its export is adapters, not a model)."""
    lora = ("--adapter.kind=lora", "--adapter.rank=4", "--checkpoint.every=1")
    assert main(["train", *_hf_run_flags(tmp_path, *lora)]) == 0
    capsys.readouterr()
    run = str(tmp_path / "run")
    line = one_line_error(capsys, ["train", f"--resume={run}", "--train.steps=2", "--model.layer_pieces=2"], None)
    assert f"model.hf_dir = '{tmp_path / 'model'}'" in line and "model.n_layers" not in line, line
    line = one_line_error(capsys, ["train", f"--resume={run}", "--train.steps=2", "--optim.name=adamw8bit"], 2)
    assert "--adapter.init_from=EXPORT" in line and "--model.hf_dir" not in line, line


def test_a_model_directory_without_a_tokenizer_is_said_and_its_export_takes_the_runs(tmp_path, capsys):
    """A model directory of the weights alone (and a generation_config.json) trained its text as
    UTF-8 bytes of a 512-token model without a word; given --data.tokenizer, its export held no
    tokenizer (the generation config was taken for one)."""
    import torch
    from test_finetune_data import make_tokenizer
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = tmp_path / "weights-only"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(model)  # fmt: skip
    GenerationConfig(max_new_tokens=4).save_pretrained(model)
    flags = [f for f in _hf_run_flags(tmp_path) if not f.startswith("--model.hf_dir")] + [f"--model.hf_dir={model}"]
    assert main(["train", *flags]) == 0
    err = capsys.readouterr().err
    assert (
        f"model.hf_dir {model} holds no tokenizer: the text is read as UTF-8 bytes (ids 0-255), not as the model's 512-token"
        in err
    )
    tok = make_tokenizer(tmp_path / "tok")
    run = tmp_path / "with-tok"
    assert main(["train", *flags, f"--train.run_dir={run}", f"--data.tokenizer={tok}"]) == 0
    assert "holds no tokenizer" not in capsys.readouterr().err
    assert main(["export", f"--checkpoint={run}", f"--out={tmp_path / 'exp'}"]) == 0
    assert (tmp_path / "exp" / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()


def test_an_export_keeps_the_models_generation_config_and_names_its_weights_dtype(tmp_path, capsys):
    """A model directory without tokenizer files exported without its generation_config.json (its
    end-of-sequence ids and sampling lost; the data.tokenizer directory's taken instead), and a
    full fine-tune of a bf16 directory wrote its fp32 weights under ``"dtype": "bfloat16"``
    (transformers' default load rounded the trained weights to bf16)."""
    import json

    import torch
    from safetensors.torch import load_file
    from test_finetune_data import make_tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    flags = _hf_run_flags(tmp_path)
    model = tmp_path / "model"
    m = AutoModelForCausalLM.from_pretrained(model)
    m.to(torch.bfloat16).save_pretrained(model)  # as most checkpoints ship: bf16
    GenerationConfig(eos_token_id=[1, 2, 3], do_sample=True, temperature=0.6, top_p=0.9).save_pretrained(model)
    tok = make_tokenizer(tmp_path / "tok")
    GenerationConfig(eos_token_id=7).save_pretrained(tok)  # another model's
    assert main(["train", *flags, f"--data.tokenizer={tok}"]) == 0
    run = [f.split("=", 1)[1] for f in flags if f.startswith("--train.run_dir=")][0]
    assert main(["export", f"--checkpoint={run}", f"--out={tmp_path / 'exp'}"]) == 0
    capsys.readouterr()
    exp = tmp_path / "exp"
    assert (exp / "generation_config.json").read_bytes() == (model / "generation_config.json").read_bytes()
    assert (exp / "tokenizer.json").is_file()
    assert json.loads((exp / "config.json").read_text())["dtype"] == "float32"
    written = {}
    for f in exp.glob("model-*.safetensors"):
        written.update(load_file(f))
    hf = AutoModelForCausalLM.from_pretrained(exp)  # transformers' default: the config's dtype
    assert hf.generation_config.eos_token_id == [1, 2, 3] and hf.generation_config.do_sample
    sd = hf.state_dict()
    assert {t.dtype for t in written.values()} == {torch.float32}
    assert all(torch.equal(sd[k], t) for k, t in written.items())


def test_settings_for_rows_given_with_a_text_corpus_are_said(tmp_path, caplog, monkeypatch):
    """--data.format=chat, --data.packing=false, --data.mask_prompt=false or
    --data.long_examples=drop with a .txt corpus gave the same loss as none of them, silently."""
    import logging

    from reference import small_config

    from tiertrain.data import open_corpus

    cfg = small_config(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tiertrain"):
        open_corpus(cfg.data)
        assert "not rows" not in caplog.text
        cfg.data.packing, cfg.data.long_examples = False, "drop"
        open_corpus(cfg.data)
    assert (
        "is text cut into windows, not rows: data.packing = False, data.long_examples = 'drop' set for rows"
        in caplog.text
    )
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # said by rank 0 alone (every rank printed it)
    with caplog.at_level(logging.WARNING, logger="tiertrain"):
        open_corpus(cfg.data)
    assert "not rows" not in caplog.text


def test_a_byte_order_mark_first_in_rows_or_prompts_is_not_text(tmp_path):
    """A BOM a Windows editor puts first: JSONL rows were refused with Python's advice to decode
    with utf-8-sig, and a prompts file kept it in its first prompt (another completion)."""
    from tiertrain.data.formats import read_rows
    from tiertrain.inference.prompts import _text_lines

    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "\xef\xbb\xbfsecond"}\n')
    assert [r for _, r in read_rows(str(rows))] == [{"text": "first"}, {"text": "\ufeffsecond"}]  # (only the file's)
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"\xef\xbb\xbfIn the beginning\r\nAnd God said\n")
    assert [ln.rstrip("\n") for ln in _text_lines(str(prompts))] == ["In the beginning", "And God said"]


def test_a_checkpoint_of_a_run_begun_from_an_adapter_does_not_read_that_adapter_again(tmp_path, capsys):
    """A run begun from a peft adapter (adapter.init_from): its checkpoints' resume, eval and
    generate read that directory again, so one since deleted, or holding a setting refused since,
    made its checkpoints unusable; the checkpoint holds the adapters it trained."""
    import json
    import shutil

    lora = ("--adapter.kind=lora", "--adapter.rank=4")
    assert main(["train", *_hf_run_flags(tmp_path / "a", *lora)]) == 0
    adapter = tmp_path / "adapter"
    assert main(["export", f"--checkpoint={tmp_path / 'a' / 'run'}", f"--out={adapter}"]) == 0
    flags = _hf_run_flags(tmp_path / "b", *lora, f"--adapter.init_from={adapter}")
    flags = [f if not f.startswith("--model.hf_dir") else f"--model.hf_dir={tmp_path / 'a' / 'model'}" for f in flags]
    assert main(["train", *flags]) == 0
    run = tmp_path / "b" / "run"
    conf = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**conf, "alpha_pattern": {"q_proj": 32}}))
    capsys.readouterr()
    assert main(["eval", f"--checkpoint={run}", "--data.eval_corpus=bundled", "--data.eval_micro_batches=1"]) == 0
    shutil.rmtree(adapter)
    assert main(["generate", f"--checkpoint={run}", "--prompt", "In the", "--max-new-tokens", "2"]) == 0
    assert main(["train", f"--resume={run}", "--train.steps=2"]) == 0


def test_a_run_that_keeps_no_checkpoint_says_so_at_start(tmp_path, capsys):
    """checkpoint.every = 0 with checkpoint.at_end = false threw the trained weights away without
    a word; a later --resume said the run "stopped before its first checkpoint"."""
    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.at_end=false", steps=1)]) == 0
    assert "checkpoint.every = 0 and checkpoint.at_end = false: this run keeps no checkpoint" in capsys.readouterr().err


def test_a_crash_before_the_first_checkpoint_says_how_to_keep_steps_next_time(tmp_path):
    """A run that saves only at its end (checkpoint.every = 0, the default) and crashed was told
    only to start over: the advice now names checkpoint.every, and not where it is set."""
    from tests.reference import small_config
    from tiertrain.training.advice import resume_hint

    cfg = small_config(tmp_path)
    os.makedirs(cfg.train.run_dir, exist_ok=True)
    open(os.path.join(cfg.train.run_dir, "metrics.jsonl"), "w").close()  # steps were done, no checkpoint
    hint = resume_hint(RuntimeError("boom"), cfg, None)
    assert "stopped before its first checkpoint" in hint, hint
    assert "(checkpoint.every = 0): give --checkpoint.every=N to keep the steps a crash would lose)" in hint, hint
    cfg.checkpoint.every = 5
    assert "checkpoint.every" not in resume_hint(RuntimeError("boom"), cfg, None)


@pytest.mark.parametrize(
    "where,err,said",
    [
        (
            "rng",
            5,
            "writing the checkpoint of step 2 in {ck} failed ({ck}/.tmp-step-00000002-{pid}/rng.safetensors: "
            "Input/output error); no earlier checkpoint exists",
        ),  # fmt: skip
        ("rng", 28, "not enough space for the checkpoint of step 2 in {ck}: it needs"),
        ("manifest", 5, "writing the checkpoint of step 2 in {ck} failed ("),
        ("root sync", 5, "the checkpoint of step 2 is in place at {ck}/step-00000002, but making it durable failed"),
    ],
)
def test_a_checkpoints_small_files_failing_are_one_line(tmp_path, capsys, monkeypatch, where, err, said):
    """An I/O error (or a full disk) in a checkpoint's RNG file, its manifest or its directory's
    sync was a traceback (only its state files' errors were said): now one line naming the file
    and whether the previous checkpoint is intact, or that the checkpoint is in place but may not
    be durable; nothing half-written is left."""
    import tiertrain.checkpoint.manifest as manifest
    import tiertrain.checkpoint.saver as saver

    ck = tmp_path / "run" / "checkpoints"

    def fail(path):
        raise OSError(err, os.strerror(err), str(path))

    if where == "rng":
        monkeypatch.setattr(saver, "write_tensors", lambda d, name, *a: fail(os.path.join(d, name)))
    elif where == "manifest":
        monkeypatch.setattr(manifest.Manifest, "write", lambda self, d: fail(os.path.join(d, "manifest.json")))
    else:
        real = saver.fsync_path
        monkeypatch.setattr(saver, "fsync_path", lambda p: fail(p) if os.path.abspath(p) == str(ck) else real(p))
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path)], 1)
    assert said.format(ck=ck, pid=os.getpid()) in line, line
    assert not [n for n in os.listdir(ck) if n.startswith(".tmp")], os.listdir(ck)


def test_an_export_that_fails_is_one_line_and_leaves_out_as_it_was(tmp_path, capsys, monkeypatch, tmpfs):
    """A full disk or an I/O error while exporting was a traceback (safetensors' SafetensorError, an
    OSError from a sync): one line naming --out, which is left as it was; a disk too small for the
    weights is refused before anything is written."""
    import safetensors.torch

    import tiertrain.checkpoint.export as export

    assert main(["train", *tiny_flags(tmp_path)]) == 0
    run, out = tmp_path / "run", tmp_path / "exp"
    small = tmpfs("small", 16)
    line = one_line_error(capsys, ["export", f"--checkpoint={run}", f"--out={small / 'exp'}"], 1)
    assert f"export --out {small / 'exp'}: not enough space on its filesystem: the weights need at least" in line
    assert os.listdir(small) == []

    def full(*a, **k):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full)
        line = one_line_error(capsys, ["export", f"--checkpoint={run}", f"--out={out}"], 1)
    assert line.startswith(f"tiertrain: export --out {out}: its filesystem is full (") and "is as it was" in line, line
    assert sorted(os.listdir(tmp_path)) == ["run", "small"], os.listdir(tmp_path)
    assert main(["export", f"--checkpoint={run}", f"--out={out}"]) == 0
    before = sorted(os.listdir(out))

    def eio(path):
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(export, "fsync_path", eio)
    line = one_line_error(capsys, ["export", f"--checkpoint={run}", f"--out={out}", "--overwrite"], 1)
    assert f"export --out {out}: writing the export failed (" in line and "Input/output error" in line, line
    assert sorted(os.listdir(out)) == before and not [n for n in os.listdir(tmp_path) if "exp" in n and n != "exp"]


def test_what_a_killed_export_left_is_cleaned_and_an_earlier_export_put_back(tmp_path, capsys):
    """A killed export left its hidden work directory (a whole model's size) for good, and one
    killed between its two renames left --out missing, the earlier export set aside as OUT.old-PID:
    the next export removes the first and puts the second back."""
    import shutil
    import subprocess
    import sys

    assert main(["train", *tiny_flags(tmp_path)]) == 0
    run, out = tmp_path / "run", tmp_path / "exp"
    assert main(["export", f"--checkpoint={run}", f"--out={out}"]) == 0
    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    shutil.copytree(out, tmp_path / f".exp.tmp-export-{pid}")  # killed while writing
    shutil.copytree(out, tmp_path / f".exp.tmp-export-{os.getppid()}")  # another export, still running
    os.rename(out, tmp_path / f"exp.old-{pid}")  # killed between the renames of an --overwrite
    capsys.readouterr()
    assert main(["export", f"--checkpoint={run}", f"--out={out}", "--overwrite"]) == 0
    assert "an export that replaced it was killed; the earlier one put back" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == sorted([f".exp.tmp-export-{os.getppid()}", "exp", "run"])


def test_a_missing_checkpoint_dir_is_named_not_taken_for_a_run_without_checkpoints(tmp_path, capsys):
    """A run whose checkpoint.dir (outside its run directory) is missing, say a disk not mounted:
    --resume said "--resume CKDIR: no such directory" (a path never typed), and a fresh start said
    the run stopped before its first checkpoint, advising --train.overwrite (which deletes its
    metrics). Both now name the missing checkpoint.dir; put back, the run resumes."""
    ckd = tmp_path / "ckd"
    flags = tiny_flags(tmp_path, f"--checkpoint.dir={ckd}")
    assert main(["train", *flags]) == 0
    run = tmp_path / "run"
    os.rename(ckd, tmp_path / "elsewhere")
    missing = f"its checkpoints are kept in {ckd} (checkpoint.dir, in {run}/config.json), which is missing"
    line = one_line_error(capsys, ["train", "--resume", str(run), "--train.steps=3"], 1)
    assert f"--resume {run}: {missing}" in line, line
    line = one_line_error(capsys, ["train", *flags], 1)
    assert f"{missing} (a disk not mounted?): put it back and continue it with `tiertrain train --resume {run}`" in line
    assert "overwrite" not in line and "stopped before its first checkpoint" not in line, line
    os.rename(tmp_path / "elsewhere", ckd)
    assert main(["train", "--resume", str(run), "--train.steps=3"]) == 0


def test_the_start_is_said_by_part(tmp_path, capsys):
    """A large model's start takes minutes with nothing said of what (an 8 B model's took more than
    150 s on a GPU machine, not broken down): one line says the start's parts, fresh or resumed."""
    parts = r"the model and data [\d.]+ s, the plan [\d.]+ s, pools and files [\d.]+ s"
    assert main(["train", *tiny_flags(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"started in [\d.]+ s: {parts}, initial weights [\d.]+ s\n", err), err[-2000:]
    assert main(["train", "--resume", str(tmp_path / "run"), "--train.steps=3"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"started in [\d.]+ s: {parts}, the checkpoint restored [\d.]+ s\n", err), err[-2000:]


def test_initial_weights_in_a_log_file_say_their_progress(tmp_path, monkeypatch, caplog):
    """Without a terminal (a log file, a batch job) the initial weights' bar is not drawn: a line
    every 30 s says how far they are (a large model's take minutes)."""
    import logging
    import types

    import tiertrain.training.initial as initial
    import tiertrain.training.trainer as trainer
    from tests.reference import small_config

    clock = iter(range(0, 10**6, 40))  # every reading 40 s after the one before
    monkeypatch.setattr(initial, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    caplog.set_level(logging.INFO, logger="tiertrain")
    with trainer.Trainer(small_config(tmp_path, layers=3)) as tr:
        tr.initialize(progress=False)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("initial weights:")]
    assert (
        said
        and said[0].startswith("initial weights: 0 of 5 units, ")
        and said[-1].startswith("initial weights: 4 of 5")
    )


def test_output_files_are_written_whole_and_never_over_what_is_not_theirs(tmp_path, capsys, tmpfs):
    """`generate --out` on a disk that filled destroyed the earlier file and left half a line;
    `eval --out` there was a traceback; both replaced any file given (a model's config.json, its
    weights, the eval text) without a word. Now an output is written aside and renamed (the
    earlier one kept where writing fails), and an existing file that is not an earlier output of
    the command is refused before the work (found from outside)."""
    assert main(["train", *tiny_flags(tmp_path)]) == 0
    run = tmp_path / "run"
    gen = ["generate", f"--checkpoint={run}", "--max-new-tokens=40", "--ignore-eos"]
    config = (run / "config.json").read_text()
    line = one_line_error(capsys, ["eval", f"--checkpoint={run}", f"--out={run / 'config.json'}"], 1)
    assert "exists and is not an earlier output of this command" in line, line
    line = one_line_error(capsys, [*gen, "--prompt=hi", f"--out={run / 'config.json'}"], 1)
    assert "exists and is not an earlier output of this command" in line and (run / "config.json").read_text() == config
    disk = tmpfs("disk", 64)
    out = disk / "rows.jsonl"
    assert main([*gen, "--prompt=hi", f"--out={out}"]) == 0  # an earlier output: replaced
    earlier = out.read_text()
    (disk / "filler").write_bytes(bytes(64 * 1024 - 8192 - len(earlier)))  # the disk full but for a page or so
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(200)))
    line = one_line_error(capsys, [*gen, f"--prompts-file={prompts}", f"--out={out}"], 1)
    assert f"generate --out {out}: writing it failed (No space left on device); {out} is as it was" in line, line
    assert out.read_text() == earlier and sorted(os.listdir(disk)) == ["filler", "rows.jsonl"]
    try:  # the last pages taken too
        with open(disk / "filler2", "wb") as f:
            while True:
                f.write(bytes(4096))
                f.flush()
    except OSError:
        pass
    res = disk / "new" / "res.json"
    line = one_line_error(capsys, ["eval", f"--checkpoint={run}", "--data.eval_corpus=bundled", f"--out={res}"], 1)
    assert f"eval --out {res}: writing it failed (No space left on device); {res} was not written" in line, line
    assert sorted(os.listdir(disk)) == ["filler", "filler2", "rows.jsonl"]  # (nor its directory)


@pytest.mark.slow  # a process of its own: a pipe and a full standard output
def test_a_closed_pipe_ends_quietly_and_a_full_stdout_is_one_line(tmp_path):
    import subprocess
    import sys

    assert main(["train", *tiny_flags(tmp_path)]) == 0
    cmd = [sys.executable, "-m", "tiertrain", "generate", f"--checkpoint={tmp_path / 'run'}", "--prompt=hello",
           "--max-new-tokens=200", "--ignore-eos"]  # fmt: skip
    head = subprocess.run(f"{' '.join(cmd)} | head -c 3; exit ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash",
                          capture_output=True, text=True)  # fmt: skip
    assert head.returncode == 141 and head.stdout == "hel" and "Traceback" not in head.stderr, head.stderr[-2000:]
    with open("/dev/full", "w") as full:
        r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "tiertrain: generate: writing to standard output failed (No space left on device)" in r.stderr


def test_generate_makes_its_scratch_directory_only_where_it_spills(tmp_path, capsys, monkeypatch, tmpfs):
    """generate made io.paths[0] (./tiertrain-scratch) with nothing to write there: in a read-only
    working directory it was a traceback; an io.paths that is a file, or on a read-only disk,
    where the cache spills or the weights go to the tier, was a traceback too (found from outside)."""
    assert main(["train", *tiny_flags(tmp_path)]) == 0
    gen = ["generate", f"--checkpoint={tmp_path / 'run'}", "--prompt=hi", "--max-new-tokens=3"]
    ro = tmpfs("ro", 64, readonly=True)
    monkeypatch.chdir(ro)
    assert main(gen) == 0 and os.listdir(ro) == []
    monkeypatch.undo()  # (out of the mount before its fixture unmounts it: a busy mount stayed)
    (tmp_path / "afile").write_text("")
    for flags, said in (
        (["--memory.kv_host_mib=0", f"--io.paths={tmp_path / 'afile'}"], "is a file, not a directory"),
        (["--io.weights=tier", f"--io.paths={tmp_path / 'afile'}"], "is a file, not a directory"),
        (["--memory.kv_host_mib=0", f"--io.paths={tmp_path / 'afile' / 'sub'}"], "cannot be made"),
        (["--memory.kv_host_mib=0", f"--io.paths={ro}"], "is on a read-only filesystem"),
    ):
        line = one_line_error(capsys, [*gen, *flags])
        assert line.startswith("tiertrain: config error: io.paths = ") and said in line, line


def test_a_first_checkpoint_that_did_not_fit_its_checkpoint_dir_is_not_called_missing(tmp_path, capsys, tmpfs):
    """The first checkpoint too large for checkpoint.dir: the hint said the directory was
    missing ("a disk not mounted?") and to resume, where nothing was ever saved there (found from
    outside): the run is one that stopped before its first checkpoint."""
    small = tmpfs("small", 16)
    flags = tiny_flags(tmp_path, f"--checkpoint.dir={small / 'ck'}")
    line = one_line_error(capsys, ["train", *flags], 1)
    assert "not enough space for the checkpoint of step 2" in line and "not mounted" not in line, line
    assert "stopped before its first checkpoint" in line, line
    # found before any step (a run trained every step, then failed its final save: all of it lost)
    assert "at start, before any step: not enough space" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").read_text()
    line = one_line_error(capsys, ["train", *flags], 1)  # started again: the same
    assert "not mounted" not in line and "stopped before its first checkpoint" in line, line


def test_generate_takes_a_model_of_a_short_context(tmp_path, capsys):
    """A model of 64 positions: generate refused it on data.seq_len (128 by default), which
    generation never reads (found from outside)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = tmp_path / "short"
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      vocab_size=256, max_position_embeddings=64)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    assert main(["generate", f"--model.hf_dir={d}", "--prompt=hi", "--max-new-tokens=3"]) == 0
    line = one_line_error(capsys, ["generate", f"--model.hf_dir={d}", "--prompt=hi", "--data.seq_len=100"])
    assert "data.seq_len = 100 is longer than the model" in line, line  # given: still checked


def test_more_careless_inputs_are_one_line_and_leave_nothing(tmp_path, capsys):
    """Found from outside, each a traceback or a leftover before: a config file whose field is
    above every table, or whose section is not a table, laid over a checkpoint (--resume,
    --checkpoint) or read by eval; plot of a record without a loss, or of bytes not UTF-8; export
    --out empty (it exported into the working directory) and the directories made for a --out
    that failed (left); two io.paths that are one directory through a symlink (a lock left, and
    "in use by this very process"); `tiertrain config` printing a string TOML cannot read back."""
    import json

    assert main(["train", *tiny_flags(tmp_path)]) == 0
    run = tmp_path / "run"
    for text, said in (('data = 5\n', "[data] in {f} must be a table of fields, got 5"),
                       ('steps = 3\n', "steps = 3 in {f} is outside any section: every field belongs to a table; "
                                       "it is [train]'s: put it under [train]")):  # fmt: skip
        f = tmp_path / "bad.toml"
        f.write_text(text)
        for argv in (["train", f"--resume={run}"], ["eval", f"--checkpoint={run}"], ["eval"],
                     ["generate", f"--checkpoint={run}", "--prompt=hi"]):  # fmt: skip
            line = one_line_error(capsys, [*argv, f"--config={f}"], 2)
            assert said.format(f=f) in line, (argv, line)
    metrics = run / "metrics.jsonl"
    good = metrics.read_text()
    for bad in ('{"step": 1}\n', b'{"step": 1, "loss": 1.0}\xff\n'):
        metrics.write_bytes(bad.encode() if isinstance(bad, str) else bad)
        line = one_line_error(capsys, ["plot", str(run), f"--out={tmp_path / 'p.png'}"], 1)
        assert f"plot: {metrics}, line 1: not a step record" in line, line
    metrics.write_text(good)
    line = one_line_error(capsys, ["export", f"--checkpoint={run}", "--out="], 1)
    assert "export --out is empty" in line, line
    line = one_line_error(capsys, ["export", f"--checkpoint={run}", f"--out={tmp_path / 'e' / 'a' / 'x'}", "--merge"])
    assert "holds no adapters" in line and not (tmp_path / "e").exists(), line
    os.symlink(tmp_path / "ssd", tmp_path / "link")
    line = one_line_error(
        capsys, ["train", *tiny_flags(tmp_path / "2", f"--io.paths={tmp_path / 'ssd'},{tmp_path / 'link'}")]
    )
    assert "paths must be distinct directories" in line, line
    assert main(["config", '--train.run_dir=a"b\\c']) == 0
    (tmp_path / "c.toml").write_text(capsys.readouterr().out)
    assert main(["config", f"--config={tmp_path / 'c.toml'}"]) == 0
    assert 'run_dir = "a\\"b\\\\c"' in capsys.readouterr().out
    assert json.loads('"a\\"b\\\\c"') == 'a"b\\c'


def test_prepare_and_bench_io_refuse_bad_arguments_and_a_full_disk_in_one_line(tmp_path, capsys, tmpfs):
    """Found from outside: `prepare --output=` (a rename onto ''), prepare onto a full disk (an
    OSError), and `bench io` with a size, threads, chunk or repeats of zero, negative or NaN, or a
    path given twice, were tracebacks."""
    text = tmp_path / "a.txt"
    text.write_text("in the beginning was the word " * 2000)
    line = one_line_error(capsys, ["prepare", "--input", str(text), "--output="], 1)
    assert "prepare --output is empty" in line, line
    full = tmpfs("full", 16)
    line = one_line_error(capsys, ["prepare", "--input", str(text), "--output", str(full / "t.tokens")], 1)
    assert f"writing {full / 't.tokens'} failed (No space left on device); nothing was written" in line, line
    assert os.listdir(full) == []
    d = str(tmp_path / "b")
    for flags, said in ((["--size-gib", "0"], "--size-gib 0.0: give a positive size"),
                        (["--size-gib", "nan"], "--size-gib nan: give a positive size"),
                        (["--threads", "0"], "--threads 0: give at least 1"),
                        (["--chunk-mib", "-1"], "--chunk-mib -1: give at least 1"),
                        (["--repeats", "0"], "--repeats 0: give at least 1"),
                        (["--path", d], "give each directory once")):  # fmt: skip
        line = one_line_error(capsys, ["bench", "io", "--path", d, *flags], None)
        assert said in line, (flags, line)
    assert not os.path.exists(d)


def test_a_model_too_large_to_build_is_one_line(tmp_path, capsys):
    """A vocabulary of 1e11 (a typo) was torch's allocator's traceback (found from outside)."""
    line = one_line_error(capsys, ["train", *tiny_flags(tmp_path, "--model.vocab_size=100000000000")], 2)
    assert "the model cannot be built: one of its tensors does not fit in this machine's memory" in line, line
    assert "model.vocab_size = 100000000000: give smaller sizes" in line, line


def test_eval_of_a_run_whose_newest_checkpoint_goes_while_it_opens_takes_the_newest_again(
    tmp_path, capsys, monkeypatch
):
    """`eval --checkpoint RUN` while the run trains on (checkpoint.keep pruning): the checkpoint
    chosen was gone when opened, "params.bin is missing; use an earlier checkpoint" (12 of 12
    tries, found from outside); the newest is taken again."""
    import shutil

    import tiertrain.inference.weights as weights

    assert main(["train", *tiny_flags(tmp_path, "--checkpoint.every=1", "--checkpoint.keep=2", steps=3)]) == 0
    run = tmp_path / "run"
    real, calls = weights.CheckpointWeights.__init__, []

    def opened_after_a_prune(self, path, **kw):
        calls.append(path)
        if len(calls) == 1:
            shutil.rmtree(path)  # the run pruned it meanwhile
        real(self, path, **kw)

    monkeypatch.setattr(weights.CheckpointWeights, "__init__", opened_after_a_prune)
    capsys.readouterr()
    assert main(["eval", f"--checkpoint={run}", "--data.eval_corpus=bundled"]) == 0
    assert [os.path.basename(p) for p in calls] == ["step-00000003", "step-00000002"]
    assert "its newest checkpoint was removed while it was opened" in capsys.readouterr().err


def test_a_run_directory_deleted_during_the_run_is_said_at_its_end(tmp_path, monkeypatch, capsys):
    """Found from outside: the run directory deleted mid-run (a cleanup script), the run ended
    with "metrics in .../metrics.jsonl", a file long gone, and exit 0 without a word."""
    import shutil

    from tests.reference import tiny_flags
    from tiertrain.cli import main
    from tiertrain.training.trainer import Trainer

    step = Trainer.train_step

    def then_deleted(self):
        rec = step(self)
        if rec.step == 1:
            shutil.rmtree(tmp_path / "run")
        return rec

    monkeypatch.setattr(Trainer, "train_step", then_deleted)
    assert main(["train", *tiny_flags(tmp_path, steps=2)]) == 0
    err = capsys.readouterr().err
    assert (
        f"but {tmp_path / 'run' / 'metrics.jsonl'} was deleted during the run: its metrics and config.json are lost"
        in err
    )
