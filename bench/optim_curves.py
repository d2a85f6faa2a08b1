"""The README's chat fine-tune with fp32 and 8-bit optimizer states: loss curves together.

The model and data of the README's fine-tuning example (``examples/tiny_chat_model.py``: a
random 4.2 M-parameter Llama and its tokenizer; ``examples/chat.jsonl``, validation on
``examples/chat_val.jsonl``), every state on the storage tier, the same settings as the README
(seq 128, lr 1e-3) for ``--steps`` steps, once with ``optim.name = adamw`` (fp32 moments) and
once with ``adamw8bit`` (bitsandbytes' 8-bit moments); same weights and batches. Reports the
training and validation losses (plotted together), and per step the bytes the storage tier moved
and the step time (medians after the first step).

Usage: python bench/optim_curves.py [--steps 200] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tiertrain.bench.output import SCRATCH_HELP, checked_out, scratch_dir  # noqa: E402
from tiertrain.config import load_config  # noqa: E402
from tiertrain.training.trainer import Trainer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"fp32 states (adamw)": "adamw", "8-bit states (adamw8bit)": "adamw8bit"}
NAME = "optim-states-chat-curves"


def run(scratch: str, model: str, optim: str, steps: int, eval_every: int) -> list:
    cfg = load_config(
        None,
        [
            f"--model.hf_dir={model}",
            f"--data.corpus={ROOT}/examples/chat.jsonl",
            f"--data.eval_corpus={ROOT}/examples/chat_val.jsonl",
            f"--train.eval_every={eval_every}",
            "--data.seq_len=128",
            f"--train.steps={steps}",
            "--optim.lr=1e-3",
            f"--optim.name={optim}",
            f"--io.paths={scratch}/ssd",
            f"--train.run_dir={scratch}/run-{optim}",
            "--memory.host_param_mib=0",  # every state on the storage tier: the bytes show
            "--memory.grad_host_mib=0",
            "--memory.optim_host_mib=0",
            "--train.progress=false",
            "--checkpoint.at_end=false",
        ],
    )
    with Trainer(cfg) as tr:
        return tr.run()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    md = checked_out(os.path.join(args.out_dir, f"{NAME}.md"))  # before the work, not after
    curves = {}
    with scratch_dir(args.scratch, "bench-optim-curves") as scratch:
        model = os.path.join(scratch, "tiny-llama")
        subprocess.run([sys.executable, f"{ROOT}/examples/tiny_chat_model.py", model], check=True)
        for label, optim in RUNS.items():
            curves[label] = run(scratch, model, optim, args.steps, args.eval_every)
            print(f"{label}: final loss {curves[label][-1].loss:.4f}", flush=True)
    png = os.path.splitext(md)[0] + ".png"
    plt.figure(figsize=(8, 5))
    for (label, recs), color in zip(curves.items(), ("C0", "C1")):
        plt.plot([r.step for r in recs], [r.loss for r in recs], color=color, linewidth=1, alpha=0.6, label=label)
        ev = [(r.step, r.extra["eval_loss"]) for r in recs if "eval_loss" in r.extra]
        plt.plot(*zip(*ev), color=color, marker="o", linewidth=2, label=f"{label}, validation")
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.title("README chat fine-tune (4.2 M Llama): fp32 against 8-bit optimizer states")
    plt.legend()
    plt.grid(alpha=0.3)
    plt.savefig(png, dpi=120, bbox_inches="tight")
    print(report(curves, args, png), file=open(md, "w"))
    print(open(md).read())
    return 0


def report(curves: dict, args, png: str) -> str:
    tail = 20
    lines = [
        f"# fp32 against 8-bit optimizer states on the README's chat fine-tune, {time.strftime('%Y-%m-%d')}",
        "",
        f"`python bench/optim_curves.py --steps {args.steps}`: the README's fine-tuning example (a random 4.2 M "
        "Llama, examples/chat.jsonl, seq 128, lr 1e-3, validation on examples/chat_val.jsonl every "
        f"{args.eval_every} steps), every state on the storage tier, same weights and batches in both runs. Final "
        f"training loss: mean of the last {tail} steps. Bytes and time a step: medians after the first step.",
        "",
        "| run | final training loss | last validation loss | GB read a step | GB written a step | s a step |",
        "|---|---|---|---|---|---|",
    ]
    for label, recs in curves.items():
        final = statistics.mean(r.loss for r in recs[-tail:])
        last_eval = [r.extra["eval_loss"] for r in recs if "eval_loss" in r.extra][-1]
        rb = statistics.median(r.ssd_read_bytes for r in recs[1:]) / 1e9
        wb = statistics.median(r.ssd_write_bytes for r in recs[1:]) / 1e9
        s = statistics.median(r.step_s for r in recs[1:])
        lines.append(f"| {label} | {final:.4f} | {last_eval:.4f} | {rb:.4f} | {wb:.4f} | {s:.3f} |")
    lines += ["", f"![loss curves]({os.path.basename(png)})", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
