#!/usr/bin/env bash
# The benchmark suite in one command: builds what it needs, runs every
# benchmark, and writes bench/RESULTS.md. Extra arguments go to bench/suite.py
# (e.g. --quick for a smoke run, --lm_dir/--vit_dir for other models).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh moh-server moh-client moh-bench moh-generate \
  moh_attention_bench moh_demo_models
PYTHON=/usr/bin/python3
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" bench/suite.py "$@"
