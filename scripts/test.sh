#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs every test on
# both LibTorch builds, then the container image test.
#   1. Debian's LibTorch 1.13 (CPU), in build/; then the fuzz targets, 20 s
#      each (scripts/fuzz.sh, clang, in build-fuzz/; MOH_TEST_FUZZ=0 skips).
#   2. The PyPI torch wheel's LibTorch 2.x (CUDA), in build-cuda/: every target,
#      a check that moh-server links libtorch_cuda, and the whole suite again
#      but the soak (the CUDA build runs on CPU too; tests labelled `gpu` run
#      on a GPU when one is present and report themselves skipped otherwise).
#      Needs the CUDA toolkit (nvcc in $CUDA_HOME, default /usr/local/cuda).
#   3. The CPU container image, built with buildah and served from
#      (tests/image_test.sh).
#   Under CI, also the sanitizer builds (scripts/sanitize.sh).
#   Each step's wall time is printed when it ends and again at the end.
# MOH_TEST_WHEEL, MOH_TEST_IMAGE and MOH_TEST_SANITIZERS: 1 runs that step, 0
# skips it, auto (the default) runs it when its prerequisite is there (the
# CUDA toolkit; root for buildah; CI for the sanitizers) and says why when
# not. Under CI (CI=true) auto means 1.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=torch_wheel.env
. scripts/torch_wheel.env

# Two tests at a time, each with LibTorch's intra-op pool: OpenMP threads
# that spin while they wait for work would take the cores from the other
# test (the torch wheel's pool ran vit_lowp_weights_test 6x slower), so they
# wait passively here.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"

ctest_build() {  # ctest_build DIR [ctest args...]
  local dir="$1"
  shift
  ctest --test-dir "$dir" --output-on-failure -j2 --timeout 900 "$@"
}

# Each step's wall time, printed as it ends and again at the end (CI's
# budget is kept by these).
timings=()
t_step=$SECONDS
step_done() {
  local line
  line="$(printf '%-34s %5d s' "$1" $((SECONDS - t_step)))"
  timings+=("$line")
  echo "test.sh: $line"
  t_step=$SECONDS
}

want() {  # want VALUE PREREQUISITE_OK : decides auto
  case "$1" in
    1) return 0 ;;
    0) return 1 ;;
    *) [ "${CI:-}" = true ] || [ "$2" = 1 ] ;;
  esac
}

bash scripts/install_deps.sh
bash scripts/install_deps.sh --test
step_done "install"
bash scripts/build.sh
step_done "build (Debian LibTorch)"
ctest_build build
step_done "tests (Debian LibTorch)"
if [ "${MOH_TEST_FUZZ:-1}" != 0 ]; then
  bash scripts/fuzz.sh
  step_done "fuzz"
fi

# Sanitizers (scripts/sanitize.sh): ThreadSanitizer on the batcher, planner,
# engine loop and scheduler tests; AddressSanitizer + UBSan on every C++ test
# and the Python suites against the instrumented server. Long (a third
# build): by default only under CI.
if want "${MOH_TEST_SANITIZERS:-auto}" 0; then
  bash scripts/sanitize.sh thread
  step_done "sanitizers: thread"
  bash scripts/sanitize.sh address
  step_done "sanitizers: address"
else
  echo "test.sh: skipping the sanitizer builds (MOH_TEST_SANITIZERS=1 runs" \
    "them; CI always does)"
fi

have_nvcc=0
[ -x "$MOH_CUDA_HOME/bin/nvcc" ] && have_nvcc=1
if want "${MOH_TEST_WHEEL:-auto}" "$have_nvcc"; then
  bash scripts/install_deps.sh --torch=wheel
  bash scripts/build.sh --torch=wheel
  step_done "build (torch wheel, CUDA)"
  # Everything but the soak: a minute of mixed load on the server code the
  # Debian build's soak ran above, where nothing depends on the LibTorch.
  ctest_build build-cuda -LE soak
  step_done "tests (torch wheel, CUDA)"
else
  echo "test.sh: skipping the LibTorch ${MOH_TORCH_WHEEL_VERSION} CUDA build:" \
    "no nvcc in $MOH_CUDA_HOME/bin (set CUDA_HOME, or MOH_TEST_WHEEL=0 to silence)"
fi

is_root=0
[ "$(id -u)" -eq 0 ] && is_root=1
if want "${MOH_TEST_IMAGE:-auto}" "$is_root"; then
  bash tests/image_test.sh
  step_done "container image"
else
  echo "test.sh: skipping the container image test: buildah's chroot" \
    "isolation needs root (MOH_TEST_IMAGE=0 to silence)"
fi

echo "test.sh: passed; wall time by step:"
printf '  %s\n' "${timings[@]}"
