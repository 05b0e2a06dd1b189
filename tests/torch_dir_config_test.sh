#!/usr/bin/env bash
# Configured with -DTorch_DIR=<this build's LibTorch> on a machine that also
# has Debian's libtorch-dev, the project links only the LibTorch it found:
# no link line names a libtorch*/libc10* outside TORCH_INSTALL_PREFIX
# (versioned names included). CUDA builds only (run by CTest).
#   torch_dir_config_test.sh SOURCE_DIR TORCH_DIR TORCH_INSTALL_PREFIX
set -euo pipefail
source_dir="$1" torch_dir="$2" prefix="$3"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake -S "$source_dir" -B "$work" -G Ninja -DTorch_DIR="$torch_dir" \
  -DCMAKE_CUDA_COMPILER="${CMAKE_CUDA_COMPILER:-/usr/local/cuda/bin/nvcc}" \
  >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
libs="$(grep -o '[^ ",]*/lib\(torch\|c10\)[^ ",/]*\.so[0-9.]*' "$work/build.ninja" |
  sort -u)"
[ -n "$libs" ] || { echo "torch_dir_config_test: no LibTorch library linked"; exit 1; }
foreign="$(grep -v "^$prefix/" <<<"$libs" || true)"
if [ -n "$foreign" ]; then
  echo "torch_dir_config_test: libraries from another LibTorch:"
  echo "$foreign"
  exit 1
fi
echo "torch_dir_config_test: OK ($(wc -l <<<"$libs") LibTorch libraries, all in $prefix)"
