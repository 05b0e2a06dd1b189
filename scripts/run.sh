#!/usr/bin/env bash
# The run command: installs what is missing, builds, and runs moh-server on the
# demo models shipped in models/ (gRPC on :50051, the OpenAI-compatible HTTP
# API on :8000, Prometheus metrics on :9464):
# demo-lm, a small MoH language model trained on the King James Bible,
# demo-vit, a MoH-ViT digit classifier, and demo-dit, a MoH-DiT digit generator
# (recipe: training/README.md). Arguments go to moh-server, e.g.
#   bash scripts/run.sh --port=50051 --metrics_port=9464
# Then, in another terminal:
#   build/client/moh-client generate "Once upon a time"
#   build/client/moh-client classify models/demo-vit/samples/digit-3.png
#   build/client/moh-client generate-image --class=3 --out=three.png
#   curl -s localhost:8000/v1/completions -d '{"prompt": "In the beginning"}'
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh moh-server moh-client moh-generate
exec build/service/moh-server "$@"
