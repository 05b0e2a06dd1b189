#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang with AddressSanitizer and
# UndefinedBehaviorSanitizer, into build-fuzz/) and runs each one:
#   1. the inputs of crashes found and fixed before (fuzz/regressions/<target>/),
#      each run once;
#   2. fuzzing for a bounded time, starting from a copy of the seed corpus
#      (fuzz/corpus/<target>/, which is left as it is) in
#      build-fuzz/runs/<target>/corpus/.
#   scripts/fuzz.sh [--seconds N] [target...]
# --seconds N (or MOH_FUZZ_SECONDS): fuzzing time per target, default 20.
# MOH_FUZZ_JOBS: targets fuzzed at once (default: the number of cores).
# Targets: the names of fuzz/*_fuzzer.cc (default: all of them). A target's
# fuzz/<target>.dict (dictionary) and fuzz/<target>.options (extra flags) are
# passed when present.
# Exits non-zero when a target crashes, leaks, runs out of memory or times out,
# naming the input that did it (build-fuzz/runs/<target>/crash-*, leak-*, ...);
# replay one with `build-fuzz/fuzz/<target> <input>`.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${MOH_FUZZ_SECONDS:-20}"
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --seconds=*) seconds="${1#--seconds=}"; shift ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "usage: $0 [--seconds N] [target...]" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [ ${#targets[@]} -eq 0 ]; then
  for source in fuzz/*_fuzzer.cc; do
    targets+=("$(basename "$source" .cc)")
  done
fi

bash scripts/install_deps.sh
export CCACHE_BASEDIR="$PWD"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
if [ ! -f build-fuzz/build.ninja ]; then
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ -DMOH_BUILD_FUZZERS=ON \
    -DMOH_BUILD_TESTS=OFF -DMOH_BUILD_BENCH=OFF
fi
cmake --build build-fuzz --target "${targets[@]}"

# Leaks are checked by libFuzzer itself (-detect_leaks, on by default).
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
options=(-rss_limit_mb=2048 -timeout=10)

# fuzz_one TARGET: replays its regressions, then fuzzes it; prints what it
# found and fails when the target did.
fuzz_one() {
  local target="$1"
  local binary="build-fuzz/fuzz/$target"
  local run="build-fuzz/runs/$target"
  local dict=() extra=()  # fuzz/<target>.options: flags of its own, one a line.
  [ -f "fuzz/$target.dict" ] && dict=("-dict=fuzz/$target.dict")
  if [ -f "fuzz/$target.options" ]; then
    mapfile -t extra < <(grep -v '^#' "fuzz/$target.options" | grep .)
  fi

  rm -rf "$run"
  mkdir -p "$run/corpus"

  if [ -d "fuzz/regressions/$target" ]; then
    echo "fuzz.sh: $target: replaying fuzz/regressions/$target/"
    if ! "$binary" "${options[@]}" "${extra[@]}" "fuzz/regressions/$target"/* \
        > "$run/regressions.log" 2>&1; then
      tail -n 40 "$run/regressions.log"
      echo "fuzz.sh: $target FAILED on a regression input" \
        "(log: $run/regressions.log)"
      return 1
    fi
  fi

  cp -r "fuzz/corpus/$target/." "$run/corpus/"
  echo "fuzz.sh: $target: fuzzing for ${seconds}s"
  if "$binary" "${options[@]}" "${extra[@]}" "${dict[@]}" \
      -max_total_time="$seconds" \
      -print_final_stats=1 -artifact_prefix="$run/" "$run/corpus" \
      > "$run/log" 2>&1; then
    local runs
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$run/log")
    echo "fuzz.sh: $target: ok, $runs runs in ${seconds}s," \
      "corpus $(find "$run/corpus" -type f | wc -l) inputs"
    return 0
  fi
  tail -n 40 "$run/log"
  echo "fuzz.sh: $target FAILED; input(s):" \
    "$(find "$run" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' \
      -o -name 'timeout-*' -o -name 'oom-*' -o -name 'slow-unit-*' \) | tr '\n' ' ')" \
    "(log: $run/log)"
  return 1
}

# libFuzzer runs on one core: as many targets at once as there are cores
# (MOH_FUZZ_JOBS), each with its whole time, their reports printed in order.
jobs_max="${MOH_FUZZ_JOBS:-$(nproc)}"
reports=build-fuzz/runs/reports
rm -rf "$reports"
mkdir -p "$reports"
for target in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  ( status=0
    fuzz_one "$target" > "$reports/$target.log" 2>&1 || status=$?
    echo "$status" > "$reports/$target.status" ) &
done
wait

failed=()
for target in "${targets[@]}"; do
  cat "$reports/$target.log"
  [ "$(cat "$reports/$target.status" 2>/dev/null)" = 0 ] || failed+=("$target")
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: all ${#targets[@]} targets passed"
