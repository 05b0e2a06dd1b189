#!/usr/bin/env bash
# Generates the Python modules of the moh.v1 API from proto/ into OUT_DIR, with
# the system protoc (the protoc bundled with Debian's old python3-grpc-tools
# cannot read proto3 `optional` fields):
#   OUT_DIR/moh/v1/inference_pb2.py       messages (needed by moh_client.py)
#   OUT_DIR/moh/v1/inference_pb2_grpc.py  service stubs, when grpc_python_plugin
#                                         (protobuf-compiler-grpc) is installed;
#                                         moh_client.py does not need them.
# Use: gen_stubs.sh OUT_DIR, then put OUT_DIR on PYTHONPATH. Keep OUT_DIR out
# of git (e.g. build/python).
set -euo pipefail
out=${1:?usage: gen_stubs.sh OUT_DIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
protoc=${PROTOC:-$(command -v protoc)}
mkdir -p "$out"
args=(--proto_path="$root/proto" --python_out="$out")
if plugin=$(command -v grpc_python_plugin); then
  args+=(--grpc_python_out="$out" --plugin=protoc-gen-grpc_python="$plugin")
fi
"$protoc" "${args[@]}" "$root/proto/moh/v1/inference.proto"
