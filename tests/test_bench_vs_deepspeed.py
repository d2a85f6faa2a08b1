"""The parts of bench/vs_deepspeed.py that run without DeepSpeed: the /proc meter both
systems are measured with, DeepSpeed's config, the report and the goal's verdict."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")
sys.path.insert(0, BENCH)
import deepspeed_worker  # noqa: E402
import vs_deepspeed  # noqa: E402

CHILD = textwrap.dedent(
    """
    import os, sys
    path, mib = sys.argv[1], int(sys.argv[2])
    with open(path, "wb") as f:
        f.write(os.urandom(mib << 20))
        f.flush()
        os.fsync(f.fileno())
    hold = bytearray(mib << 20)          # touched: resident
    for i in range(0, len(hold), 4096):
        hold[i] = 1
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def _on_disk(tmp_path):
    """A directory for the meter's file on a disk filesystem: ``tmp_path`` unless it is tmpfs,
    then one under the repository that the test removes."""
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if fs != "tmpfs":
        return str(tmp_path)
    scratch = os.path.join(os.path.dirname(__file__), "..", f".meter-test-{os.getpid()}")
    os.makedirs(scratch, exist_ok=True)
    tmp_path.joinpath("cleanup").write_text(scratch)
    return scratch


@pytest.fixture(autouse=True)
def _remove_meter_dir(tmp_path):
    yield
    marker = tmp_path / "cleanup"
    if marker.exists():
        shutil.rmtree(marker.read_text(), ignore_errors=True)


def test_meter_counts_children_disk_bytes_and_peak_rss(tmp_path):
    scratch = _on_disk(tmp_path)  # /proc/<pid>/io does not count tmpfs
    meter = deepspeed_worker.ProcMeter()
    r0, w0 = meter.io()
    base_peak = meter.peak_rss()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, os.path.join(scratch, "f.bin"), "64"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in meter.pids()
        r1, w1 = meter.io()
        assert w1 - w0 >= 64 << 20  # the child's write, seen from the parent
        assert meter.peak_rss() >= base_peak + (60 << 20)
    finally:
        child.communicate("\n")
    assert child.pid not in meter.pids()


def test_ds_config_uses_nvme_only_with_the_same_optimizer():
    spec = dict(
        micro_batch_size=1,
        micro_batches=4,
        optim=vs_deepspeed.OPTIM,
        aio=dict(block_size=1 << 20, queue_depth=32, intra_op_parallelism=1),
    )
    cfg = deepspeed_worker.ds_config(spec, "/scratch/ds", 24_576_000)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["stage3_prefetch_bucket_size"] == 0
    assert z["offload_param"]["device"] == z["offload_optimizer"]["device"] == "nvme"
    assert z["offload_param"]["max_in_cpu"] == 0 and z["offload_param"]["buffer_size"] == 24_576_000
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["gradient_clipping"] == vs_deepspeed.OPTIM["grad_clip"]
    p = cfg["optimizer"]["params"]
    assert cfg["optimizer"]["type"] == "AdamW" and p["lr"] == vs_deepspeed.OPTIM["lr"]
    assert p["betas"] == [vs_deepspeed.OPTIM["beta1"], vs_deepspeed.OPTIM["beta2"]]
    assert cfg["aio"]["block_size"] == 1 << 20 and cfg["aio"]["queue_depth"] == 32


