"""Generation of a mixture of experts from the storage tier: routed expert reads against whole
blocks, and transformers' ``generate`` in memory, in one run.

The model: a transformers config of the chosen family at the given shape (``bench/moe.py``'s
``write_config``), random weights (seed 0) written once by ``save_pretrained``. tiertrain reads
its converted copy on the storage tier (``io.weights = tier``) with no unit kept in host memory
(``memory.host_param_mib = 0``), so every pass (the prefill, then one a token) reads the model:

- ``whole``: ``io.routed_experts = false``, every block read whole, ahead of the compute;
- ``routed``: each block without its experts, the experts reached read when reached;
- ``routed + cache``: the same with an expert cache of ``--cache-fraction`` of the experts' bytes.

Each variant runs ``--rounds`` times, alternated; the median is reported with the bytes the
storage tier counted (per generated token) against the I/O floor (those bytes at the disk's read
rate, measured in the same run), and the tokens are compared with transformers' greedy
``generate`` on the model in memory (the peer, timed too).

Usage: python bench/moe_routed.py [--task generate or eval] [--passes 8] [--family olmoe] [--shape layers=8,hidden=512,experts=64,top_k=8,...]
                                  [--layer-pieces N]   (N > 2: the experts cut into N - 1 ranges)
                                  [--prompts 4] [--prompt-len 32] [--new-tokens 8] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPE = dict(layers=8, hidden=512, heads=8, kv_heads=4, experts=64, top_k=8, moe_ff=512, vocab=32000)
_LINE = re.compile(r"weights: (\d+) unit loads, ([\d.]+) GB read")
_EXPERTS = re.compile(r"experts: (\d+) of (\d+) reached")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_ours(
    model_dir: str,
    scratch: str,
    prompts,
    new: int,
    routed: bool,
    cache_mib: int,
    device: str = "cpu",
    dtype: str = "float32",
    layer_pieces: int | None = None,
) -> dict:
    from tiertrain.config import load_config
    from tiertrain.inference.generate import Sampling, generate

    cfg = load_config(
        None,
        [
            f"--model.hf_dir={model_dir}",
            f"--io.paths={scratch}/ssd",
            "--io.weights=tier",
            f"--io.routed_experts={str(routed).lower()}",
            "--memory.host_param_mib=0",
            f"--memory.expert_cache_mib={cache_mib}",
            f"--data.micro_batch_size={len(prompts)}",
            f"--train.device={device}",
            f"--train.param_dtype={dtype}",
            "--train.progress=false",
            *([f"--model.layer_pieces={layer_pieces}"] if layer_pieces else []),
        ],
    )
    h = _Lines()
    log = logging.getLogger("tiertrain")
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        t0 = time.perf_counter()
        out = generate(cfg, prompts, Sampling(max_new_tokens=new), eos=())
        s = time.perf_counter() - t0
    finally:
        log.removeHandler(h)
    line = next(ln for ln in h.lines if ln.startswith("generated"))
    m, e = _LINE.search(line), _EXPERTS.search(line)
    return dict(
        tokens=out,
        s=s,
        gb=float(m.group(2)),
        loads=int(m.group(1)),
        reached=(int(e.group(1)), int(e.group(2))) if e else None,
        line=line,
    )


def run_eval(
    model_dir: str, scratch: str, variant: str, passes: int, rows: int, seq: int, device: str, dtype: str
) -> dict:
    """``tiertrain eval`` of the bundled text (byte-level tokens), ``passes`` passes of two
    micro-batches of ``rows`` rows: ``whole``, ``routed`` (no guesses), ``routed + guesses``."""
    from tiertrain.config import load_config
    from tiertrain.inference.evaluate import evaluate

    cfg = load_config(
        None,
        [
            f"--model.hf_dir={model_dir}",
            f"--io.paths={scratch}/ssd",
            "--io.weights=tier",
            f"--io.routed_experts={str(variant != 'whole').lower()}",
            f"--io.guess_experts={str(variant == 'routed + guesses').lower()}",
            "--memory.host_param_mib=0",
            "--memory.expert_cache_mib=0",
            "--data.eval_corpus=bundled",
            "--data.tokenizer=bytes",
            f"--data.micro_batch_size={rows}",
            f"--data.seq_len={seq}",
            "--data.micro_batches=2",
            f"--data.eval_micro_batches={2 * passes}",
            f"--train.device={device}",
            f"--train.param_dtype={dtype}",
            "--train.progress=false",
        ],
    )
    res = evaluate(cfg)
    return dict(tokens=res.loss, s=res.seconds, gb=res.read_bytes / 1e9, reached=None, line=res.line(), n=res.tokens)


def main(argv: list[str] | None = None) -> int:
    import torch
    from moe import write_config

    from tiertrain.bench.io import run_io_bench
    from tiertrain.bench.output import SCRATCH_HELP, publish, scratch_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="olmoe", help="qwen3_moe, mixtral, olmoe, qwen2_moe, llama4_text or jetmoe")
    ap.add_argument(
        "--layer-pieces", type=int, default=None, help="model.layer_pieces: N > 2 cuts the experts into N - 1 ranges"
    )
    ap.add_argument("--shape", default="", help="overrides of " + ",".join(f"{k}={v}" for k, v in SHAPE.items()))
    ap.add_argument("--device", default="cpu", help="cpu or cuda (tiertrain and transformers' generate alike)")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16, both systems' compute dtype")
    ap.add_argument(
        "--task",
        default="generate",
        help="generate, or eval: passes of two micro-batches of --prompts rows of --prompt-len tokens over the "
        "bundled text (whole blocks, routed reads, routed reads with guesses)",
    )
    ap.add_argument("--passes", type=int, default=8, help="eval: passes")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-fraction", type=float, default=0.25, help="expert cache, of the experts' bytes")
    ap.add_argument("--io-mib", type=int, default=1024, help="size of the disk measurement for the floor")
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shape = dict(SHAPE, **{k: int(v) for k, v in (kv.split("=") for kv in args.shape.split(",") if kv)})

    from transformers import AutoConfig, AutoModelForCausalLM

    with scratch_dir(args.scratch, "moe-routed") as scratch:
        model_dir = os.path.join(scratch, "model")
        write_config(args.family, shape, args.prompt_len + args.new_tokens, model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        config.output_router_logits = False  # transformers' generate fails with it
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(10, shape["vocab"], (args.prompts, args.prompt_len), generator=g).tolist()
        experts_bytes = (
            shape["layers"]
            * shape["experts"]
            * 3
            * shape["hidden"]
            * shape["moe_ff"]
            * getattr(torch, args.dtype).itemsize
        )
        cache_mib = int(experts_bytes * args.cache_fraction) >> 20
        if args.task == "eval":
            text = _eval_task(args, shape, model_dir, scratch)
            publish(text, args.out)
            return 0
        variants = {"whole": (False, 0), "routed": (True, 0), "routed + cache": (True, cache_mib)}
        run_ours(
            model_dir, scratch, prompts[:1], 1, True, 0, args.device, args.dtype, args.layer_pieces
        )  # the converted copy, made once, untimed
        runs: dict[str, list[dict]] = {k: [] for k in variants}
        for r in range(args.rounds):
            for name, (routed, mib) in variants.items():
                runs[name].append(
                    run_ours(
                        model_dir,
                        scratch,
                        prompts,
                        args.new_tokens,
                        routed,
                        mib,
                        args.device,
                        args.dtype,
                        args.layer_pieces,
                    )
                )
                print(f"round {r + 1} {name}: {runs[name][-1]['s']:.2f} s, {runs[name][-1]['gb']:.3f} GB", flush=True)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval().to(args.device)
        hf.config.output_router_logits = False
        t0 = time.perf_counter()
        with torch.no_grad():
            want = hf.generate(
                input_ids=torch.tensor(prompts, device=args.device),
                max_new_tokens=args.new_tokens,
                do_sample=False,
                eos_token_id=None,
            )[:, args.prompt_len :].tolist()
        hf_s = time.perf_counter() - t0
        n_params = sum(p.numel() for p in hf.parameters())
        del hf
        io = run_io_bench([f"{scratch}/ssd"], size_bytes=args.io_mib << 20, repeats=2, use_fio=False, progress=False)
        rbw = io.median("ours", "read")
    text = report(args, shape, n_params, runs, want, hf_s, rbw, cache_mib)
    publish(text, args.out)
    return 0


def _eval_task(args, shape, model_dir: str, scratch: str) -> str:
    """The eval task's rounds (the variants alternated), the disk measured, the report."""
    import platform

    from tiertrain.bench.io import run_io_bench

    # the converted copy, made once, untimed
    run_eval(model_dir, scratch, "routed", 1, args.prompts, args.prompt_len, args.device, args.dtype)
    names = ("whole", "routed", "routed + guesses")
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for r in range(args.rounds):
        for name in names:
            runs[name].append(
                run_eval(model_dir, scratch, name, args.passes, args.prompts, args.prompt_len, args.device, args.dtype)
            )
            print(f"round {r + 1} {name}: {runs[name][-1]['s']:.2f} s, {runs[name][-1]['gb']:.3f} GB", flush=True)
    io = run_io_bench([f"{scratch}/ssd"], size_bytes=args.io_mib << 20, repeats=2, use_fio=False, progress=False)
    rbw = io.median("ours", "read")
    rows = [
        "| variant | s (per round) | tokens/s | GB read | I/O floor s | vs floor | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    med = {}
    for name, rs in runs.items():
        s, gb = statistics.median(r["s"] for r in rs), statistics.median(r["gb"] for r in rs)
        med[name] = (s, gb)
        per = ", ".join(f"{r['s']:.2f}" for r in rs)
        rows.append(
            f"| {name} | {s:.2f} ({per}) | {rs[0]['n'] / s:,.0f} | {gb:.3f} | "
            f"{gb / rbw:.2f} | {s / (gb / rbw):.2f}x | {rs[0]['tokens']:.6f} |"
        )
    same = len({r["tokens"] for rs in runs.values() for r in rs}) == 1
    (ws, wgb), (rs_, rgb), (gs, ggb) = med["whole"], med["routed"], med["routed + guesses"]
    line = runs["routed + guesses"][-1]["line"]
    return "\n".join(
        [
            f"# Eval of a mixture of experts from the storage tier: routed reads with guesses ({args.family}), "
            f"{time.strftime('%Y-%m-%d')}",
            "",
            f"- machine: {platform.machine()}, {os.cpu_count()} cores, one disk; disk read {rbw:.2f} GB/s (measured in this run)",
            f"- model: {args.family} (" + ", ".join(f"{k} {v}" for k, v in shape.items()) + f"), random weights, "
            f"{args.dtype} on {args.device}; `tiertrain eval` of the bundled text, byte-level tokens, {args.passes} passes "
            f"of 2 micro-batches of {args.prompts} x {args.prompt_len} tokens; io.weights = tier, "
            "memory.host_param_mib = 0 (every pass reads the model), no expert cache; "
            f"{args.rounds} rounds alternating the variants, medians",
            "",
            *rows,
            "",
            f"- routed / whole: {rgb / wgb:.2f}x the bytes, {rs_ / ws:.2f}x the time; routed + guesses / whole: "
            f"{ggb / wgb:.2f}x the bytes, {gs / ws:.2f}x the time; routed + guesses / routed: {gs / rs_:.2f}x the time",
            f"- losses of every run equal: {same}",
            f"- the last guessed run's line: `{line}`",
        ]
    )


def report(args, shape, n_params, runs, want, hf_s: float, rbw: float, cache_mib: int) -> str:
    import platform

    made = args.prompts * args.new_tokens
    rows = [
        "| system | s (per round) | tok/s | GB read | MB a token | I/O floor s | vs floor | experts reached | "
        "tokens = transformers' |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    med = {}
    for name, rs in runs.items():
        s = statistics.median(r["s"] for r in rs)
        gb = statistics.median(r["gb"] for r in rs)
        floor = gb / rbw
        med[name] = (s, gb)
        reached = rs[0]["reached"]
        per = ", ".join(f"{r['s']:.2f}" for r in rs)
        rows.append(
            f"| tiertrain {name} | {s:.2f} ({per}) | {made / s:.1f} | {gb:.3f} | "
            f"{gb * 1e3 / made:.1f} | {floor:.2f} | {s / floor:.2f}x | "
            f"{f'{reached[0]} of {reached[1]}' if reached else 'all'} | {all(r['tokens'] == want for r in rs)} |"
        )
    rows.append(f"| transformers generate, in memory | {hf_s:.2f} | {made / hf_s:.1f} | 0 | | | | all | |")
    (ws, wgb), (rs_, rgb) = med["whole"], med["routed"]
    return "\n".join(
        [
            f"# Generation of a mixture of experts from the storage tier: routed expert reads ({args.family}), "
            f"{time.strftime('%Y-%m-%d')}",
            "",
            f"- machine: {platform.machine()}, {os.cpu_count()} cores, one disk; disk read {rbw:.2f} GB/s (measured in this run)",
            f"- model: {args.family}, {n_params / 1e6:.0f} M parameters ("
            + ", ".join(f"{k} {v}" for k, v in shape.items())
            + f"), random weights, {args.dtype} on {args.device}; {args.prompts} prompts of {args.prompt_len} tokens, "
            f"{args.new_tokens} new tokens each (greedy), one micro-batch",
            "- tiertrain: io.weights = tier (the converted copy, O_DIRECT), memory.host_param_mib = 0 (every pass "
            f"reads the model); expert cache {cache_mib} MiB in 'routed + cache' ({args.cache_fraction:.0%} of the "
            f"experts' bytes); {args.rounds} rounds alternating the variants, medians"
            + (
                f"; layers cut into attention and {args.layer_pieces - 1} ranges of experts (model.layer_pieces = "
                f"{args.layer_pieces}), each range reading the experts of its own the routing reaches"
                if args.layer_pieces and args.layer_pieces > 2
                else ""
            ),
            "",
            *rows,
            "",
            f"- routed / whole: {rgb / wgb:.2f}x the bytes, {rs_ / ws:.2f}x the time",
            "- I/O floor: the bytes the storage tier counted at the disk's read rate; the routed reads wait on "
            "the router but for those guessed (io.guess_experts: read ahead where a block's passes reach the same "
            "experts again), the whole blocks' are read ahead of the compute",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
