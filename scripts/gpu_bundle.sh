#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU machine that has CUDA and the
# same torch wheel (python3 -c 'import torch') but none of Debian's gRPC,
# Protobuf, Abseil, prometheus-cpp or OpenBLAS packages: the `device` machines
# lent to this project's sessions (torch 2.11.0+cu130, Python 3.12, no package
# registry, 64 MiB carried per call).
#
#   scripts/gpu_bundle.sh [DIR]      (default .gpu-bundle, ignored by git)
#
# Builds build-cuda (scripts/build.sh --torch=wheel: the wheel pinned in
# torch_wheel.env is the one the device has, so binaries built here link the
# LibTorch it already holds), then writes into DIR:
#   bin/       the GPU suite's and the benchmark's executables, debug info
#              stripped, and protoc + grpc_python_plugin (the integration
#              tests generate their Python stubs with them)
#   lib/       every shared library those need that is neither LibTorch's,
#              CUDA's nor the C/C++ runtime's (ldd, recursively): gRPC,
#              Protobuf, Abseil, prometheus-cpp, OpenBLAS, ...
#   build-cuda/  the CTest files of build-cuda, so that `ctest -L gpu` runs
#              the project's own test definitions there
#   fixtures/  the test checkpoints (tests/reference/make_fixtures.py, run
#              with Debian's Python as CI runs it: the image fixtures check
#              their resampling against Debian's Pillow 9.4)
#   source_dir the absolute path build-cuda was configured from (CTest files
#              and test binaries name it; gpu_check.sh links it to its checkout)
# all packed as DIR/bundle.tar.xz (about 25 MB: OpenBLAS alone is 36 MB
# unpacked), which gpu_check.sh unpacks.
# xgrammar (response_format) is a static library linked into the binaries:
# install_deps.sh builds it here (install_xgrammar.sh), the device needs
# nothing of it.
# Why binaries rather than .deb files to build from: a build of the CUDA
# LibTorch targets takes longer than a lease's 10-minute command on 16 cores,
# while the bundle is carried in seconds and starts at once.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.gpu-bundle}"
# shellcheck source=torch_wheel.env
. scripts/torch_wheel.env

targets=(moh-server moh-client moh-bench moh-generate gpu_model_test
  moh_cuda_linear_bench)
bash scripts/install_deps.sh --torch=wheel
bash scripts/build.sh --torch=wheel "${targets[@]}"

rm -rf "$out"
final="$out"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
mkdir -p "$out/bin" "$out/lib"
pwd >"$out/source_dir"
declare -A binary=(
  [moh-server]=build-cuda/service/moh-server
  [moh-client]=build-cuda/client/moh-client
  [moh-bench]=build-cuda/client/moh-bench
  [moh-generate]=build-cuda/tools/moh-generate
  [gpu_model_test]=build-cuda/tests/gpu_model_test
  [moh_cuda_linear_bench]=build-cuda/bench/moh_cuda_linear_bench
)
for t in "${targets[@]}"; do
  objcopy --strip-debug "${binary[$t]}" "$out/bin/$t"
done
cp "$(command -v protoc)" "$(command -v grpc_python_plugin)" "$out/bin/"

# Libraries the device has already: LibTorch and what its wheel brings
# (CUDA, cuDNN, NCCL, its OpenMP), the driver, and the C/C++ runtime.
provided='^(libtorch|libc10|libcaffe2|libshm|libgomp|libcuda\.|libcudart|libcupti|libcudnn|libcublas|libcufft|libcufile|libcurand|libcusolver|libcusparse|libnv|libnccl|libc\.so|libm\.so|libdl\.so|libpthread|librt\.so|ld-linux|libstdc\+\+|libgcc_s|linux-vdso)'
torch_lib="$("$MOH_TORCH_VENV/bin/python" -W ignore -c \
  'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
for f in "$out"/bin/*; do
  LD_LIBRARY_PATH="$torch_lib" ldd "$f"
done | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    if [[ "$name" =~ $provided ]]; then continue; fi
    cp -L "$path" "$out/lib/$name"
  done

/usr/bin/python3 tests/reference/make_fixtures.py "$out/fixtures" >/dev/null

# The CTest files, regenerated, with the test binaries' paths as they are
# here and the configured Python as @MOH_PYTHON3@ (gpu_check.sh names the
# device's).
cmake build-cuda >/dev/null
python3="$(sed -n 's/^MOH_PYTHON3:FILEPATH=//p' build-cuda/CMakeCache.txt)"
(cd build-cuda && find . -name CTestTestfile.cmake) | while read -r f; do
  mkdir -p "$out/build-cuda/$(dirname "$f")"
  sed "s#$python3#@MOH_PYTHON3@#g" "build-cuda/$f" >"$out/build-cuda/$f"
done
libs="$(ls "$out/lib" | wc -l)"
mkdir -p "$final"
tar -C "$out" -cf - . | xz -T2 -6 >"$final/bundle.tar.xz"
echo "gpu_bundle: $final/bundle.tar.xz, $(du -sh "$final/bundle.tar.xz" | cut -f1)" \
  "($libs libraries; $(du -sh "$out" | cut -f1) unpacked)"
