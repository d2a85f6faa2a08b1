#!/usr/bin/env bash
# A new user's walk through the README on a clean clone: set-up and the default job, resume
# past checkpoint rotation, Ctrl-C and SIGTERM on each update path, export into a
# used directory, two runs started into one run directory. Every step checks its exit code
# and the files it should (and should not) leave. Prints one line per check and a summary;
# exits non-zero if any check failed.
#
#   tests/walk_readme.sh [CLONE_DIR]      (default: a fresh clone of this repository in /tmp)
#
# Takes about 5 minutes on 2 cores (most of it `make train` building the virtual environment).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-/tmp/tiertrain-walk-$$}
fails=0
say() { printf '%s\n' "$*"; }
check() {  # check "what" command...
  local what=$1; shift
  if "$@"; then say "ok    $what"; else say "FAIL  $what"; fails=$((fails + 1)); fi
}
rc_is() { [ "$1" -eq "$2" ]; }
has_ck() { [ -d "$1/checkpoints/$2" ] && [ -f "$1/checkpoints/$2/manifest.json" ]; }
cks() { ls "$1/checkpoints" 2>/dev/null | tr '\n' ' ' | sed 's/ $//'; }
no_match() { ! grep -q "$1" "$2"; }
lines() { wc -l < "$1" | tr -d ' '; }
no_dup_steps() { python3 -c "import json,sys; s=[json.loads(l)['step'] for l in open(sys.argv[1])]; sys.exit(s != list(range(1, len(s) + 1)))" "$1"; }
# [e]: the pattern does not match the command line of whoever runs pgrep
no_engines_left() { ! pgrep -f "tiertrain[.]update[.]engine" > /dev/null && ! ls "${TMPDIR:-/tmp}" 2>/dev/null | grep -q '^tiertrain-engines'; }
cleaned() { test ! -e "$1" && no_engines_left; }
# Run a command, send it SIGNAL after its first step is logged, return its exit code.
stop_after_first_step() {  # stop_after_first_step SIGNAL GROUP(0/1) LOG command...
  local sig=$1 group=$2 log=$3; shift 3
  setsid "$@" > "$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1200); do grep -q "step *[0-9]*/" "$log" 2>/dev/null && break; sleep 0.1; done
  if [ "$group" = 1 ]; then kill -s "$sig" -- "-$pid"; else kill -s "$sig" "$pid"; fi
  wait "$pid"
}

say "== clone into $dir"
rm -rf "$dir"
git clone -q "$repo" "$dir" && cd "$dir" || exit 2
# a TMPDIR of the walk's own: "nothing left behind" then means by this walk, not by whatever
# else ran on the machine before
rm -rf "$dir.tmp" && mkdir -p "$dir.tmp" && export TMPDIR="$dir.tmp"

say "== the README's two commands (the test command is run by CI; here the first one)"
make train > walk-train.log 2>&1
check "make train exits 0" rc_is $? 0
check "the default job logged 40 steps and its summary" grep -q "done: 40 steps" walk-train.log
check "the default run has its final checkpoint" has_ck runs/default step-00000040
check "the scratch directory is cleaned up after the run" test ! -e tiertrain-scratch
tt=.venv/bin/tiertrain

say "== resume past rotation"
$tt train --resume runs/default --train.steps=46 --checkpoint.every=3 > walk-resume.log 2>&1
check "resume with rotation exits 0" rc_is $? 0
check "checkpoints rotated to the last two" test "$(cks runs/default)" = "step-00000045 step-00000046"
check "metrics hold steps 1..46 once each" no_dup_steps runs/default/metrics.jsonl
$tt train --resume runs/default > walk-finished.log 2>&1
check "resuming a finished run exits 0 and says how to go on" grep -q "raise it: tiertrain train --resume" walk-finished.log

