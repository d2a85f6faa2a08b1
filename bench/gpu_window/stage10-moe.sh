#!/usr/bin/env bash
# GPU window, stage 10: a mixture of experts (Qwen3-MoE-shaped, 8 layers of 2048, 32 experts of
# 1024, top-4, the routers' auxiliary loss on; 1.8 B parameters) trained by tiertrain with two thirds of
# plain PyTorch's peak host memory, states beyond it on the drive, against plain PyTorch + fused
# AdamW in device memory, bf16 on CUDA (bench/moe.py, vs_plain.py's run): step time against the
# floor max(plain's step, the drive's bytes), losses step by step (with the auxiliary loss).
# Then (time left) generation from the drive with routed expert reads against whole blocks and
# transformers' generate in device memory (bench/moe_routed.py): bytes a token, tokens equal.
#
#   bench/gpu_window/stage10-moe.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage10-moe
source "$(dirname "$0")/lib.sh" "$@"

if [ "$dry" = 1 ]; then
  step "bench/moe.py on CPU, Qwen3-MoE of 2 layers of 128, 4 experts, the default budget (dry run)" 0 200 \
    "$PY" bench/moe.py --shape layers=2,hidden=128,heads=4,kv_heads=2,experts=4,top_k=2,moe_ff=64,vocab=1000 \
    --seq-len 32 --micro-batches 2 --steps 2 --fraction 0 --io-mib 64 --scratch "$nvme/moe" --out "$out/stage10-moe-bench.md"
  step "bench/moe_routed.py on CPU, OLMoE of 2 layers of 128, 16 experts (dry run)" 0 120 \
    "$PY" bench/moe_routed.py --shape layers=2,hidden=128,heads=4,kv_heads=2,experts=16,top_k=2,moe_ff=64,vocab=1000 \
    --prompts 2 --prompt-len 8 --new-tokens 2 --rounds 1 --io-mib 16 --scratch "$nvme/routed" --out "$out/stage10-moe-routed.md"
else
  step "Qwen3-MoE 1.8 B (32 experts, top-4, auxiliary loss), bf16 on CUDA, 2/3 of plain's host memory, vs plain PyTorch in device memory (bench/moe.py)" \
    1 520 "$PY" bench/moe.py --shape layers=8,hidden=2048,heads=16,kv_heads=4,experts=32,top_k=4,moe_ff=1024,vocab=32000 \
    --seq-len 1024 --micro-batches 4 --steps 4 --fraction 1.5 --set train.device=cuda \
    --scratch "$nvme/moe" --out "$out/stage10-moe-bench.md"
  step "generation from the drive: routed expert reads vs whole blocks vs transformers in device memory, OLMoE 0.9 B on CUDA (bench/moe_routed.py)" \
    1 200 "$PY" bench/moe_routed.py --device cuda --dtype bfloat16 --shape layers=8,hidden=1024,heads=16,kv_heads=4,experts=64,top_k=8,moe_ff=512,vocab=32000 \
    --prompts 4 --new-tokens 16 --rounds 2 --scratch "$nvme/routed" --out "$out/stage10-moe-routed.md"
fi
finish
