#!/usr/bin/env bash
# The device check: on a machine with a CUDA GPU, runs the GPU suite
# (`ctest -L gpu`: gpu_model_test in process, gpu_server_test through the real
# moh-server), the decode products' benchmark (moh_cuda_linear_bench: its
# table in linear_bench.md) and the GPU benchmark (bench/gpu_bench.py), and
# leaves a log, the test report and the benchmarks' results under $OUT.
#
#   scripts/gpu_check.sh [--bundle DIR] [--layouts 1b,8b | --no_bench |
#                         --profile 8b] [--no_tests] [--soak SECONDS]
#
# Two ways to get the binaries:
#   --bundle DIR  binaries packed by scripts/gpu_bundle.sh on a build machine
#                 (default .gpu-bundle when it exists): for GPU machines with
#                 python3's torch at the version pinned in torch_wheel.env but
#                 without Debian's development packages, such as the device
#                 machines lent to this project's sessions. Run there as
#                 root: the test binaries name the directory the bundle was
#                 built in, which is linked to this checkout when they differ.
#   (no bundle)   builds build-cuda here (scripts/build.sh --torch=wheel), on
#                 a Debian 12 machine with the CUDA toolkit.
# $OUT defaults to gpu-check-out/ in the checkout. The whole check stops
# within $MOH_GPU_CHECK_SECONDS (default 480: a lease's command may run 10
# minutes); the benchmark keeps what it measured before an overrun. $MOH_GPU_PYTHON is the
# Python with torch (default python3). Exit status: 0 when every GPU test
# passed (none skipped) and the benchmark ran every step.
# --profile LAYOUTS runs, in place of the benchmark, moh-generate
# --profile_dir on each layout (batch 1 with a 4k prompt and 64 sequences of
# 2k, ratios 1.0 and 0.5, after a warm-up that records the CUDA graphs) and
# leaves bench/trace_summary.py's tables of each prefill and decode
# (profile.md) and the traces, gzipped, in traces.tar under $OUT.
# --no_tests leaves out `ctest -L gpu` (run by an earlier command of the same
# lease). --soak SECONDS runs bench/soak.py that long with the demo models on
# CUDA in bfloat16 (every door, 8 clients; answers checked for their form):
# soak.md under $OUT.
# Should the benchmark's default path fail, it finds which of this project's
# CUDA paths to switch off and measures the rest so (bench/cuda_paths.py);
# $MOH_CUDA_PATHS_OFF=a,b switches paths off from the start, for the
# benchmark and the soak alike (a later command of the same lease, after
# the first found one failing).
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
bundle=""
[ -d .gpu-bundle ] && bundle=.gpu-bundle
layouts=1b,8b
profile=""
no_tests=""
soak=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle="$2"; shift 2 ;;
    --layouts) layouts="$2"; shift 2 ;;
    --no_bench) layouts=""; shift ;;
    --profile) profile="$2"; layouts=""; shift 2 ;;
    --no_tests) no_tests=1; shift ;;
    --soak) soak="$2"; shift 2 ;;
    *) echo "usage: $0 [--bundle DIR] [--layouts 1b,8b | --no_bench |" \
         "--profile 8b] [--no_tests] [--soak SECONDS]" >&2
       exit 2 ;;
  esac
