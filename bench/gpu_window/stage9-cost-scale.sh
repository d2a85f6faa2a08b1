#!/usr/bin/env bash
# GPU window, stage 9 of 9: the cost model at scale (#35). The trainer's own prediction, made before
# the first step from probes in the same process, against the median of steps 2-4 (its "step time:
# predicted ... measured" line), on the two Llama shapes of at least 1 B of the CPU records
# (bench/results/cost-model-1.06b-gqa-cpu-vm.md, cost-model-1.2b-gqa-cpu-vm.md), bf16 on CUDA,
# every state but a ~3 GiB host budget on the drive, the speculative path and the overlapped one.
# About two minutes a run (an H200 and one drive: 16-19 s a step), the speculative runs first.
#
#   bench/gpu_window/stage9-cost-scale.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage9-cost-scale
source "$(dirname "$0")/lib.sh" "$@"

common=(--model.kind=llama --model.n_heads=16 --model.vocab_size=32000 --model.max_seq_len=64 --data.seq_len=64
        --data.micro_batch_size=1 --data.micro_batches=8 --train.steps=5 --checkpoint.at_end=false --update.mode=overlap --optim.grad_clip=100)
if [ "$dry" = 1 ]; then
  common+=(--train.device=cpu --model.d_model=128 --model.n_layers=2 --model.d_ff=256 --model.n_kv_heads=8
           --model.vocab_size=1024 --memory.host_mib=1024)
  shapes=("tiny:")
else
  common+=(--train.device=cuda --model.d_model=2048)
  # name:flags (1.06 B: 20 blocks, GQA 16/8; 1.21 B: 24 blocks, GQA 16/4)
  shapes=("1.06b:--model.n_layers=20 --model.n_kv_heads=8 --model.d_ff=5504 --memory.host_mib=3000"
          "1.2b:--model.n_layers=24 --model.n_kv_heads=4 --model.d_ff=5632 --memory.host_mib=3123")
fi
for spec in on off; do
  for s in "${shapes[@]}"; do
    name=${s%%:*}-speculate-$spec
    read -r -a flags <<< "${s#*:}"
    dir=$nvme/$name
    step "$name: tiertrain train, predicted against measured" 0 150 \
      "${TT[@]}" train "${common[@]}" "${flags[@]}" --update.speculate="$spec" \
      --io.paths="[\"$dir/s\"]" --train.run_dir="$dir/run"
    rm -rf "$dir"
  done
done
say ""
say "The predictions against the measured steps (the trainer's lines above):"
lines=$(grep -h "step time: predicted" "$results" | sed 's/^[0-9:]* INFO /- /')  # read whole before appending
say "${lines:-- none: no run reached its fourth step}"
finish
