#!/usr/bin/env bash
# The run command: installs what is missing, builds, and generates text with a
# MoH language model in process. Until the gRPC server and the trained demo
# models land, the model is the tiny random-weight fixture that the test suite
# generates (its text is meaningless; the routing and ratios are real).
# Arguments are passed to moh-generate, e.g. --prompt="Hello" --ratio=0.5 --routing
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh moh-generate
PYTHON=/usr/bin/python3
[ -x "$PYTHON" ] || PYTHON=python3
"$PYTHON" tests/reference/make_fixtures.py build/fixtures >/dev/null
exec build/model/moh-generate --model_dir=build/fixtures/llama_learned "$@"
