#!/usr/bin/env bash
# Installs every Debian 12 package moh-serve needs to build, test and run.
# Idempotent: packages already present are skipped; apt is touched only when
# something is missing. Must run as root (or with sudo available).
#   --runtime            only the shared libraries moh-server/moh-client need
#                        (the container image's runtime stage)
#   --runtime-no-torch   the same without Debian's LibTorch (CUDA images bring
#                        their own)
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libopenblas0-openmp
  libabsl-dev nlohmann-json3-dev libpcre2-dev libstb-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-torch python3-numpy
  python3-grpcio python3-protobuf python3-pytest python3-yaml
  prometheus curl zlib1g-dev
)
RUNTIME_PACKAGES=(
  libopenblas0-openmp libabsl20220623 libgrpc++1.51 libgrpc29 libprotobuf32
  libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libpcre2-8-0 libstb0
)
case "${1:-}" in
  --runtime) PACKAGES=("${RUNTIME_PACKAGES[@]}" libtorch1.13) ;;
  --runtime-no-torch) PACKAGES=("${RUNTIME_PACKAGES[@]}") ;;
  "") ;;
  *) echo "usage: $0 [--runtime | --runtime-no-torch]" >&2; exit 2 ;;
esac

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