def test_gpu_mode_puts_both_systems_on_cuda_in_bf16(tmp_path):
    """--device cuda --dtype bfloat16: DeepSpeed with bf16 on (fp32 master and moments, as
    tiertrain's), tiertrain's config on CUDA in bf16; the report says so."""
    spec = dict(
        micro_batch_size=1,
        micro_batches=4,
        optim=vs_deepspeed.OPTIM,
        steps=3,
        seq_len=64,
        aio=dict(block_size=1 << 20, queue_depth=32, intra_op_parallelism=1),
        device="cuda",
        dtype="bfloat16",
        init_dir=str(tmp_path),
        n_params=1,
    )
    assert deepspeed_worker.ds_config(spec, "/scratch/ds", 1)["bf16"] == {"enabled": True}
    assert deepspeed_worker.ds_config(dict(spec, dtype="float32"), "/scratch/ds", 1)["bf16"] == {"enabled": False}
    from tiertrain.config import ModelConfig
    from tiertrain.models import hf_config_from

    hf_config_from(ModelConfig(kind="llama", n_layers=1, d_model=64, n_heads=4)).save_pretrained(tmp_path)
    cfg = vs_deepspeed.tiertrain_config(str(tmp_path), spec, {})
    assert (cfg.train.device, cfg.train.param_dtype) == ("cuda", "bfloat16")
    env = dict(cores=16, ram_gib=128, os="Linux", torch="2.11", date="2026-11-23", gpu="GPU NVIDIA H100, CUDA 12.8")
    spec.pop("aio")  # no DeepSpeed run in this report
    text = vs_deepspeed.render({"baseline": [_run([9, 6, 7], [1.0] * 3, 1 << 30)]}, spec, env)
    assert "GPU NVIDIA H100, CUDA 12.8" in text and "bfloat16 on cuda" in text


def _run(times, losses, rss, read=1e9, write=5e8):
    events = [dict(event="ready")]
    events += [
        dict(event="step", step=i + 1, step_s=t, loss=loss, read_bytes=read, write_bytes=write, peak_rss=rss)
        for i, (t, loss) in enumerate(zip(times, losses))
    ]
    return events


def test_report_and_verdict_are_computed_from_the_runs():
    spec = dict(seq_len=64, micro_batch_size=1, micro_batches=4, steps=3, n_params=134_105_856)
    env = dict(cores=2, ram_gib=24, os="Linux", torch="2.13", deepspeed="0.19.8", date="2026-11-21")
    losses = [10.0, 9.0, 8.0]
    runs = {
        "deepspeed": [_run([30, 16, 18], losses, 7 << 30), _run([30, 17, 15], losses, 7 << 30)],
        "baseline": [_run([9, 6, 7], losses, 3 << 30), _run([9, 7, 6], losses, 3 << 30)],
        "topk": [_run([9, 2, 2], [10.0, 9.5, 8.5], 1 << 30)] * 2,
    }
    text = vs_deepspeed.render(runs, spec, env)
    # medians over the steady steps (the first of each run is warm-up): 16.5 vs 6.5
    assert "| 16.50 (15.00..18.00) |" in text and "| 6.50 (6.00..7.00) |" in text
    assert f"| {16.5 / 6.5:.2f}x |" in text
    assert "134 M parameters (d 768, 12 layers" in text  # from the spec and MODEL, not fixed text
    assert "is 2.54x as fast at 0.43x the RSS: met." in text  # top-k is fastest but not exact math
    slow = dict(runs, baseline=[_run([9, 9, 9], losses, 3 << 30)] * 2)
    assert "NOT met" in vs_deepspeed.render(slow, spec, env)
    fat = dict(runs, baseline=[_run([9, 6, 6], losses, 4 << 30)] * 2)
    assert "at 0.57x the RSS: NOT met" in vs_deepspeed.render(fat, spec, env)
    # plain PyTorch, the compute floor: 4x DeepSpeed (16.5 / 4 = 4.12 s) below its 5 s step
    floor = vs_deepspeed.render(dict(runs, plain=[_run([6, 5, 5], losses, 2 << 30)] * 2), spec, env)
    assert "is 2.54x as fast" in floor  # plain is exact but not a tiertrain system
    assert (
        "plain PyTorch in RAM takes 5.00 s/step at 2.00 GiB; 4x DeepSpeed would be 4.12 s/step, below plain "
        "PyTorch's own step: no exact system reaches it"
    ) in floor
    assert "best exact tiertrain is 1.30x plain's step at 1.50x its peak RSS." in floor
    quick = vs_deepspeed.render(dict(runs, plain=[_run([6, 3, 3], losses, 2 << 30)] * 2), spec, env)
    assert "at or above plain PyTorch's step: reachable in principle" in quick


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="DeepSpeed is installed here")
def test_missing_deepspeed_names_the_fix():
    class Args:
        ds_python = None

    with pytest.raises(SystemExit, match=r"pip install -e \.\[bench\].*--ds-python"):
        vs_deepspeed.ds_python(Args())


