"""The GPU window as it will come: a bare machine (its own python3 and torch, no network, no
.venv, commands of at most 10 minutes), the checkout and a folder of wheels carried along.

Every stage (bench/gpu_window/stageN-<name>.sh) runs here in its dry mode exactly as that
machine will call it: from a copy of the checkout's files, the wheels installed from the carried
folder, a package the machine lacks (crc32c) hidden from the interpreter, within the stage's
time. And the defects a reading of the CUDA paths predicted for the first run, each shown on CPU:
ranks' gradients (tests/test_dist_train.py), the key/value cache's transfers
(tests/test_generate_tiers.py), and the rest here."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
import types
import zipfile

import pytest
import torch
from reference import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = [
    "stage1-cuda",
    "stage2-sanitizer",
    "stage3-nvme",
    "stage4-deepspeed",
    "stage5-ranks",
    "stage6-gds",
    "stage7-speculate",
    "stage8-lora",
    "stage9-cost-scale",
    "stage10-moe",
    "stage11-qlora",
    "stage12-compute-bound",
    "stage13-profile",
]
LIMIT_S = 540  # a stage's budget: 9 minutes, inside the machine's 10-minute commands


def _repack(dist_name: str, dest: str) -> str:
    """A wheel of an installed distribution (the test's stand-in for bench/gpu_window/wheels.sh,
    which downloads; tests do not)."""
    dist = importlib.metadata.distribution(dist_name)
    site = str(dist.locate_file(""))
    info = next(f for f in dist.files if f.name == "WHEEL")
    tag = next(line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("Tag:"))
    path = os.path.join(dest, f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tag}.whl")
    with zipfile.ZipFile(path, "w") as z:
        for f in dist.files:
            if ".." in f.parts or "__pycache__" in f.parts:
                continue
            z.write(os.path.join(site, str(f)), str(f))
    return path


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """What the GPU machine gets: the checkout's files (tracked and untracked-not-ignored, as the
    device tool sends them), .whl/ with the wheels it lacks, and an interpreter without crc32c."""
    base = tmp_path_factory.mktemp("gpu-window")
    repo = base / "checkout"
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for f in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(repo / os.path.dirname(f), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), repo / f)
    assert not (repo / ".venv").exists()
    (repo / ".whl").mkdir()
    _repack("crc32c", str(repo / ".whl"))
    hide = base / "hide"
    hide.mkdir()
    (hide / "crc32c.py").write_text("raise ImportError('No module named crc32c (not on this machine)')\n")
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        PYTHONPATH=str(hide),
        TIERTRAIN_SITE=str(base / "site"),
        TIERTRAIN_NVME=str(base / "nvme"),
    )
    return types.SimpleNamespace(repo=repo, env=env, base=base)


def _stage(machine, name: str, *args: str, wheels: bool = True):
    env = dict(machine.env)
    if not wheels:  # nothing carried, and nothing installed by an earlier stage
        env["TIERTRAIN_WHEELS"], env["TIERTRAIN_SITE"] = str(machine.base / "no-wheels"), str(machine.base / "no-site")
    out = machine.base / "out" / name
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", str(machine.repo / "bench" / "gpu_window" / f"{name}.sh"), "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=LIMIT_S + 60,
    )
    results = out / f"{name}.md"
    return r, (results.read_text() if results.exists() else ""), time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGES)
def test_every_stage_runs_dry_as_the_gpu_machine_will_call_it(machine, name):
    r, text, took = _stage(machine, name, "--dry")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert took < LIMIT_S
    lines = text.splitlines()
    assert lines[0].startswith(f"# GPU window, {name}, ") and lines[0].endswith("(dry run, no GPU)")
    assert "- wheels carried: crc32c" in text  # installed from .whl, the machine's own being hidden
    assert "0 step(s) failed" in text
    steps = [ln for ln in lines if ln.startswith("- **")]
    assert steps and all(": exit 0 in " in ln or ": skipped (" in ln for ln in steps), steps
    if name != "stage4-deepspeed":  # where DeepSpeed is not importable, the stage is one skip
        assert any(": exit 0 in " in ln for ln in steps)
    if name == "stage1-cuda":
        assert f"tiertrain from {machine.repo / 'tiertrain'}" in text  # the checkout's, not an installed one
    # the benchmarks a stage runs end to end on a tiny model (their own tests check the figures)
    bench = {
        "stage7-speculate": ("finetune", ["after 3 steps of plain PyTorch pretraining", "speculation held in ",
                                          "variants identical", "| tiertrain engines speculating |"]),
        "stage8-lora": ("bench", ["the I/O floor", "nothing written (0.00 GB"]),
        "stage10-moe": ("bench", ["A mixture of experts (qwen3_moe)", "Qwen3MoeForCausalLM", "| plain PyTorch, in memory |"]),
        "stage11-qlora": ("bench", ["| bfloat16 | 1 |", "| nf4 | 1 |", "- `nf4`:"]),
        "stage13-profile": ("device.log", ["host: ", "fused AdamW", "== operators by self_cpu_time_total", "(profiled)"]),
        "stage12-compute-bound": ("3b", ["| plain PyTorch in memory (without activation checkpointing) |",
                                         "| tiertrain |", "tokens a step", "GFLOP a token", "- losses: largest",
                                         "| tiertrain, --memory.optim_device_mib=none |",
                                         "memory.optim_device_mib = None is not used: the device's memory is the host's"]),
    }  # fmt: skip
    if name in bench:
        kind = bench[name][0]
        report = (machine.base / "out" / name / f"{name}-{kind if '.' in kind else kind + '.md'}").read_text()
        assert all(want in report for want in bench[name][1]), report
    if name == "stage12-compute-bound":  # and tiertrain alone, plain not run, said
        alone = (machine.base / "out" / name / f"{name}-8b.md").read_text()
        assert "- plain PyTorch not run: --plain off" in alone and "| tiertrain |" in alone, alone
    if name == "stage10-moe":  # and generation with routed expert reads, tokens equal to transformers'
        routed = (machine.base / "out" / name / f"{name}-routed.md").read_text()
        assert "| tiertrain routed |" in routed and routed.count(" | True |") == 3, routed
    if name == "stage9-cost-scale":  # each run's prediction against its steps, gathered at the end
        tail = text.split("The predictions against the measured steps")[1]
        assert tail.count("- step time: predicted") == 2, tail
    assert not (machine.base / "nvme" / name).exists()  # scratch removed


@pytest.mark.slow
def test_the_whole_window_runs_in_one_command_within_its_seconds(machine):
    """all.sh: the stages in the order given, each with what is left of the time, a stage that
    does not exist or has no time left named, and everything packed into DIR.tgz."""
    out = machine.base / "out-all"
    run = lambda *a: subprocess.run(  # noqa: E731
        ["bash", str(machine.repo / "bench" / "gpu_window" / "all.sh"), "--out", str(out), "--dry", *a],
        capture_output=True,
        text=True,
        env=machine.env,
        timeout=300,
    )
    r = run("--seconds", "200", "--stages", "4 99")
    assert r.returncode == 2 and "all.sh: no stage 99" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert "== stage4-deepspeed.sh with 190 s" in r.stdout or "== stage4-deepspeed.sh with 18" in r.stdout
    assert "# GPU window, stage4-deepspeed" in r.stdout and "0 step(s) failed" in r.stdout
    assert (out / "stage4-deepspeed.md").exists() and (machine.base / "out-all.tgz").exists()
    r = run("--seconds", "50", "--stages", "4")
    assert r.returncode == 1 and "stage4-deepspeed.sh: not run (40 s left of 50)" in r.stdout


@pytest.mark.slow
def test_a_stage_names_what_the_machine_lacks_and_how_to_carry_it(machine):
    r, text, _ = _stage(machine, "stage1-cuda", "--dry", wheels=False)
    assert r.returncode == 3
    assert "- wheels carried: none" in text
    assert "**missing here: crc32c**" in text and "bench/gpu_window/wheels.sh" in text


@pytest.mark.slow
def test_a_stage_without_a_gpu_asks_for_the_dry_run(machine):
    r, text, _ = _stage(machine, "stage3-nvme")
    assert r.returncode == 2 and "no CUDA device here: run with --dry" in text
    r, _, _ = _stage(machine, "stage3-nvme", "--dry", "--nvem", "x")
    assert r.returncode == 2 and "unknown argument --nvem" in r.stderr


@pytest.mark.slow
def test_without_crc32c_tiertrain_says_how_to_carry_it(tmp_path):
    (tmp_path / "crc32c.py").write_text("raise ImportError('No module named crc32c')\n")
    r = subprocess.run(
        [sys.executable, "-c", "import tiertrain.training.trainer"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=f"{tmp_path}:{ROOT}"),
    )
    assert r.returncode == 1
    assert "tiertrain needs the crc32c package" in r.stderr and "bench/gpu_window/wheels.sh" in r.stderr


# -- the predicted defects ----------------------------------------------------------------------


def test_sampling_draws_on_the_host_where_cuda_refuses_a_cpu_generator(monkeypatch):
    """Defect 2: a CPU generator with CUDA probabilities (CUDA: "Expected a 'cuda' device type
    for generator"). Fake CUDA logits (FakeTensorMode: device checks without a GPU) reach a
    ``torch.multinomial`` that refuses what CUDA refuses; the draw must be made on the host."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tiertrain.inference.generate import Sampling, _pick

    real = torch.multinomial

    def as_cuda_does(probs, n, *, generator=None, **kw):
        if generator is not None and generator.device.type != probs.device.type:
            raise RuntimeError(
                f"Expected a '{probs.device.type}' device type for generator but found '{generator.device.type}'"
            )
        return real(probs, n, generator=generator, **kw)

    monkeypatch.setattr(torch, "multinomial", as_cuda_does)
    gen = torch.Generator().manual_seed(0)
    with FakeTensorMode():
        logits = torch.empty(3, 50, device="cuda")  # a fake's values are never computed
        # (temperature alone: top-k and top-p make scalar tensors, which a CPU build cannot fake on CUDA)
        assert _pick(logits, Sampling(temperature=0.8), gen).device.type == "cpu"
    # and on real tensors the same seed draws the same tokens from the same logits
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    s = Sampling(temperature=0.7, top_k=20)
    assert torch.equal(
        _pick(logits, s, torch.Generator().manual_seed(3)), _pick(logits, s, torch.Generator().manual_seed(3))
    )


class _Event:
    """A CUDA event's host calls: ``query`` (no synchronisation to the sanitizer) and ``synchronize``."""

    def __init__(self, done: bool) -> None:
        self.is_done, self.synchronized = done, 0

    def query(self) -> bool:
        return self.is_done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.is_done = True


def test_the_cuda_device_synchronizes_where_a_query_said_done():
    """Defect 3: PyTorch's CUDA sanitizer takes ``synchronize`` as the host's happens-before, not
    a query; a buffer reused after a query alone is reported as a race. ``sync`` and a ``done``
    that says yes must synchronize (at once, on a completed event); waits are still counted."""
    from tiertrain.device import CudaDevice, Device

    dev = CudaDevice.__new__(CudaDevice)  # its host logic alone: no streams are needed for events
    Device.__init__(dev, torch.device("cpu"))
    ev = _Event(done=True)
    dev.sync(ev)
    assert ev.synchronized == 1 and dev.syncs == 0 and dev.sync_points == 1
    ev = _Event(done=False)
    dev.sync(ev)
    assert ev.synchronized == 1 and dev.syncs == 1 and dev.sync_points == 2
    ev = _Event(done=True)
    assert dev.done(ev) and ev.synchronized == 1
    ev = _Event(done=False)
    assert not dev.done(ev) and ev.synchronized == 0
    assert dev.done(None)


def test_the_gpu_parity_test_holds_a_zero_gradient_parameter_as_the_parity_suite_does(tmp_path):
    """Defect 4: the key bias's gradient is zero in exact arithmetic, so a device's rounding gives
    it AdamW steps of about the learning rate: the CUDA-vs-CPU comparison allows it 2 x lr x steps
    (as ``test_parity.assert_same_weights``) and holds every other element to 1e-5."""
    from test_gpu import same_weights_across_devices

    cfg = small_config(tmp_path, steps=3)
    tr = types.SimpleNamespace(cfg=cfg)
    d = cfg.model.d_model
    cpu = {"blocks.0.attn.qkv.bias": torch.zeros(3 * d), "blocks.0.attn.qkv.weight": torch.zeros(3 * d, d)}
    gpu = {k: v.clone() for k, v in cpu.items()}
    gpu["blocks.0.attn.qkv.bias"][d : 2 * d] += 1.5 * cfg.optim.lr * cfg.train.steps  # the key part: allowed
    gpu["blocks.0.attn.qkv.weight"] += 5e-6
    same_weights_across_devices(tr, gpu, cpu)
    worse = {k: v.clone() for k, v in gpu.items()}
    worse["blocks.0.attn.qkv.bias"][d : 2 * d] += cfg.optim.lr * cfg.train.steps  # beyond 2 x lr x steps
    with pytest.raises(AssertionError, match="key bias"):
        same_weights_across_devices(tr, worse, cpu)
    worse = {k: v.clone() for k, v in gpu.items()}
    worse["blocks.0.attn.qkv.bias"][:d] += 1e-3  # the query part has a gradient: held to 1e-5
    with pytest.raises(AssertionError):
        same_weights_across_devices(tr, worse, cpu)


def test_the_gds_check_reads_the_parameters_through_kvikio(tmp_path):
    """Defect 5: the old GDS step trained the default job, whose parameters stay in host memory,
    so no unit was ever read from a file and kvikio was never reached. Stage 6's check puts them
    on the tier: through a stand-in for kvikio on CPU, bytes come through it, and the run is the
    same, bit for bit, as the one through pinned host memory."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "gpu_window"))
    try:
        import gds_check
    finally:
        sys.path.pop(0)
    from test_gds import FakeCuFile

    from tiertrain.device import AsyncCpuDevice
    from tiertrain.io import gds

    small = ("--model.n_layers=2", "--model.d_model=64", "--data.seq_len=32")
    gds.set_backend(FakeCuFile, device_types=("cpu",))
    try:
        on = gds_check.train(
            gds_check.config(str(tmp_path), "on", device="cpu", steps=2, extra=small),
            device=AsyncCpuDevice(delay=0.0, direct=True),
        )
        default = gds_check.train(
            gds_check.config(
                str(tmp_path / "default"), "on", device="cpu", steps=2, extra=(*small, "--memory.host_param_mib=64")
            ),
            device=AsyncCpuDevice(delay=0.0, direct=True),
        )
        gds.set_mode("off")
        off = gds_check.train(
            gds_check.config(str(tmp_path), "off", device="cpu", steps=2, extra=small), device=AsyncCpuDevice(delay=0.0)
        )
    finally:
        gds.set_mode("auto")
        gds.set_backend(None)
    assert on["direct_read"] > 0 and gds_check.compare(on, off) == []
    assert default["direct_read"] == 0  # parameters in host memory, as in the default job: nothing to read
    assert "no byte was read through kvikio" in " ".join(gds_check.compare(default, off))


def test_direct_reads_are_refused_with_ranks_and_off_under_auto():
    """Ranks gather every unit over Gloo in host memory: a direct read into device memory would
    hand Gloo a CUDA tensor."""
    from tiertrain.config import ConfigError
    from tiertrain.device import make_device

    with pytest.raises(ConfigError, match=r"io.gds = 'on' with 2 ranks.*--io.gds=off"):
        make_device("cpu", "on", world=2)
    assert not make_device("cpu", "auto", world=2).direct


def test_the_gds_extra_names_the_kvikio_of_the_machines_cuda():
    from tiertrain.io.gds import kvikio_package

    assert kvikio_package("13.0") == "kvikio-cu13" and kvikio_package("12.8") == "kvikio-cu12"
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert 'gds = ["kvikio-cu13"]' in text and 'gds-cu12 = ["kvikio-cu12"]' in text
