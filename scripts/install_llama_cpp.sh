#!/usr/bin/env bash
# Builds llama.cpp's own benchmark tools (llama-batched-bench, llama-bench,
# llama-quantize) from the llama.cpp tree that llama-cpp-python's pinned PyPI
# source distribution vendors (llama_cpp.env, sha256-checked), with
# GGML_NATIVE=ON: every instruction set this CPU has, as a llama.cpp user
# building it here would get (on a CPU with AMX, every one but AMX: below).
# Installs them, their shared libraries and the
# tree's gguf-py (bench/make_gguf.py writes GGUFs with it) into
# $MOH_LLAMA_CPP_PREFIX; skipped when that prefix already holds this version
# built on a CPU with the same flags (a native build does not move between
# machines). Called by `install_deps.sh --bench`; no CI stage needs it.
# About 10 minutes of CPU on the 2-core machine (CPU backend only: no server, no
# multimodal library, no tests).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=llama_cpp.env
. "$here/llama_cpp.env"
# shellcheck source=fetch_verified.sh
. "$here/fetch_verified.sh"

# The CPU's instruction-set flags: a native build made elsewhere is rebuilt.
cpu_flags="$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' |
  grep -E '^(avx|fma|f16c|sse4|amx)' | sort | tr '\n' ' ')"
stamp="$MOH_LLAMA_CPP_SDIST_VERSION $cpu_flags"
# GGML_NATIVE=ON (-march=native), except on CPUs with AMX: llama.cpp's AMX
# path (tinygemm_kernel_amx, Q8_0) died of SIGILL at its first tilezero on
# this project's Sapphire Rapids VMs, whose kernels do grant the tile state.
# There every other extension the CPU has is named instead (the same
# instructions as -march=native, AMX left out); MOH_LLAMA_CPP_AMX=1 keeps
# the native build. MOH_LLAMA_CPP_ISA=avx2 builds what an AVX2-only CPU
# (e.g. AMD Zen 3: AVX2, FMA, F16C, no AVX-512, no AVX-VNNI) would get
# natively, to time against moh-serve under MOH_CPU_ISA=avx2 on an AVX-512
# machine; give it its own MOH_LLAMA_CPP_PREFIX.
isa_cap="${MOH_LLAMA_CPP_ISA:-native}"
case "$isa_cap" in
  native | avx2) ;;
  *) echo "install_llama_cpp: MOH_LLAMA_CPP_ISA must be native or avx2, not '$isa_cap'" >&2
    exit 2 ;;
esac
arch=(-DGGML_NATIVE=ON)
if [ "$isa_cap" = avx2 ] ||
  { grep -q amx_tile <<<"$cpu_flags" && [ "${MOH_LLAMA_CPP_AMX:-0}" != 1 ]; }; then
  has() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qx "$1"; }
  arch=(-DGGML_NATIVE=OFF)
  for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C \
    avx_vnni:AVX_VNNI avx512f:AVX512 avx512vbmi:AVX512_VBMI \
    avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    flag="${pair%%:*}"
    if has "$flag" && { [ "$isa_cap" = native ] ||
      [[ "$flag" != avx512* && "$flag" != avx_vnni ]]; }; then
      arch+=("-DGGML_${pair#*:}=ON")
    else arch+=("-DGGML_${pair#*:}=OFF"); fi
  done
  arch+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  if [ "$isa_cap" = avx2 ]; then stamp="$stamp avx2-only"; else
    stamp="$stamp no-amx"; fi
fi
if [ -x "$MOH_LLAMA_CPP_PREFIX/bin/llama-batched-bench" ] &&
  [ "$(cat "$MOH_LLAMA_CPP_PREFIX/VERSION" 2>/dev/null)" = "$stamp" ]; then
  echo "install_llama_cpp: llama.cpp (llama-cpp-python $MOH_LLAMA_CPP_SDIST_VERSION's) present in $MOH_LLAMA_CPP_PREFIX"
  exit 0
fi
echo "install_llama_cpp: building llama.cpp's tools (llama-cpp-python" \
  "$MOH_LLAMA_CPP_SDIST_VERSION's tree, ${arch[*]}) into $MOH_LLAMA_CPP_PREFIX"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
sdist="${MOH_LLAMA_CPP_SDIST:-$work/llama_cpp_python.tar.gz}"
fetch_verified "$sdist" "$MOH_LLAMA_CPP_SDIST_URL" "$MOH_LLAMA_CPP_SDIST_SHA256"
top="llama_cpp_python-$MOH_LLAMA_CPP_SDIST_VERSION"
tar -xzf "$sdist" -C "$work" "$top/vendor/llama.cpp"
src="$work/$top/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "${arch[@]}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_CURL=OFF -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
  -DCMAKE_INSTALL_RPATH='$ORIGIN/../lib' >/dev/null
cmake --build "$work/build" -j "$(nproc)" \
  --target llama-batched-bench llama-bench llama-quantize
rm -rf "$MOH_LLAMA_CPP_PREFIX"
mkdir -p "$MOH_LLAMA_CPP_PREFIX/bin" "$MOH_LLAMA_CPP_PREFIX/lib"
# The binaries and their libraries find one another through $ORIGIN.
cp "$work/build/bin/llama-batched-bench" "$work/build/bin/llama-bench" \
  "$work/build/bin/llama-quantize" "$MOH_LLAMA_CPP_PREFIX/bin/"
cp -P "$work/build/bin/"*.so* "$MOH_LLAMA_CPP_PREFIX/lib/"
cp -r "$src/gguf-py" "$MOH_LLAMA_CPP_PREFIX/gguf-py"
cp "$src/LICENSE" "$MOH_LLAMA_CPP_PREFIX/LICENSE"
echo "$stamp" >"$MOH_LLAMA_CPP_PREFIX/VERSION"
echo "install_llama_cpp: installed $MOH_LLAMA_CPP_PREFIX"
