"""Sub-layer units: pools, peak memory, bytes and step time of a model cut into 1, 2, 3 and 4
units a layer (``model.layer_pieces``), from the same weights.

A Llama (or, with ``--family``, a transformers model of that family, its weights written by
``save_pretrained``) with a wide MLP (ff = 4 x width), states on the storage tier, hidden states spilled:
whole, a block is the largest unit and sizes every slot and gradient buffer; cut, a piece does,
and the stash holds the wider tensors handed between the MLP's pieces. Each setting runs in its
own process (peak RSS is the process's): the largest unit, the fixed pools, peak RSS, seconds
per step, bytes read and written per step (against the cost model's count, less the parameters
the overlapped update handed to the next forward in memory), and the losses,
which must be equal bit for bit.

Usage: python bench/layer_pieces.py [--family gemma2] [--steps 3] [--d-model 1536] [--layers 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys

from tiertrain.bench.children import hf_model, initial_weights, run_child
from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

MIB = 1 << 20


def run_one(args) -> dict:
    """One setting, in this process: the figures as a dict."""
    import statistics

    from tiertrain.config import load_config
    from tiertrain.cost import run_traffic
    from tiertrain.cost.budget import STATES_ON_STORAGE
    from tiertrain.training.trainer import Trainer

    flags = [
        f"--io.paths={args.scratch}",
        f"--train.run_dir={args.scratch}/run",
        "--model.kind=llama",
        *(
            [f"--model.hf_dir={args.init}"]
            if args.family != "llama"
            else [
                f"--model.d_model={args.d_model}",
                f"--model.n_layers={args.layers}",
                f"--model.n_heads={args.d_model // 64}",
                f"--model.d_ff={4 * args.d_model}",
                "--model.vocab_size=4096",
                "--model.max_seq_len=256",
                f"--model.init_from={args.init}",
            ]
        ),
        "--data.seq_len=256",
        "--data.micro_batch_size=2",
        "--data.micro_batches=2",
        f"--train.steps={args.steps}",
        "--train.progress=false",
        "--train.predict=false",
        "--memory.host_mib=16384",
        *[f"--memory.{k}={v}" for k, v in STATES_ON_STORAGE.items()],
        "--memory.stash_host_mib=0",  # every hidden state spilled: the cut's extra stash bytes show
        "--memory.activations=recompute",
    ]
    flags.append(f"--model.layer_pieces={args.pieces}")
    cfg = load_config(None, flags)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        recs = [tr.train_step() for _ in range(args.steps)]
        t = run_traffic(tr, kept=0)
        return dict(
            pieces=tr.model.layer_parts,
            model=type(tr.model.hf_model).__name__ if getattr(tr.model, "hf_model", None) is not None else "Llama",
            largest_unit=tr.layout.max_unit_numel,
            n_params=tr.layout.n_params,
            pools=sum(tr.budget.fixed.values()),
            step_s=statistics.median(r.step_s for r in recs[1:] or recs),
            read=recs[-1].ssd_read_bytes,
            write=recs[-1].ssd_write_bytes,
            # the overlapped update hands the next forward some new parameters in memory: not read back
            model_read=t.read - recs[-1].extra.get("handoff_bytes", 0),
            model_write=t.write,
            losses=[r.loss for r in recs],
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llama", help="llama (built in), or a transformers model type: gemma2, ...")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    ap.add_argument("--pieces", type=int, default=None, help=argparse.SUPPRESS)  # one setting, in a child
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args)))
        return 0
    out = checked_out(args.out) if args.out else None
    rows = {}
    with scratch_dir(args.scratch, "layers") as top:
        init = write_init(args, top)  # every setting starts from these weights
        for pieces in (1, 2, 3, 4):
            rows[f"layer_pieces = {pieces}"] = _child(args, f"layer_pieces = {pieces}", pieces, init, top)
    report(args, rows, out)
    return 0


def write_init(args, top: str) -> str:
    """Every setting's initial weights: the built-in Llama's, seeded, in one safetensors file;
    or a transformers model of ``--family`` written by ``save_pretrained`` (its directory)."""
    d = args.d_model
    if args.family != "llama":
        heads = d // 64
        return hf_model(
            args.family,
            os.path.join(top, "hf"),
            hidden_size=d,
            intermediate_size=4 * d,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=64,
            vocab_size=4096,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    from tiertrain.config import ModelConfig

    mc = ModelConfig(
        kind="llama", d_model=d, n_layers=args.layers, n_heads=d // 64, d_ff=4 * d, vocab_size=4096, max_seq_len=256
    )
    return initial_weights(mc, os.path.join(top, "init.safetensors"))


def _child(args, label: str, pieces: int | None, init: str, top: str) -> dict:
    flags = [f"--family={args.family}", f"--steps={args.steps}", f"--d-model={args.d_model}"]
    flags += [f"--layers={args.layers}", f"--init={init}"] + ([f"--pieces={pieces}"] if pieces else [])
    return run_child(__file__, label, flags, top)


def report(args, rows: dict, out: str | None) -> None:
    first = next(iter(rows.values()))
    lines = [
        f"# Sub-layer units: a {first['n_params'] / 1e6:.0f} M-parameter {first['model']}, width {args.d_model}, "
        f"ff {4 * args.d_model}, {args.layers} layers",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; fp32 on CPU, every state on the storage tier "
        f"(hidden states spilled); M = 2 micro-batches of 2 x 256 tokens; {args.steps} steps, median step of the "
        f"last {max(1, args.steps - 1)}.",
        "",
        "| setting | units a layer | largest unit (M elements) | fixed pools, planned (GiB) | peak RSS (GiB) | s/step | "
        "read GB/step (model) | written GB/step (model) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | {r['pieces']} | {r['largest_unit'] / 1e6:.1f} | {r['pools'] / 2**30:.2f} | "
            f"{r['peak_rss'] / 2**30:.2f} | {r['step_s']:.1f} | {r['read'] / 1e9:.2f} ({r['model_read'] / 1e9:.2f}) | "
            f"{r['write'] / 1e9:.2f} ({r['model_write'] / 1e9:.2f}) |"
        )
    same = all(r["losses"] == first["losses"] for r in rows.values())
    lines += [
        "",
        f"Losses: {', '.join(f'{v:.7f}' for v in first['losses'])}; "
        + (
            "equal bit for bit in every setting."
            if same
            else "NOT equal in every setting: " + "; ".join(f"{k}: {r['losses']}" for k, r in rows.items())
        ),
        "",
    ]
    publish("\n".join(lines), out)


if __name__ == "__main__":
    sys.exit(main())