say "== two runs into one run directory"
$tt train > walk-used.log 2>&1
rc=$?
check "a fresh run into a used run directory is refused (exit 1)" rc_is $rc 1
check "... naming --resume and --train.overwrite" grep -q "already holds a run.*--train.overwrite=true" walk-used.log
check "... and the old run is untouched" test "$(cks runs/default)" = "step-00000045 step-00000046"
setsid $tt train --train.run_dir=runs/two --io.paths=./scratch-a --train.steps=100000 > walk-two-a.log 2>&1 &
a=$!
for _ in $(seq 600); do grep -q "step *1/" walk-two-a.log 2>/dev/null && break; sleep 0.1; done
$tt train --train.run_dir=runs/two --io.paths=./scratch-b --train.steps=2 > walk-two-b.log 2>&1
check "a second run into a run directory in use is refused (exit 1)" rc_is $? 1
check "... naming the holder" grep -q "is in use by another tiertrain run (pid $a" walk-two-b.log
kill -TERM "$a"; wait "$a"
check "the first run, stopped by SIGTERM, exits 130" rc_is $? 130
check "... with its metrics intact (one JSON record per line)" no_dup_steps runs/two/metrics.jsonl

say "== Ctrl-C and SIGTERM, on each update path"
for mode in baseline overlap engines; do
  for sig in INT TERM; do
    run=runs/sig-$mode-$sig
    group=$([ "$sig" = INT ] && echo 1 || echo 0)  # Ctrl-C reaches the whole process group
    stop_after_first_step "$sig" "$group" walk-$mode-$sig.log $tt train --train.run_dir=$run --update.mode=$mode --train.steps=100000 --io.paths=./scratch-$mode-$sig
    rc=$?
    check "$mode, SIG$sig: exit 130" rc_is $rc 130
    steps=$(lines $run/metrics.jsonl)
    check "$mode, SIG$sig: saved the checkpoint of its last step ($steps)" has_ck $run "$(printf 'step-%08d' "$steps")"
    check "$mode, SIG$sig: says how to resume" grep -q "resume with: tiertrain train --resume" walk-$mode-$sig.log
    check "$mode, SIG$sig: no traceback" no_match Traceback walk-$mode-$sig.log
    check "$mode, SIG$sig: scratch, lock and engines cleaned up" cleaned ./scratch-$mode-$sig
    $tt train --resume $run --train.steps=$((steps + 2)) > walk-$mode-$sig-resume.log 2>&1
    check "$mode, SIG$sig: resumes to step $((steps + 2))" has_ck $run "$(printf 'step-%08d' $((steps + 2)))"
  done
done

say "== export"
mkdir -p mine && echo mine > mine/notes.txt
$tt export --checkpoint runs/default --out mine --overwrite > walk-export-mine.log 2>&1
check "export --overwrite into a directory of other files is refused (exit 1)" rc_is $? 1
check "... and leaves it as it was" test "$(cat mine/notes.txt)" = mine
$tt export --checkpoint runs/default --out runs/default --overwrite > walk-export-run.log 2>&1
check "export --overwrite into the run it exports is refused (exit 1)" rc_is $? 1
check "... and the run keeps its checkpoints and metrics" test "$(cks runs/default)" = "step-00000045 step-00000046" -a -s runs/default/metrics.jsonl
$tt export --checkpoint runs/default --out exported > walk-export-first.log 2>&1
check "export into a new directory exits 0" rc_is $? 0
touch exported/model-00099-of-00099.safetensors  # a stale shard of an earlier export
$tt export --checkpoint runs/default --out exported > walk-export-used.log 2>&1
check "export into a used directory is refused (exit 1)" rc_is $? 1
check "... and leaves it as it was" test -e exported/model-00099-of-00099.safetensors
$tt export --checkpoint runs/default --out exported --overwrite > walk-export.log 2>&1
check "export --overwrite of an earlier export exits 0" rc_is $? 0
check "... and replaces the directory whole (no stale shard)" test ! -e exported/model-00099-of-00099.safetensors
check "... with the index and the shards" test -f exported/model.safetensors.index.json
$tt train --model.init_from=exported --train.run_dir=runs/from-export --train.steps=2 > walk-init.log 2>&1
check "the export starts a new run (model.init_from)" rc_is $? 0

