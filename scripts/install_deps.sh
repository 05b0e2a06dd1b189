#!/usr/bin/env bash
# Installs every Debian 12 package moh-serve needs to build, test and run.
# Idempotent: packages already present are skipped; apt is touched only when
# something is missing. Must run as root (or with sudo available).
#   (no option)          the default build: Debian's LibTorch 1.13 (CPU),
#                        and xgrammar's C++ core built from its pinned sdist
#                        (install_xgrammar.sh, xgrammar.env) for every build
#   --torch=wheel        also the second build's LibTorch: the PyPI torch wheel
#                        (2.x with CUDA, version pinned in torch_wheel.env) in
#                        the virtual environment $MOH_TORCH_VENV, with the GPU
#                        benchmark's transformers peer (peer_requirements.txt)
#   --bench              also the benchmark suite's peer engine: llama.cpp
#                        (llama-cpp-python, built from source for this CPU)
#                        and gguf, and matplotlib for its plots, pinned in
#                        bench_venv.env, in the virtual environment
#                        $MOH_BENCH_VENV (bench/run_suite.sh only); and
#                        llama.cpp's own benchmark tools built natively
#                        (install_llama_cpp.sh, llama_cpp.env) for
#                        bench/native_peer.py
#   --test               also the test suite's PyPI packages: the official
#                        openai and anthropic clients, and lm-eval, pinned in
#                        test_requirements.txt and eval_requirements.txt, in
#                        the virtual environments of test_venv.env
#                        (scripts/test.sh)
#   --runtime            only the shared libraries moh-server/moh-client need
#                        (the container image's runtime stage)
#   --runtime-no-torch   the same without Debian's LibTorch (CUDA images bring
#                        the wheel's)
# Sourced (`. scripts/install_deps.sh`), it installs nothing and only defines
# install_missing, for scripts that need packages of their own
# (scripts/build_images.sh, training/train_all.sh).
set -euo pipefail

