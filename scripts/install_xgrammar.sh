#!/usr/bin/env bash
# Builds xgrammar's C++ core (a static library, no Python bindings, no tests,
# no cpptrace) from its pinned PyPI source distribution (xgrammar.env,
# sha256-checked) and installs the library and its headers into
# $MOH_XGRAMMAR_PREFIX. Skipped when that prefix already holds this version.
# Called by install_deps.sh (default install) and scripts/gpu_check.sh (from
# the sdist the GPU bundle carries: MOH_XGRAMMAR_SDIST names a local copy,
# so no download). No sanitizer flags: the ASan and TSan builds link the same
# uninstrumented library (see tests/sanitizers/).
# About 2.5 minutes on the 2-core CI machine (measured: 2m22s wall, 2m37s
# CPU, 29 sources at -O3), 6.5 MB installed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=xgrammar.env
. "$here/xgrammar.env"
# shellcheck source=fetch_verified.sh
. "$here/fetch_verified.sh"

if [ -f "$MOH_XGRAMMAR_PREFIX/include/xgrammar/matcher.h" ] &&
  [ "$(cat "$MOH_XGRAMMAR_PREFIX/VERSION" 2>/dev/null)" = "$MOH_XGRAMMAR_VERSION" ]; then
  echo "install_xgrammar: xgrammar $MOH_XGRAMMAR_VERSION present in $MOH_XGRAMMAR_PREFIX"
  exit 0
fi
echo "install_xgrammar: building xgrammar $MOH_XGRAMMAR_VERSION into $MOH_XGRAMMAR_PREFIX"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
sdist="${MOH_XGRAMMAR_SDIST:-$work/xgrammar.tar.gz}"
fetch_verified "$sdist" "$MOH_XGRAMMAR_URL" "$MOH_XGRAMMAR_SHA256"
tar -xzf "$sdist" -C "$work"
src="$work/xgrammar-$MOH_XGRAMMAR_VERSION"
# Its CMakeLists adds -Werror and -flto=auto before CMAKE_CXX_FLAGS: a newer
# compiler's warning must not fail the install, and a library of GCC LTO
# objects would not link into the clang builds (fuzz), so both are undone.
# Its options come from a config.cmake (the sdist's own, cmake/config.cmake,
# turns the Python bindings on); one in the build directory is read first.
mkdir -p "$work/build"
cat >"$work/build/config.cmake" <<'CONFIG'
set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)
set(XGRAMMAR_BUILD_CXX_TESTS OFF)
set(XGRAMMAR_ENABLE_CPPTRACE OFF)
set(XGRAMMAR_ENABLE_COVERAGE OFF)
set(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)
CONFIG
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS="-Wno-error -fno-lto" \
  -DCMAKE_INSTALL_PREFIX="$MOH_XGRAMMAR_PREFIX" -DCMAKE_INSTALL_LIBDIR=lib >/dev/null
cmake --build "$work/build" -j "$(nproc)"
rm -rf "$MOH_XGRAMMAR_PREFIX"
cmake --install "$work/build" >/dev/null
cp "$src/LICENSE" "$MOH_XGRAMMAR_PREFIX/LICENSE"
echo "$MOH_XGRAMMAR_VERSION" >"$MOH_XGRAMMAR_PREFIX/VERSION"
echo "install_xgrammar: installed $MOH_XGRAMMAR_PREFIX"
