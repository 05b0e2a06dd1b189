#!/usr/bin/env bash
# The CUDA build is what it claims (run by CTest in CUDA builds only):
# moh-server links libtorch_cuda, every shared library it needs resolves, and
# it starts and reports its CUDA LibTorch (--version loads every library).
set -euo pipefail
server="$1"
fail() { echo "cuda_build_test: $*" >&2; exit 1; }
# Read whole before matching: `readelf | grep -q` under pipefail fails when
# grep exits at the match while readelf still writes (SIGPIPE).
dynamic="$(readelf -d "$server")"
grep -q 'NEEDED.*\[libtorch_cuda\.so\]' <<<"$dynamic" ||
  fail "$server does not link libtorch_cuda.so"
missing="$(ldd "$server" | grep 'not found' || true)"
[ -z "$missing" ] || fail "unresolved libraries: $missing"
version="$("$server" --version)"
echo "$version"
grep -q '^LibTorch 2\.[0-9.]* (CUDA [0-9.]* build, [0-9]* GPUs\? visible)$' \
  <<<"$version" || fail "--version does not report a CUDA LibTorch 2.x"
echo "cuda_build_test: OK"
