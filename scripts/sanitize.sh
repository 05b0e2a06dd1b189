#!/usr/bin/env bash
# Sanitizer builds and their tests (run by scripts/test.sh under CI).
#   scripts/sanitize.sh address   AddressSanitizer + UndefinedBehaviorSanitizer
#       build of everything (Debian's LibTorch) in build-asan/; runs every C++
#       test and the Python suites against the instrumented moh-server
#       (CTest labels gpu and soak excluded).
#   scripts/sanitize.sh thread    ThreadSanitizer build in build-tsan/ of the
#       concurrent pieces without gRPC: the batcher, the step planner, the
#       engine loop and the continuous-batching scheduler, and their tests.
#       Debian's Abseil is not instrumented, and its mutexes are what these
#       pieces synchronize with, so this builds Debian's own Abseil source
#       (the same release, checksum-verified) with -fsanitize=thread first.
#   scripts/sanitize.sh           both.
# Reports fail the run (halt_on_error); suppressions for the uninstrumented
# libraries are in tests/sanitizers/.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
root="$PWD"
export CCACHE_BASEDIR="$PWD"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"

run_address() {
  local dir=build-asan
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DMOH_SANITIZE=address -DMOH_BUILD_BENCH=OFF
  fi
  cmake --build "$dir"
  # Two tests at a time: OpenMP threads wait passively (scripts/test.sh).
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
  export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=0:check_initialization_order=1"
  export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
  ctest --test-dir "$dir" --output-on-failure -j2 --timeout 1800 -LE 'gpu|soak'
}

# Debian's Abseil source (the release libabsl-dev ships), instrumented for
# TSan. The tarball and the installed build are cached outside the checkout
# (a fresh clone does not build Abseil again), the install in a folder named
# by the release, the compiler's version and the flags.
ABSL_VERSION=20220623.1
ABSL_SHA256=abfe2897f3a30edaa74bc34365afe3c2a3cd012091a97dc7e008f7016adcd5fe
ABSL_URL="http://deb.debian.org/debian/pool/main/a/abseil/abseil_${ABSL_VERSION}.orig.tar.gz"
ABSL_TSAN_FLAGS="-fsanitize=thread -fno-omit-frame-pointer"
MOH_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/moh-serve"

# The instrumented Abseil's install prefix (printed), built when missing.
tsan_abseil() {
  local key prefix tarball="$MOH_CACHE/abseil_${ABSL_VERSION}.orig.tar.gz"
  key="$( (c++ --version | head -1; echo "$ABSL_TSAN_FLAGS") |
    sha256sum | cut -c1-12)"
  prefix="$MOH_CACHE/absl-tsan-${ABSL_VERSION}-$key"
  if [ ! -f "$prefix/.done" ]; then
    mkdir -p "$MOH_CACHE"
    if ! echo "$ABSL_SHA256  $tarball" | sha256sum -c --status 2>/dev/null; then
      echo "sanitize.sh: downloading $ABSL_URL" >&2
      curl -fsSL -o "$tarball.part" "$ABSL_URL"
      echo "$ABSL_SHA256  $tarball.part" | sha256sum -c --quiet
      mv "$tarball.part" "$tarball"
    fi
    local src=build-tsan/abseil-src
    rm -rf "$src" build-tsan/abseil-build "$prefix.part" "$prefix"
    mkdir -p "$src"
    tar -xzf "$tarball" -C "$src" --strip-components=1
    cmake -S "$src" -B build-tsan/abseil-build -G Ninja \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_STANDARD=17 \
      -DABSL_PROPAGATE_CXX_STD=ON -DBUILD_TESTING=OFF \
      -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
      -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
      -DCMAKE_CXX_FLAGS="$ABSL_TSAN_FLAGS" \
      -DCMAKE_INSTALL_PREFIX="$prefix.part" > /dev/null
    cmake --build build-tsan/abseil-build >&2
    cmake --install build-tsan/abseil-build > /dev/null
    touch "$prefix.part/.done"
    mv "$prefix.part" "$prefix"
    rm -rf "$src" build-tsan/abseil-build
  fi
  echo "$prefix"
}

run_thread() {
  local dir=build-tsan
  local tests=(batcher_test callback_thread_test step_planner_test
    engine_loop_test language_executor_test)
  local absl
  absl="$(tsan_abseil)"
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DMOH_SANITIZE=thread -DMOH_BUILD_BENCH=OFF \
      -DCMAKE_PREFIX_PATH="$absl"
  fi
  cmake --build "$dir" --target "${tests[@]}"
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/sanitizers/tsan.supp"
  # One intra-op thread: LibTorch's OpenMP pool is not instrumented.
  export OMP_NUM_THREADS=1
  local regex
  regex="^(make_fixtures|$(IFS='|'; echo "${tests[*]}"))$"
  ctest --test-dir "$dir" --output-on-failure -j2 --timeout 1800 -R "$regex"
}

case "${1:-all}" in
  address) run_address ;;
  thread) run_thread ;;
  all) run_thread; run_address ;;
  *)
    echo "usage: $0 [address | thread | all]" >&2
    exit 2
    ;;
esac
