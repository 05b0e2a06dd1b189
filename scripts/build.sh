#!/usr/bin/env bash
# Configures and builds moh-serve (ccache + precompiled headers make rebuilds
# after a one-file change take seconds).
#   scripts/build.sh [--torch=debian|wheel] [target...]
# --torch=debian (default): Debian's LibTorch 1.13, CPU, into build/.
# --torch=wheel: the PyPI torch wheel's LibTorch (2.x, CUDA; install it with
#   `scripts/install_deps.sh --torch=wheel`) and nvcc from $CUDA_HOME
#   (/usr/local/cuda), into build-cuda/.
# Targets, e.g. `scripts/build.sh moh-generate`, build only those.
set -euo pipefail
cd "$(dirname "$0")/.."
torch=debian
case "${1:-}" in
  --torch=*) torch="${1#--torch=}"; shift ;;
esac
# Let clones in other directories share ccache entries; the sloppiness settings
# are what ccache needs to cache translation units that use precompiled headers.
export CCACHE_BASEDIR="$PWD"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
case "$torch" in
  debian)
    dir=build
    args=()
    ;;
  wheel)
    # shellcheck source=torch_wheel.env
    . scripts/torch_wheel.env
    dir=build-cuda
    if [ ! -x "$MOH_TORCH_VENV/bin/python" ]; then
      echo "build.sh: no torch wheel in $MOH_TORCH_VENV;" \
        "run scripts/install_deps.sh --torch=wheel" >&2
      exit 1
    fi
    if [ ! -x "$MOH_CUDA_HOME/bin/nvcc" ]; then
      echo "build.sh: no nvcc in $MOH_CUDA_HOME/bin (set CUDA_HOME to the CUDA" \
        "toolkit)" >&2
      exit 1
    fi
    export PATH="$MOH_CUDA_HOME/bin:$PATH"
    prefix="$("$MOH_TORCH_VENV/bin/python" -W ignore -c \
      'import torch.utils; print(torch.utils.cmake_prefix_path)')"
    args=(-DCMAKE_PREFIX_PATH="$prefix"
      -DCMAKE_CUDA_COMPILER="$MOH_CUDA_HOME/bin/nvcc"
      -DCUDAToolkit_ROOT="$MOH_CUDA_HOME")
    ;;
  *)
    echo "usage: $0 [--torch=debian|wheel] [target...]" >&2
    exit 2
    ;;
esac
if [ ! -f "$dir/build.ninja" ]; then
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${args[@]}"
fi
if [ $# -gt 0 ]; then
  cmake --build "$dir" --target "$@"
else
  cmake --build "$dir"
fi
