#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs every test on
# both LibTorch builds, then the container image test.
#   1. Debian's LibTorch 1.13 (CPU), in build/; then the fuzz targets, 20 s
#      each (scripts/fuzz.sh, clang, in build-fuzz/; MOH_TEST_FUZZ=0 skips).
#   2. The PyPI torch wheel's LibTorch 2.x (CUDA), in build-cuda/: every target,
#      a check that moh-server links libtorch_cuda, and the whole suite again
#      (the CUDA build runs on CPU too; tests labelled `gpu` run on a GPU when
#      one is present and report themselves skipped otherwise). Needs the CUDA
#      toolkit (nvcc in $CUDA_HOME, default /usr/local/cuda).
#   3. The CPU container image, built with buildah and served from
#      (tests/image_test.sh).
#   Under CI, also the sanitizer builds (scripts/sanitize.sh).
# MOH_TEST_WHEEL, MOH_TEST_IMAGE and MOH_TEST_SANITIZERS: 1 runs that step, 0
# skips it, auto (the default) runs it when its prerequisite is there (the
# CUDA toolkit; root for buildah; CI for the sanitizers) and says why when
# not. Under CI (CI=true) auto means 1.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=torch_wheel.env
. scripts/torch_wheel.env

ctest_build() {
  ctest --test-dir "$1" --output-on-failure -j2 --timeout 900
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
bash scripts/build.sh
ctest_build build
[ "${MOH_TEST_FUZZ:-1}" = 0 ] || bash scripts/fuzz.sh

# Sanitizers (scripts/sanitize.sh): ThreadSanitizer on the batcher, planner,
# engine loop and scheduler tests; AddressSanitizer + UBSan on every C++ test
# and the Python suites against the instrumented server. Long (a third
# build): by default only under CI.
if want "${MOH_TEST_SANITIZERS:-auto}" 0; then
  bash scripts/sanitize.sh
else
  echo "test.sh: skipping the sanitizer builds (MOH_TEST_SANITIZERS=1 runs" \
    "them; CI always does)"
fi

have_nvcc=0
[ -x "$MOH_CUDA_HOME/bin/nvcc" ] && have_nvcc=1
if want "${MOH_TEST_WHEEL:-auto}" "$have_nvcc"; then
  bash scripts/install_deps.sh --torch=wheel
  bash scripts/build.sh --torch=wheel
  ctest_build build-cuda
else
  echo "test.sh: skipping the LibTorch ${MOH_TORCH_WHEEL_VERSION} CUDA build:" \
    "no nvcc in $MOH_CUDA_HOME/bin (set CUDA_HOME, or MOH_TEST_WHEEL=0 to silence)"
fi

is_root=0
[ "$(id -u)" -eq 0 ] && is_root=1
if want "${MOH_TEST_IMAGE:-auto}" "$is_root"; then
  bash tests/image_test.sh
else
  echo "test.sh: skipping the container image test: buildah's chroot" \
    "isolation needs root (MOH_TEST_IMAGE=0 to silence)"
fi
