"""Issue 49's rank faults measured on a shape and family the tests do not use: a Qwen2 from
save_pretrained (3 layers, hidden 96, 6 heads, 2 kv heads, window 16 on layers 1-2), seq 48, 3
micro-batches, `--nproc 2`, the issue's `--ranks.timeout_s=10`. Each scenario: seconds from the
fault to the end of the run, its exit status, its stderr's `tiertrain:` lines, processes left."""

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

T = 10
base = pathlib.Path(tempfile.mkdtemp())
torch.manual_seed(0)
Qwen2ForCausalLM(
    Qwen2Config(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
        tie_word_embeddings=False,
    )
).save_pretrained(base / "m")


def start(d, *extra, env=None):
    flags = [
        f"--io.paths={d / 'ssd'}",
        f"--train.run_dir={d / 'run'}",
        f"--model.hf_dir={base / 'm'}",
        "--data.seq_len=48",
        "--data.micro_batch_size=2",
        "--data.micro_batches=3",
        "--train.progress=false",
        "--train.predict=false",
        "--checkpoint.every=1",
        "--train.steps=100000",
        f"--ranks.timeout_s={T}",
        *extra,
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "tiertrain", "train", "--nproc", "2", *flags],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def steps(d):
    m = d / "run" / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


def ranks(p):
    while len(psutil.Process(p.pid).children()) < 2:
        time.sleep(0.1)
    kids = psutil.Process(p.pid).children()
    return [next(c.pid for c in kids if c.environ().get("RANK") == str(r)) for r in (0, 1)]


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_steps(d, n, p):
    t = time.monotonic()
    while steps(d) < n:
        if p.poll() is not None:
            raise SystemExit(p.stderr.read()[-3000:])
        if time.monotonic() - t > 300:
            raise SystemExit("no steps")
        time.sleep(0.1)


def finish(name, p, pids, t0, limit=120):
    try:
        err = p.communicate(timeout=limit)[1]
    except subprocess.TimeoutExpired:
        for q in [p.pid, *pids]:
            if alive(q):
                os.kill(q, signal.SIGKILL)
        err = p.communicate()[1]
        print(f"| {name} | did not end in {limit} s | | |")
        return
    took = time.monotonic() - t0
    time.sleep(0.5)
    left = [q for q in pids if alive(q)]
    lines = " / ".join(ln[:420] for ln in err.splitlines() if ln.startswith("tiertrain:"))
    print(f"| {name} | {took:.1f} s | {p.returncode} | {lines} | {len(left)} left |", flush=True)


print("| fault | ended after | exit | its lines (cut at 420 characters) | ranks left |\n|---|---|---|---|---|")
SLOW = {"TIERTRAIN_SLOW_AT": "forward:0.1"}


def signal_rank(name, sub, sig, rank, after, env=None):
    """Start a 2-rank run in ``base/sub``, send ``sig`` to rank ``rank`` after ``after`` steps,
    and print how the run ended."""
    d = base / sub
    p = start(d, env=env)
    wait_steps(d, after, p)
    pids = ranks(p)
    t0 = time.monotonic()
    os.kill(pids[rank], sig)
    finish(name, p, pids, t0)


signal_rank("rank 0 SIGSTOPped after step 5", "stop0", signal.SIGSTOP, 0, 5)
signal_rank("SIGINT to rank 1 alone", "int1", signal.SIGINT, 1, 3, SLOW)
signal_rank("SIGTERM to rank 0 alone", "term0", signal.SIGTERM, 0, 3, SLOW)
d = base / "hung1"
p = start(d, env={"TIERTRAIN_SLOW_AT": "backward:120:25", "TIERTRAIN_SLOW_RANK": "1"})
pids = ranks(p)
wait_steps(d, 2, p)
t0 = (d / "run" / "metrics.jsonl").stat().st_mtime
while p.poll() is None and time.time() - t0 < 150:
    time.sleep(0.1)
err = p.communicate()[1]
took = time.time() - t0
lines = " / ".join(ln[:420] for ln in err.splitlines() if ln.startswith("tiertrain:"))
print(
    f"| rank 1 hung 120 s in step 3 (time from step 2's record) | {took:.1f} s | {p.returncode} | {lines} | {sum(map(alive, pids))} left |"
)
signal_rank("rank 0 SIGKILLed", "kill0", signal.SIGKILL, 0, 3)
d = base / "launcher"
p = start(d, env={"TIERTRAIN_SLOW_AT": "forward:60:45"})
wait_steps(d, 2, p)
pids = ranks(p)
time.sleep(1.5)
t0 = time.monotonic()
os.kill(p.pid, signal.SIGKILL)
while any(alive(q) for q in pids) and time.monotonic() - t0 < 90:
    time.sleep(0.05)
took = time.monotonic() - t0
p.communicate()
scr = [x for x in os.listdir(d / "ssd")] if (d / "ssd").exists() else []
print(
    f"| launcher SIGKILLed in a 60 s forward | ranks gone in {took:.1f} s | - | - | {sum(map(alive, pids))} left; scratch left: {scr} |"
)