done
out="${OUT:-$root/gpu-check-out}"
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
python="$(command -v "${MOH_GPU_PYTHON:-python3}")"
status=0
step() { echo; echo "=== gpu_check $(date +%T): $*"; }
fail() { echo "gpu_check: FAILED: $*"; status=1; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
  --format=csv || fail "nvidia-smi"
"$python" -c 'import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__,
      "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'

build="$root/build-cuda"
ctest_args=()
if [ -n "$bundle" ]; then
  step "bundle $bundle"
  packed="$(cd "$bundle" && pwd)/bundle.tar.xz"
  bundle="${TMPDIR:-/tmp}/moh-gpu-bundle"
  rm -rf "$bundle" && mkdir -p "$bundle" && tar -C "$bundle" -xJf "$packed" ||
    { echo "gpu_check: cannot unpack $packed" >&2; exit 1; }
  source_dir="$(cat "$bundle/source_dir")"
  if [ "$source_dir" != "$root" ]; then
    if [ -e "$source_dir" ] && ! [ "$source_dir" -ef "$root" ]; then
      echo "gpu_check: $source_dir exists and is not this checkout; the" \
        "bundle's test binaries name it" >&2
      exit 1
    fi
    mkdir -p "$(dirname "$source_dir")"
    [ -e "$source_dir" ] || ln -s "$root" "$source_dir"
  fi
  mkdir -p "$build"
  cp -r "$bundle/build-cuda/." "$build/"
  rm -rf "$build/fixtures" && cp -r "$bundle/fixtures" "$build/fixtures"
  ctest_args=(-FA moh_fixtures)  # the bundle's fixtures, not make_fixtures
  install -D "$bundle/bin/moh-server" "$build/service/moh-server"
  install -D "$bundle/bin/moh-client" "$build/client/moh-client"
  install -D "$bundle/bin/moh-bench" "$build/client/moh-bench"
  install -D "$bundle/bin/moh-generate" "$build/tools/moh-generate"
  install -D "$bundle/bin/gpu_model_test" "$build/tests/gpu_model_test"
  install -D "$bundle/bin/moh_cuda_linear_bench" \
    "$build/bench/moh_cuda_linear_bench"
  # The bundle's CTest files leave the Python to name.
  find "$build" -name CTestTestfile.cmake -exec \
    sed -i "s#@MOH_PYTHON3@#$python#g" {} +
  torch_lib="$("$python" -c 'import os, torch
print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
  cuda_libs="$("$python" -c 'import glob, os, torch
base = os.path.dirname(os.path.dirname(torch.__file__))
print(":".join(sorted(set(os.path.dirname(p) for p in
      glob.glob(base + "/nvidia/**/lib*.so*", recursive=True)))))')"
  export LD_LIBRARY_PATH="$bundle/lib:$torch_lib:$cuda_libs:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PATH="$bundle/bin:$PATH"
else
  step "build"
  bash scripts/install_deps.sh --torch=wheel && bash scripts/build.sh --torch=wheel ||
    { fail "build"; exit 1; }
fi
# Every binary's libraries resolve; with a bundle, each from the bundle,
# LibTorch's wheel or the C/C++ runtime (a rehearsal on a machine that has
# Debian's packages shows here what the bundle would lack).
unresolved=0
for f in service/moh-server client/moh-client client/moh-bench tools/moh-generate \
  tests/gpu_model_test bench/moh_cuda_linear_bench; do
  libs="$(ldd "$build/$f")"
  if grep -q "not found" <<<"$libs"; then
    echo "gpu_check: $f: $(grep 'not found' <<<"$libs" | tr -s ' \n\t' ' ')"
    unresolved=1
  fi
  if [ -n "$bundle" ]; then
    system="$(awk '$3 ~ /^\/(usr\/)?lib/ {print $1}' <<<"$libs" |
      grep -vE '^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux|libcuda)[.-]' || true)"
    [ -z "$system" ] || { echo "gpu_check: $f: from the system:" $system; unresolved=1; }
  fi
  grep -E "libtorch_cuda|libc10\.so" <<<"$libs" | sed "s#^#  $f: #"
done
"$build/service/moh-server" --version || unresolved=1
[ "$unresolved" = 0 ] || { fail "the binaries' libraries"; exit 1; }

if [ -z "$no_tests" ]; then
  step "ctest -L gpu"
  ctest --test-dir "$build" -L gpu "${ctest_args[@]}" --output-on-failure --timeout 300 \
    --output-junit "$out/ctest_gpu.xml" 2>&1 | tee "$out/ctest_gpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "ctest -L gpu"
  if grep -q "Not Run\|Skipped" "$out/ctest_gpu.log"; then
    fail "a GPU test was skipped: the device was not seen"
  fi
fi

if [ -n "$layouts" ]; then
  step "the decode step's narrow products: cuBLAS against the skinny kernel"
  timeout -k 5 60 "$build/bench/moh_cuda_linear_bench" 3 |
    tee "$out/linear_bench.md"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "moh_cuda_linear_bench"
fi