say "== validation and eval"
$tt train --train.run_dir=runs/val --io.paths=./scratch-val --train.steps=4 --train.eval_every=2 \
  --data.eval_corpus=bundled > walk-val.log 2>&1
check "training with a validation loss exits 0" rc_is $? 0
check "... showing it in the per-step line and the summary" grep -q "step 4/4 | loss [0-9.]* val [0-9.]*" walk-val.log
check "... and the summary" grep -q "validation loss [0-9.]* -> [0-9.]*" walk-val.log
$tt eval --checkpoint runs/default --data.eval_corpus=bundled > walk-eval.log 2>&1
check "tiertrain eval --checkpoint exits 0" rc_is $? 0
check "... printing loss and perplexity" grep -q "^eval: .* | loss [0-9.]* | perplexity [0-9.]*" walk-eval.log
$tt eval --model.init_from=exported --data.eval_corpus=bundled --data.eval_micro_batches=4 > walk-eval-export.log 2>&1
check "tiertrain eval of an export exits 0" rc_is $? 0

$tt generate --checkpoint runs/default --prompt "And God said" --max-new-tokens 40 > walk-gen-default.log 2>&1
check "tiertrain generate --checkpoint runs/default exits 0" rc_is $? 0
check "... leaving no scratch directory behind" test ! -e tiertrain-scratch

$tt plan --probe-mib=16 > walk-plan.log 2>&1
check "tiertrain plan exits 0" rc_is $? 0
check "... leaving no scratch directory behind" test ! -e tiertrain-scratch

say "== ranks"
$tt train --nproc 2 --data.micro_batches=2 --train.steps=3 --train.run_dir=runs/ranks --io.paths=./scratch-ranks \
  > walk-ranks.log 2>&1
check "tiertrain train --nproc 2 exits 0" rc_is $? 0
check "... printing the ranks' network bytes per step" grep -q "ranks 2: net sent" walk-ranks.log
check "... ending with a checkpoint in the one-rank layout" has_ck runs/ranks step-00000003
check "... and no scratch directory left (each rank's removed, then theirs)" test ! -e scratch-ranks
stop_after_first_step INT 1 walk-ranks-int.log $tt train --nproc 2 --data.micro_batches=2 --train.steps=100000 \
  --train.run_dir=runs/ranks-int --io.paths=./scratch-ranks-int
check "--nproc 2, Ctrl-C: exit 130" rc_is $? 130
check "... one resume command, from rank 0, naming --nproc 2" \
  test "$(grep -c 'resume with: tiertrain train --resume .*runs/ranks-int --nproc 2$' walk-ranks-int.log)" = 1
check "... no traceback" no_match Traceback walk-ranks-int.log
steps=$(lines runs/ranks-int/metrics.jsonl)
$tt train --resume runs/ranks-int --nproc 2 --train.steps=$((steps + 1)) > walk-ranks-int-resume.log 2>&1
check "... and the command as printed resumes it to step $((steps + 1))" has_ck runs/ranks-int "$(printf 'step-%08d' $((steps + 1)))"
check "... leaving no scratch directory" test ! -e scratch-ranks-int
$tt export --checkpoint runs/ranks --out exported-ranks > walk-export-ranks.log 2>&1
check "the 2-rank checkpoint exports" rc_is $? 0
$tt train --resume runs/ranks --train.steps=4 > walk-ranks-one.log 2>&1
check "... and resumes on one rank" has_ck runs/ranks step-00000004

