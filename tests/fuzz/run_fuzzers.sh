#!/usr/bin/env bash
# Builds the fuzz targets and runs each for a fixed time, one after the other,
# one process each. Exits non-zero on any finding. See docs/fuzzing.md.
#
#   tests/fuzz/run_fuzzers.sh [SECONDS_PER_TARGET] [TARGET...]   (default 60 s, every target)
#   tests/fuzz/run_fuzzers.sh --seeds                            (rewrites tests/fuzz/corpus)
#
# Targets: profile_graph, schedule (C++, clang + libFuzzer + ASan/UBSan/LSan)
# and plan_json (Python, atheris). Each starts from its seed corpus
# (tests/fuzz/corpus/TARGET, read only) and the saved findings
# (tests/fuzz/regressions/TARGET); new inputs, findings and the log go to
# build/fuzz/TARGET/. Needs root or sudo for apt-get when clang is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
BUILD=${FUZZ_BUILD_DIR:-build/cmake-fuzz}
OUT=${FUZZ_OUT_DIR:-build/fuzz}
ALL_TARGETS=(profile_graph schedule plan_json)

log() { echo "[fuzz] $*"; }

ensure_clang() {
  local probe
  probe=$(mktemp -d)
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' \
    > "$probe/t.cpp"
  if command -v clang++ >/dev/null && clang++ -fsanitize=fuzzer,address,undefined "$probe/t.cpp" \
       -o "$probe/t" 2>/dev/null; then
    rm -rf "$probe"
    return
  fi
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo=sudo; fi
  log "installing clang and compiler-rt (libFuzzer, sanitizer runtimes) with apt-get"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends clang cmake make
  local major
  major=$(clang++ --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n1)
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "libclang-rt-$major-dev"
  clang++ -fsanitize=fuzzer,address,undefined "$probe/t.cpp" -o "$probe/t"
  rm -rf "$probe"
}

ensure_python() {
  if ! (cd / && $PY -c "import pipedream_ext") 2>/dev/null; then
    log "pipedream_ext is not importable: running .ci/bootstrap.sh"
    PYTHON=$PY bash .ci/bootstrap.sh
  fi
  if ! $PY -c "import atheris" 2>/dev/null; then
    log "installing atheris (Python libFuzzer) with pip"
    $PY -m pip install -q atheris==3.0.0 2>&1 | grep -v "Running pip as the 'root' user" || true
  fi
}

build_cpp() {
  ensure_clang
  cmake -S . -B "$BUILD" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPIPEDREAM_FUZZ=ON >/dev/null
  cmake --build "$BUILD" -j 2
}

if [ "${1:-}" = "--seeds" ]; then
  build_cpp
  ensure_python
  rm -rf tests/fuzz/corpus/profile_graph tests/fuzz/corpus/schedule tests/fuzz/corpus/plan_json
  "$BUILD/fuzz_make_seeds" . tests/fuzz/corpus
  $PY tests/fuzz/fuzz_plan_json.py --seeds tests/fuzz/corpus/plan_json
  for t in "${ALL_TARGETS[@]}"; do log "$t: $(ls tests/fuzz/corpus/$t | wc -l) seeds"; done
  exit 0
fi

SECONDS_PER_TARGET=${1:-60}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then TARGETS=("${ALL_TARGETS[@]}"); fi
for t in "${TARGETS[@]}"; do
  case " ${ALL_TARGETS[*]} " in *" $t "*) ;; *) echo "unknown target '$t' (${ALL_TARGETS[*]})" >&2; exit 2 ;; esac
done

need_cpp=0
need_py=0
for t in "${TARGETS[@]}"; do
  if [ "$t" = plan_json ]; then need_py=1; else need_cpp=1; fi
done
[ $need_cpp -eq 1 ] && build_cpp
[ $need_py -eq 1 ] && ensure_python

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p "$OUT"
summary="$OUT/summary.md"
{
  echo "| target | seconds | executions | exec/s | cov | ft | corpus (units/bytes) | findings |"
  echo "|---|---|---|---|---|---|---|---|"
} > "$summary"
total_findings=0

for t in "${TARGETS[@]}"; do
  dir="$OUT/$t"
  rm -rf "$dir"
  mkdir -p "$dir/corpus" "$dir/findings"
  corpora=("$dir/corpus" "tests/fuzz/corpus/$t")
  [ -d "tests/fuzz/regressions/$t" ] && corpora+=("tests/fuzz/regressions/$t")
  if [ "$t" = plan_json ]; then
    cmd=($PY tests/fuzz/fuzz_plan_json.py)
  else
    cmd=("$BUILD/fuzz_$t")
  fi
  log "$t: ${SECONDS_PER_TARGET}s (log: $dir/log.txt)"
  set +e
  timeout --signal=INT --kill-after=30 $((SECONDS_PER_TARGET + 300)) \
    "${cmd[@]}" -max_total_time="$SECONDS_PER_TARGET" -timeout=5 -rss_limit_mb=2048 \
    -max_len=4096 -detect_leaks=1 -print_final_stats=1 -artifact_prefix="$dir/findings/" \
    "${corpora[@]}" > "$dir/log.txt" 2>&1
  rc=$?
  set -e
  done_line=$(grep -E "^#[0-9]+.*cov:" "$dir/log.txt" | tail -n1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log.txt" | tail -n1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$dir/log.txt" | tail -n1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$done_line")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$done_line")
  corp=$(sed -n 's/.* corp: \([^ ]*\).*/\1/p' <<<"$done_line")
  findings=$(find "$dir/findings" -type f | wc -l)
  if [ $rc -ne 0 ] && [ "$findings" -eq 0 ]; then findings=1; fi
  total_findings=$((total_findings + findings))
  echo "| $t | $SECONDS_PER_TARGET | ${execs:-?} | ${rate:-?} | ${cov:-?} | ${ft:-?} | ${corp:-?} | $findings |" >> "$summary"
  log "$t: exit $rc, executions ${execs:-?}, cov ${cov:-?}, corpus ${corp:-?}, findings $findings"
  if [ "$findings" -ne 0 ]; then
    grep -E "FINDING|ERROR|runtime error|SUMMARY" "$dir/log.txt" | head -n 20 || true
    ls "$dir/findings"
  fi
done

echo
cat "$summary"
if [ $total_findings -ne 0 ]; then
  echo "[fuzz] $total_findings finding(s): inputs in $OUT/*/findings/ (replay: the target binary with the file as argument)" >&2
  exit 1
fi
log "no findings"
