#!/usr/bin/env bash
# The run command: installs what is missing, builds, and runs moh-server on the
# demo models (gRPC on :50051, Prometheus metrics on :9464). Until the trained
# demo models land, the demo models are the tiny random-weight MoH-LLaMA and
# MoH-ViT that the test suite generates (their outputs are meaningless; routing,
# ratios, batching and streaming are real). Arguments go to moh-server, e.g.
#   bash scripts/run.sh --port=50051 --metrics_port=9464
# Then, in another terminal: build/client/moh-client generate "Once upon a time"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh moh-server moh-client moh-generate moh_demo_models
exec build/service/moh-server "$@"
