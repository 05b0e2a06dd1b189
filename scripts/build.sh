#!/usr/bin/env bash
# Configures and builds moh-serve into ./build (ccache + precompiled headers make
# rebuilds after a one-file change take seconds). Extra arguments go to the
# build tool, e.g. `scripts/build.sh moh-generate` to build one target.
set -euo pipefail
cd "$(dirname "$0")/.."
# Let clones in other directories share ccache entries; the sloppiness settings
# are what ccache needs to cache translation units that use precompiled headers.
export CCACHE_BASEDIR="$PWD"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
if [ $# -gt 0 ]; then
  cmake --build build --target "$@"
else
  cmake --build build
fi
