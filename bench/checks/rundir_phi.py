"""Issue 49 items 1-3 and 8 on a family and shape the tests do not use: a Phi from save_pretrained
(4 layers, hidden 80, partial rotary, biased head), seq 40, 2 micro-batches, through the command."""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import PhiConfig, PhiForCausalLM

b = pathlib.Path(tempfile.mkdtemp())
os.chdir(b)
torch.manual_seed(0)
PhiForCausalLM(
    PhiConfig(
        vocab_size=256,
        hidden_size=80,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=5,
        partial_rotary_factor=0.4,
        max_position_embeddings=128,
    )
).save_pretrained(b / "m")
tt = [sys.executable, "-m", "tiertrain"]
common = [
    f"--model.hf_dir={b / 'm'}",
    "--data.seq_len=40",
    "--data.micro_batches=2",
    "--train.progress=false",
    "--train.predict=false",
    f"--io.paths={b / 'ssd'}",
]


def run(*a):
    r = subprocess.run([*tt, *a], capture_output=True, text=True)
    return r.returncode, [ln for ln in r.stderr.splitlines() if ln.startswith("tiertrain:") or "WARNING" in ln]


def tree(d):
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != ".tiertrain.lock"
    }


def steps(d):
    return [json.loads(ln)["step"] for ln in open(d / "metrics.jsonl")]


rc, _ = run("train", *common, "--train.run_dir=runs/A", "--train.steps=6", "--checkpoint.every=3")
assert rc == 0
shutil.copytree(b / "runs/A", b / "runs/B", symlinks=True)
before = tree(b / "runs/A")
rc, out = run("train", "--resume", "runs/B/checkpoints/step-00000003", "--optim.lr=1e-3")
print(
    "1 copied run resumed:", rc, "| A byte-identical:", tree(b / "runs/A") == before, "| B steps:", steps(b / "runs/B")
)
rc, out = run("train", "--resume", "runs/A", "--train.run_dir=runs/B", "--train.steps=8")
print("1 resume into a run dir holding a run:", rc, out[-1][:150], "| A byte-identical:", tree(b / "runs/A") == before)
for o in ("runs/A", ".", "runs/A/checkpoints"):
    rc, out = run("export", "--checkpoint", "runs/A", "--out", o, "--overwrite")
    print(f"2 export --out {o} --overwrite:", rc, out[-1][:130])
print("2 A byte-identical:", tree(b / "runs/A") == before)
lines = open(b / "runs/B/metrics.jsonl", "rb").read().splitlines(keepends=True)
lines[1] = b"{broken\n"
open(b / "runs/B/metrics.jsonl", "wb").writelines(lines)
os.remove(b / "runs/B/checkpoints/step-00000006/manifest.json")
rc, out = run("train", "--resume", "runs/B", "--train.steps=7")
print(
    "3 damaged line + manifestless newest:",
    rc,
    "| warnings:",
    [ln[9:120] for ln in out if "damaged" in ln or "manifest" in ln],
    "| dropped file lines:",
    len(open(b / "runs/B/metrics.dropped.jsonl").read().splitlines()),
    "| checkpoints:",
    sorted(os.listdir(b / "runs/B/checkpoints")),
)
rc, out = run("train", *common, "--train.run_dir=runs/N", "--optim.weight_decay=nan")
print("8 weight_decay=nan:", rc, out[-1][:100])
rc, _ = run("export", "--checkpoint", "runs/A", "--out", "w")
w = b / "w"
f = sorted(w.glob("model-*.safetensors"))[2]
t = load_file(f)
k = next(iter(t))
t[k].view(-1)[0] = float("nan")
save_file(t, f, metadata={"format": "pt"})
rc, out = run(
    "train", *common, "--train.run_dir=runs/NaN", f"--model.init_from={w}", "--train.steps=4", "--checkpoint.every=1"
)
print(
    "8 NaN weight:",
    rc,
    out[-1][:140],
    "| checkpoints:",
    sorted(os.listdir(b / "runs/NaN/checkpoints")) if (b / "runs/NaN/checkpoints").exists() else [],
)