# Serving under mixed load on the device: row buckets of recorded graphs as
# requests come and go, cancellations, every sampler, the HTTP doors, images.
if [ -n "$soak" ]; then
  step "bench/soak.py on CUDA for ${soak}s"
  MOH_SERVER="$build/service/moh-server" timeout -k 10 $(( soak + 150 )) \
    "$python" bench/soak.py --device cuda --duration "$soak" --clients 8 \
    >"$out/soak.md" 2>&1 || fail "bench/soak.py on CUDA (exit $?)"
  cat "$out/soak.md"
fi

left=$(( ${MOH_GPU_CHECK_SECONDS:-480} - SECONDS - 15 ))
if [ -n "$layouts" ]; then
  step "bench/gpu_bench.py --layouts $layouts (at most ${left}s)"
  timeout -k 10 "$left" "$python" bench/gpu_bench.py --build "$build" \
    --work "${TMPDIR:-/tmp}/moh-gpu-bench" --out "$out" --layouts "$layouts" ||
    fail "bench/gpu_bench.py (exit $?)"
fi

# One traced moh-generate run: NAME, the decode steps it traces, then its
# flags; each ratio's prefill and decode traces summarised into profile.md
# and gzipped into the traces folder (packed as traces.tar: $OUT returns at
# most 8 files).
profile_run() {
  local name="$1" steps="$2"; shift 2
  local dir="${TMPDIR:-/tmp}/moh-gpu-profile/$name"
  rm -rf "$dir" && mkdir -p "$dir"
  local budget=$(( left - SECONDS + start ))
  [ "$budget" -gt 0 ] || { fail "profile $name: out of time"; return; }
  timeout -k 10 "$budget" "$build/tools/moh-generate" \
    --device=cuda --dtype=bfloat16 --temperature=0 --warmup=1 --ratios=1,0.5 \
    --profile_dir="$dir" "$@" 2>&1 | grep -E "ratio=|replays|Error|error" ||
    fail "profile $name"
  for trace in "$dir"/prefill-ratio-*.json "$dir"/decode-ratio-*.json; do
    [ -f "$trace" ] || continue
    local phase; phase="$(basename "$trace" .json)"
    local args=(--steps "$steps")
    [[ "$phase" == prefill-* ]] && args=(--steps 1 --label prefill)
    { echo; echo "### $name, $phase"; echo
      "$python" bench/trace_summary.py "$trace" "${args[@]}" --top 30
    } >>"$out/profile.md" || fail "trace_summary $trace"
    gzip -c "$trace" >"$traces/$name-$phase.json.gz"
  done
}
if [ -n "$profile" ]; then
  start=$SECONDS
  traces="${TMPDIR:-/tmp}/moh-gpu-traces"
  rm -rf "$traces" && mkdir -p "$traces"
  : >"$out/profile.md"
  for layout in ${profile//,/ }; do
    step "profile $layout (at most $(( left - SECONDS + start ))s)"
    model="${TMPDIR:-/tmp}/moh-gpu-bench/llama3-$layout"
    "$python" bench/make_bench_lm.py --layout="llama3-$layout" --out="$model" \
      >/dev/null || { fail "make_bench_lm $layout"; continue; }
    profile_run "$layout-b1" 23 --model_dir="$model" --batch=1 \
      --prompt_tokens=4096 --max_new_tokens=24
    profile_run "$layout-b64" 7 --model_dir="$model" --batch=64 \
      --prompt_tokens=2048 --max_new_tokens=8
  done
  tar -cf "$out/traces.tar" -C "$traces" . || fail "packing the traces"
  cat "$out/profile.md"
fi

step "summary"
[ -f "$out/ctest_gpu.log" ] &&
  grep -E "tests passed|tests failed|\(Failed\)|\(Skipped\)|Passed|\*\*\*" \
    "$out/ctest_gpu.log" | sed 's/^/  /'
[ -f "$out/soak.md" ] &&
  grep -E "^## Soak|^\| .* \| (ok|FAILED) \|" "$out/soak.md"
[ -f "$out/linear_bench.md" ] && cat "$out/linear_bench.md"
if [ -f "$out/gpu_bench.md" ]; then
  cat "$out/gpu_bench.md"
elif [ -f "$out/gpu_bench.json" ]; then  # cut short: what it measured
  "$python" bench/gpu_bench.py --table "$out/gpu_bench.json"
fi
echo "gpu_check: $([ "$status" = 0 ] && echo OK || echo FAILED) (log and results in $out)"
exit "$status"
