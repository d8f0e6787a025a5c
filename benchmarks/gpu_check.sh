#!/usr/bin/env bash
# make gpu-check: the one prepared run for a lent GPU machine (benchmarks/README.md, "GPU runs").
#
# Sized for 8 minutes of a 15-minute device budget, the machine's start included: each
# step has its own time limit and a failed step does not stop the next. Writes, under
# $OUT (default out/gpu-check):
#   gpu_check.md          the summary: machine, versions, every step's status and seconds,
#                         the test summary, the main job's accuracy, both benchmark tables
#   gpu_check.log         every step's whole output
#   vs_torch_world1.md    ours against torch.distributed.pipelining, 1 NCCL rank, chunks
#   vs_torch_world2.md    the same, 2 Gloo ranks carrying CUDA tensors on the one GPU
#   vs_torch_world*.json  their raw records
# Run from the repository root on the GPU machine (its own torch; no network, no pip):
#   OUT=/some/dir make gpu-check
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu-check}
PY=${PY:-python3}
# DEVICE=cpu runs the same steps on a machine without a GPU (tests/test_bench_scripts.py).
DEVICE=${DEVICE:-cuda:0}
# VS_TORCH_ARGS replaces the benchmark's rounds (e.g. --smoke, with DEVICE=cpu).
W1_ARGS=${VS_TORCH_ARGS:---pairs 6 --steps 4}
W2_ARGS=${VS_TORCH_ARGS:---pairs 4 --steps 4}
mkdir -p "$OUT"
SUMMARY="$OUT/gpu_check.md"
LOG="$OUT/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
failed=0

# step NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, its output into the log,
# and one row of the summary's step table.
step() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "===== $name (limit ${limit} s): $*" >>"$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  local status="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMED OUT"; elif [ "$rc" -ne 0 ]; then status="FAILED (exit $rc)"; fi
  [ "$rc" -eq 0 ] || failed=1
  echo "| $name | $status | $took |" >>"$OUT/steps.part"
  echo "[gpu-check] $name: $status in ${took} s"
}

: >"$OUT/steps.part"
{
  echo "# make gpu-check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo '```'
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not found"
  nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader 2>&1 || true
  $PY -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| NCCL", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-", "| GPU visible:", torch.cuda.is_available())' 2>&1
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --short 2>/dev/null | wc -l) files changed"
  echo '```'
} >"$SUMMARY"

step "build (setup.py build_ext, 16 jobs)" 240 env MAX_JOBS=16 $PY setup.py -q build_ext --inplace
step "GPU tests (tests/test_gpu.py, tests/test_units.py)" 210 $PY -m pytest tests/test_gpu.py tests/test_units.py -q -rs
step "main job, 1 NCCL rank, interleaved-1f1b, 4 chunks" 60 $PY -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_digits.py --schedule interleaved-1f1b --chunks 4
step "GPT vs torch, 1 NCCL rank with chunks" 90 $PY benchmarks/vs_torch.py --device "$DEVICE" --world 1 $W1_ARGS --out-dir "$OUT/w1"
step "GPT vs torch, 2 Gloo ranks, CUDA tensors" 120 $PY benchmarks/vs_torch.py --device "$DEVICE" --world 2 $W2_ARGS --out-dir "$OUT/w2"

for w in 1 2; do
  [ -f "$OUT/w$w/vs_torch.md" ] && mv "$OUT/w$w/vs_torch.md" "$OUT/vs_torch_world$w.md"
  [ -f "$OUT/w$w/vs_torch.json" ] && mv "$OUT/w$w/vs_torch.json" "$OUT/vs_torch_world$w.json"
  rm -rf "$OUT/w$w"
done

{
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
  cat "$OUT/steps.part"
  echo
  echo "Tests: $(grep -E '^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$LOG" | tail -n 1)"
  echo
  echo "Main job: $(grep -E 'TEST ACCURACY' "$LOG" | tail -n 1)"
  for w in 1 2; do
    echo
    if [ -f "$OUT/vs_torch_world$w.md" ]; then sed -n '1,/^Load average/p' "$OUT/vs_torch_world$w.md"; else echo "(no vs_torch --world $w report: see gpu_check.log)"; fi
  done
  if [ "$failed" -ne 0 ]; then
    echo
    echo "## Failures: the last lines of the log"
    echo '```'
    tail -n 60 "$LOG"
    echo '```'
  fi
} >>"$SUMMARY"
rm -f "$OUT/steps.part"
echo "[gpu-check] wrote $SUMMARY"
exit "$failed"
