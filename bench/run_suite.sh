#!/usr/bin/env bash
# The benchmark suite in one command: builds what it needs, runs every
# benchmark, and writes bench/RESULTS.md, with its numbers (results.json) and
# their plots (plots/*.png) beside it. Extra arguments go to bench/suite.py
# (e.g. --quick for a smoke run, --lm_dir/--vit_dir for other models).
# Section 5 (the llama.cpp peer) and the plots (matplotlib) need the bench
# virtual environment: it is installed here (`scripts/install_deps.sh
# --bench`, once: it builds llama.cpp from source) when section 5 runs; if that
# fails, the section says so and is skipped, and without matplotlib the plots
# are. With the torch wheel installed, section 5 also compares the two
# LibTorch builds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
peer=1
for arg in "$@"; do
  case "$arg" in
    --sections=*) [[ ",${arg#--sections=}," == *,5,* ]] || peer=0 ;;
  esac
done
if [ "$peer" = 1 ]; then
  bash scripts/install_deps.sh --bench ||
    echo "run_suite: the bench environment did not install; section 5 is skipped" >&2
fi
bash scripts/build.sh moh-server moh-client moh-bench moh-generate moh-classify \
  moh-generate-image moh_attention_bench moh_demo_models moh_read_bandwidth
# Section 5 also measures a build against the PyPI torch wheel's LibTorch
# when that wheel is installed (scripts/install_deps.sh --torch=wheel).
# shellcheck source=../scripts/torch_wheel.env
. scripts/torch_wheel.env
if [ "$peer" = 1 ] && [ -x "$MOH_TORCH_VENV/bin/python" ]; then
  bash scripts/build.sh --torch=wheel moh-generate ||
    echo "run_suite: the wheel build failed; section 5 measures Debian's LibTorch only" >&2
fi
PYTHON=/usr/bin/python3
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" bench/suite.py "$@"
