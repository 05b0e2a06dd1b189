#!/usr/bin/env bash
# Configures and builds moh-serve into ./build (ccache + precompiled headers make
# rebuilds after a one-file change take seconds). Extra arguments go to the
# build tool, e.g. `scripts/build.sh moh-generate` to build one target.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
if [ $# -gt 0 ]; then
  cmake --build build --target "$@"
else
  cmake --build build
fi
