"""A mixture of experts trained by tiertrain within a fraction of plain PyTorch's memory, against
plain PyTorch in memory (``vs_plain.py``'s run, on a transformers MoE config).

The model: a transformers config of the chosen family (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) at the
given shape, with the routers' auxiliary loss on (``output_router_logits``, coefficient 0.01 as
Mixtral's and Qwen3-MoE's configs default to), random weights (the reference's initialisation,
seed 0) written once and read by both systems. Everything else is ``vs_plain.py``'s: each system
in its own process, tiertrain's ``memory.host_mib`` at plain's peak RSS / ``--fraction``, the
disk measured in the same run for the floor ``max(plain's step, bytes read / read GB/s + bytes
written / write GB/s)``, losses compared step by step (with the auxiliary loss, as both report).

Usage: python bench/moe.py [--family qwen3_moe] [--shape layers=8,hidden=1024,experts=32,top_k=4,...]
                           [--micro-batches 4] [--seq-len 256] [--steps 4] [--fraction 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vs_plain  # noqa: E402

SHAPE = dict(layers=8, hidden=1024, heads=16, kv_heads=4, experts=32, top_k=4, moe_ff=512, vocab=32000)


def write_config(family: str, shape: dict[str, int], seq_len: int, directory: str) -> None:
    """``family``'s config at ``shape``, auxiliary loss on, in ``directory``/config.json."""
    import transformers as t

    s = shape
    common = dict(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=max(seq_len, 128),
        num_experts_per_tok=s["top_k"],
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
    )
    made = {
        "qwen3_moe": lambda: t.Qwen3MoeConfig(
            **common, num_experts=s["experts"], moe_intermediate_size=s["moe_ff"], head_dim=s["hidden"] // s["heads"]
        ),
        "mixtral": lambda: t.MixtralConfig(**common, num_local_experts=s["experts"], intermediate_size=s["moe_ff"]),
        "olmoe": lambda: t.OlmoeConfig(**common, num_experts=s["experts"], intermediate_size=s["moe_ff"]),
        # a shared expert 4 x an expert's width, gated (Qwen1.5-MoE's proportions)
        "qwen2_moe": lambda: t.Qwen2MoeConfig(
            **common,
            num_experts=s["experts"],
            moe_intermediate_size=s["moe_ff"],
            shared_expert_intermediate_size=4 * s["moe_ff"],
            intermediate_size=4 * s["moe_ff"],
        ),
        # every expert run on every token (those not picked on zeros), a shared expert of an
        # expert's width, chunked attention off (chunks longer than the sequence)
        "llama4_text": lambda: t.Llama4TextConfig(
            **common,
            num_local_experts=s["experts"],
            intermediate_size=s["moe_ff"],
            intermediate_size_mlp=4 * s["moe_ff"],
            head_dim=s["hidden"] // s["heads"],
            attention_chunk_size=max(seq_len, 128),
        ),
        # a mixture of attention heads (as many experts) and of MLPs: routing as counts
        "jetmoe": lambda: t.JetMoeConfig(
            **{k: v for k, v in common.items() if k not in ("num_attention_heads", "router_aux_loss_coef")},
            num_local_experts=s["experts"],
            intermediate_size=s["moe_ff"],
            kv_channels=s["hidden"] // s["heads"],
            aux_loss_coef=0.01,
        ),
    }
    if family not in made:
        raise SystemExit(f"--family {family!r}: one of {', '.join(made)}")
    made[family]().save_pretrained(directory)


def main(argv: list[str] | None = None) -> int:
    from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument(
        "--shape", default="", help="shape fields to change: " + ",".join(f"{k}={v}" for k, v in SHAPE.items())
    )
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="steps (the first is warm-up)")
    ap.add_argument("--fraction", type=float, default=5.0, help="tiertrain's memory.host_mib = plain's peak RSS / this")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument(
        "--io-mib", type=int, default=1024, help="MiB the disk's bandwidth is measured with (for the floor)"
    )
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shape = dict(SHAPE, **{k: int(v) for k, v in (kv.split("=", 1) for kv in filter(None, args.shape.split(",")))})
    out = checked_out(args.out) if args.out else None
    with scratch_dir(args.scratch, "moe") as scratch:
        args.hf_config, args.model = os.path.join(scratch, "config"), ""
        write_config(args.family, shape, args.seq_len, args.hf_config)
        report = vs_plain.run(args, scratch)
    publish(report.replace("# tiertrain ", f"# A mixture of experts ({args.family}): tiertrain ", 1), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