@pytest.mark.parametrize(
    "script,args",
    [("vs_deepspeed.py", ["--systems", "baseline"]), ("train.py", []), ("checkpoint.py", []), ("cost_model.py", [])],
)
@pytest.mark.slow
def test_a_bad_out_fails_before_any_work(tmp_path, script, args):
    """`--out` is checked (and its directory made) first: a bad one costs a second, not the
    benchmark's minutes and its results."""
    f = tmp_path / "file"
    f.write_text("x")
    scratch = tmp_path / "scratch"
    r = subprocess.run(
        [sys.executable, os.path.join(BENCH, script), *args, "--scratch", str(scratch), "--out", str(f / "report.md")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and f"the directory of --out = '{f}' is a file" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not scratch.exists()


def test_checked_out_makes_the_directory(tmp_path):
    from tiertrain.bench.output import checked_out

    out = checked_out(str(tmp_path / "new" / "dir" / "report.md"))
    assert out == str(tmp_path / "new" / "dir" / "report.md") and (tmp_path / "new" / "dir").is_dir()


def test_the_clipping_bound_is_computed_from_the_prediction_and_both_rates():
    """The least step with clipping: the backward's compute, then the update's reads and
    writes at tiertrain's probed rates and at DeepSpeed's tuned ones; 4x DeepSpeed set
    against it."""
    spec = dict(
        seq_len=64,
        micro_batch_size=1,
        micro_batches=4,
        steps=3,
        n_params=134_105_856,
        aio=dict(block_size=4 << 20, queue_depth=32, intra_op_parallelism=1, read_gbps=2.0, write_gbps=4.0),
        aio_sweep=dict(sweep=[{}] * 18),
    )
    env = dict(cores=2, ram_gib=24, os="Linux", torch="2.13", deepspeed="0.19.8", date="2026-11-25")
    pred = dict(
        event="prediction",
        step_s=3.6,
        update_read=int(2.0e9),
        update_write=int(1.6e9),
        read_gbps=1.6,
        write_gbps=2.0,
        phases={"forward": dict(compute_s=0.8, io_s=2.5), "backward": dict(compute_s=0.9, io_s=0.5)},
    )
    losses = [10.0, 9.0, 8.0]

    def text(ds_times):
        tt = _run([4, 3.5, 3.5], losses, 1 << 30)
        tt.insert(1, pred)
        return vs_deepspeed.render({"deepspeed": [_run(ds_times, losses, 7 << 30)], "overlap": [tt]}, spec, env)

    # at the probed rates 0.9 + 2.0/1.6 + 1.6/2.0 = 2.95 s; at DeepSpeed's 0.9 + 1.0 + 0.4 = 2.30 s
    out = text([10, 9, 9])  # 4x DeepSpeed: 2.25 s
    assert "at least 2.95 s at the rates tiertrain probed in this run (1.60 GB/s read, 2.00 write)" in out
    assert "2.30 s at DeepSpeed's tuned aio rates (2.00 read, 4.00 write)" in out
    assert "4x DeepSpeed (2.25 s/step) is below the bound at every rate measured" in out
    assert "is below the bound at one of the rates measured" in text([10, 10, 10])  # 2.50 s
    assert "is above the bound: reachable in principle" in text([13, 12, 12])  # 3.00 s