# install_missing WHO PACKAGE...: installs with apt (through sudo when not
# root) those of the PACKAGEs that are not installed yet, saying so as
# "WHO: ..."; apt is touched only when something is missing.
install_missing() {
  local who="$1" p
  shift
  local missing=()
  for p in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if [ ${#missing[@]} -eq 0 ]; then
    echo "$who: all $# packages present"
    return 0
  fi
  echo "$who: installing ${missing[*]}"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# requirements_venv DIR FILE [VENV-OPTION]: a virtual environment in DIR
# holding FILE's pinned packages; skipped when DIR already has exactly them
# (a copy of FILE is kept there).
requirements_venv() {
  local dir="$1" file="$2"
  shift 2
  if [ -x "$dir/bin/python" ] && cmp -s "$file" "$dir/requirements.txt"; then
    echo "install_deps: $(basename "$file") present in $dir"
    return 0
  fi
  echo "install_deps: installing $(basename "$file") into $dir"
  rm -rf "$dir"
  /usr/bin/python3 -m venv "$@" "$dir"
  "$dir/bin/pip" install -q --disable-pip-version-check -r "$file"
  cp "$file" "$dir/requirements.txt"
}

main() {
  local here
  here="$(cd "$(dirname "$0")" && pwd)"

  PACKAGES=(
    build-essential cmake ninja-build ccache pkg-config git
    libtorch-dev libopenblas0-openmp
    libabsl-dev nlohmann-json3-dev libpcre2-dev libpng-dev libjpeg62-turbo-dev
    libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
    prometheus-cpp-dev libmicrohttpd-dev libgnutls28-dev libcurl4-openssl-dev
    libgtest-dev libgmock-dev libbenchmark-dev
    python3 python3-torch python3-numpy python3-pil
    python3-grpcio python3-protobuf python3-pytest python3-pytest-xdist
    python3-yaml python3-jinja2
    python3-jsonschema python3-hypothesis
    prometheus curl zlib1g-dev openssl
    clang libclang-rt-14-dev
  )
  RUNTIME_PACKAGES=(
    libopenblas0-openmp libabsl20220623 libgrpc++1.51 libgrpc29 libprotobuf32
    libprometheus-cpp-core1.0 libmicrohttpd12 libgnutls30 libpcre2-8-0
    libpng16-16 libjpeg62-turbo libcurl4
  )
  torch_wheel=0
  bench=0
  test_venv=0
  case "${1:-}" in
    --torch=wheel) torch_wheel=1; PACKAGES+=(python3-venv) ;;
    --torch=debian | "") ;;
    --bench) bench=1; PACKAGES+=(python3-venv) ;;
    --test) test_venv=1; PACKAGES+=(python3-venv) ;;
    --runtime) PACKAGES=("${RUNTIME_PACKAGES[@]}" libtorch1.13) ;;
    --runtime-no-torch) PACKAGES=("${RUNTIME_PACKAGES[@]}") ;;
    *)
      echo "usage: $0 [--torch=debian | --torch=wheel | --bench | --test | --runtime | --runtime-no-torch]" >&2
      exit 2
      ;;
  esac

  install_missing install_deps "${PACKAGES[@]}"

  # xgrammar's C++ core (response_format), which Debian does not package:
  # built from its pinned sdist into /opt/moh-serve (xgrammar.env). Every
  # build needs it; the runtime images do not (it links statically).
  case "${1:-}" in
    --runtime | --runtime-no-torch) ;;
    *) bash "$here/install_xgrammar.sh" ;;
  esac

  if [ "$torch_wheel" = 1 ]; then
    # shellcheck source=torch_wheel.env
    . "$here/torch_wheel.env"
    py="$MOH_TORCH_VENV/bin/python"
    # (torch.__version__ carries the wheel's local label: 2.11.0+cu130.)
    if [ -x "$py" ] && [ "$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" = \
        "$MOH_TORCH_WHEEL_VERSION" ]; then
      echo "install_deps: torch $MOH_TORCH_WHEEL_VERSION present in $MOH_TORCH_VENV"
    else
      echo "install_deps: installing torch==$MOH_TORCH_WHEEL_VERSION (PyPI, CUDA) into $MOH_TORCH_VENV"
      /usr/bin/python3 -m venv "$MOH_TORCH_VENV"
      "$MOH_TORCH_VENV/bin/pip" install -q --disable-pip-version-check \
        "torch==$MOH_TORCH_WHEEL_VERSION"
    fi
    # The GPU benchmark's transformers peer, beside the torch it runs on.
    if cmp -s "$here/peer_requirements.txt" "$MOH_TORCH_VENV/peer_requirements.txt"; then
      echo "install_deps: peer_requirements.txt present in $MOH_TORCH_VENV"
    else
      echo "install_deps: installing peer_requirements.txt into $MOH_TORCH_VENV"
      "$MOH_TORCH_VENV/bin/pip" install -q --disable-pip-version-check \
        -r "$here/peer_requirements.txt"
      cp "$here/peer_requirements.txt" "$MOH_TORCH_VENV/peer_requirements.txt"
    fi
  fi

  if [ "$test_venv" = 1 ]; then
    # shellcheck source=test_venv.env
    . "$here/test_venv.env"
    requirements_venv "$MOH_TEST_VENV" "$here/test_requirements.txt" --system-site-packages
    requirements_venv "$MOH_EVAL_VENV" "$here/eval_requirements.txt"
  fi

  if [ "$bench" = 1 ]; then
    # shellcheck source=bench_venv.env
    . "$here/bench_venv.env"
    py="$MOH_BENCH_VENV/bin/python"
    want="$MOH_LLAMA_CPP_PYTHON_VERSION $MOH_GGUF_VERSION"
    if [ -x "$py" ] && [ "$("$py" -c 'import importlib.metadata as m
print(m.version("llama_cpp_python"), m.version("gguf"))' 2>/dev/null)" = "$want" ]; then
      echo "install_deps: llama-cpp-python $MOH_LLAMA_CPP_PYTHON_VERSION and gguf" \
        "$MOH_GGUF_VERSION present in $MOH_BENCH_VENV"
    else
      # llama-cpp-python has no CPU wheel on PyPI: pip builds llama.cpp from
      # its sources with this machine's compiler (CPU backend, llama.cpp's
      # default GGML_NATIVE flags, so the build fits this CPU only): about 8
      # minutes on the 2-core CI machine, most of it llama.cpp's multimodal
      # library that the bindings bring along.
      echo "install_deps: installing llama-cpp-python==$MOH_LLAMA_CPP_PYTHON_VERSION" \
        "(built from source) and gguf==$MOH_GGUF_VERSION into $MOH_BENCH_VENV"
      /usr/bin/python3 -m venv "$MOH_BENCH_VENV"
      CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        "$MOH_BENCH_VENV/bin/pip" install -q --disable-pip-version-check \
        "llama-cpp-python==$MOH_LLAMA_CPP_PYTHON_VERSION" \
        "gguf==$MOH_GGUF_VERSION" "numpy==$MOH_BENCH_NUMPY_VERSION"
    fi
    bash "$here/install_llama_cpp.sh"
    # Apart, so that adding it to an existing environment builds nothing.
    if [ "$("$py" -c 'import importlib.metadata as m
print(m.version("matplotlib"))' 2>/dev/null)" = "$MOH_MATPLOTLIB_VERSION" ]; then
      echo "install_deps: matplotlib $MOH_MATPLOTLIB_VERSION present in $MOH_BENCH_VENV"
    else
      echo "install_deps: installing matplotlib==$MOH_MATPLOTLIB_VERSION into $MOH_BENCH_VENV"
      "$MOH_BENCH_VENV/bin/pip" install -q --disable-pip-version-check \
        "matplotlib==$MOH_MATPLOTLIB_VERSION" "numpy==$MOH_BENCH_NUMPY_VERSION"
    fi
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