say "== fine-tuning on chat rows (the README's walk-through)"
py=.venv/bin/python
$py examples/tiny_chat_model.py runs/tiny-llama > walk-tiny.log 2>&1
check "examples/tiny_chat_model.py writes a model and a tokenizer" test -f runs/tiny-llama/tokenizer.json -a -f runs/tiny-llama/model.safetensors
XDG_CACHE_HOME=$PWD/cache $tt train --model.hf_dir=runs/tiny-llama --data.tokenizer=runs/tiny-llama \
    --data.corpus=examples/chat.jsonl --data.eval_corpus=examples/chat_val.jsonl --train.eval_every=10 \
    --data.seq_len=128 --train.steps=30 --optim.lr=1e-3 --train.run_dir=runs/chat > walk-chat.log 2>&1
check "fine-tuning on examples/chat.jsonl exits 0" rc_is $? 0
check "... preparing the rows once into the cache" test -f "$(ls -d cache/tiertrain/prepared/*/ | head -1)meta.json"
check "... showing validation loss and epochs in the step line" grep -q "step 30/30 | loss [0-9.]* val [0-9.]* | epoch [0-9.]*" walk-chat.log
$tt plot runs/chat > walk-plot.log 2>&1
check "tiertrain plot runs/chat writes runs/chat/curves.png" test -s runs/chat/curves.png
$tt export --checkpoint runs/chat --out runs/chat-export > walk-chat-export.log 2>&1
check "the fine-tuned model exports (with its tokenizer)" test -f runs/chat-export/tokenizer.json
$py -c '
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("runs/chat-export")
model = AutoModelForCausalLM.from_pretrained("runs/chat-export")
chat = [{"role": "user", "content": "How does the verse go on after: \"In the beginning God\"?"}]
ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
print(repr(tok.decode(model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:])))' > walk-hf-generate.log 2>&1
check "transformers loads the export and generates" rc_is $? 0
$tt generate --model.hf_dir=runs/chat-export --prompt "In the beginning" --max-new-tokens 12 > walk-generate.log 2>&1
check "tiertrain generate on the export exits 0" rc_is $? 0
XDG_CACHE_HOME=$PWD/cache $tt train --model.hf_dir=runs/tiny-llama --data.corpus=examples/chat.jsonl \
    --adapter.kind=lora --adapter.rank=8 --model.base_dtype=bfloat16 \
    --data.seq_len=128 --train.steps=30 --optim.lr=1e-3 --train.run_dir=runs/chat-lora > walk-lora.log 2>&1
check "LoRA on the frozen model exits 0" rc_is $? 0
check "... the base frozen (read, never written)" grep -q "the base frozen (read, never written)" walk-lora.log
$tt export --checkpoint runs/chat-lora --out runs/chat-lora-adapter > walk-lora-export.log 2>&1
check "the adapters export as a peft directory" test -f runs/chat-lora-adapter/adapter_model.safetensors -a -f runs/chat-lora-adapter/adapter_config.json
awk '/^\.venv\/bin\/python -c "from peft/{f=1} f{print} f&&/\)\)"$/{exit}' README.md | sed 's/^\.venv\/bin\/python -c "//; s/"$//' > peft_load.py
$py peft_load.py > walk-peft.log 2>&1
check "peft loads the adapter on the original model and generates (the README's line)" rc_is $? 0
check "... printing the prompt and its continuation" grep -q "In the beginning" walk-peft.log
$tt generate --checkpoint runs/chat-lora --prompt "In the beginning" --max-new-tokens 12 > walk-lora-generate.log 2>&1
check "tiertrain generate with the run's adapters exits 0" rc_is $? 0

say "== the README's Python example"
mkdir -p api && (cd api && awk '/^```python$/{f=1;next} /^```$/{if(f){exit}} f' ../README.md > example.py && PYTHONPATH=.. ../.venv/bin/python example.py > ../walk-api.log 2>&1)
check "the Python API example runs" rc_is $? 0
check "... printing the final loss" grep -q "final loss" walk-api.log

say "== summary: $fails failed"
[ "$fails" -eq 0 ]
