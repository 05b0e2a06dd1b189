#!/usr/bin/env bash
# The CPU container image works: builds localhost/moh-serve:cpu with
# `scripts/build_images.sh --cpu` (buildah, no daemon), runs the image's own
# command (ENTRYPOINT + CMD: moh-server on the demo models, as the image's
# non-root user) in a buildah working container on the host's network, and
# calls it with the image's moh-client:
#   - the image's HEALTHCHECK command reports SERVING (within 120 s),
#   - `models` lists demo-lm, demo-vit and demo-dit, READY,
#   - `generate` streams some text and reports 8 completion tokens,
#   - `classify` of the held-out digit-0 sample answers class 0,
#   - `generate-image --class=3` writes a PNG that `classify` reads as 3,
#   - the Prometheus endpoint serves moh_requests_total,
#   - the OpenAI-compatible API answers POST /v1/completions,
#   - SIGTERM drains the server and it exits 0.
# The working container is removed whatever happens. Must run as root.
#   tests/image_test.sh [cpu|cuda]
# scripts/test.sh runs it for cpu (MOH_TEST_IMAGE). `cuda` checks the CUDA
# image the same way (on the CPU when there is no GPU; not run by CI).
# MOH_IMAGE_TEST_BUILD=0 tests the image already built instead of
# (re)building it.
set -euo pipefail
cd "$(dirname "$0")/.."

variant="${1:-cpu}"
case "$variant" in
  cpu | cuda) ;;
  *) echo "usage: $0 [cpu|cuda]" >&2; exit 2 ;;
esac
IMAGE="localhost/moh-serve:$variant"
ISOLATION=chroot
HEALTH_TIMEOUT=120  # seconds for every model to load and warm up
DRAIN_TIMEOUT=45    # seconds for SIGTERM to end the server (it drains up to 30)

t_start=$SECONDS
say() { echo "image_test: $*"; }
fail() { echo "image_test: FAIL: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || fail "must run as root (buildah --isolation chroot)"

if [ "${MOH_IMAGE_TEST_BUILD:-1}" = 1 ]; then
  bash scripts/build_images.sh --"$variant"
fi
t_built=$SECONDS
buildah inspect --type image "$IMAGE" >/dev/null 2>&1 || fail "no image $IMAGE"

work="$(mktemp -d /tmp/moh-image-test.XXXXXX)"
ctr=""
runner_pid=""  # `buildah run` serving moh-server (a child of this shell)

# The moh-server process under `buildah run` (buildah-chroot-runtime and
# buildah-chroot-exec sit between them): buildah run does not pass SIGTERM
# on (it kills its child), so the server is signalled directly.
server_pid() {
  ps -e -o pid=,ppid=,comm= | awk -v root="$runner_pid" '
    { parent[$1] = $2; name[$1] = $3 }
    END {
      for (p in name) {
        if (name[p] != "moh-server") continue
        q = p
        while (q in parent && q != root && q > 1) q = parent[q]
        if (q == root) { print p; exit }
      }
    }'
}

runner_alive() { [ -n "$runner_pid" ] && kill -0 "$runner_pid" 2>/dev/null; }

# Waits up to $1 seconds for the runner to exit; its exit status in $runner_rc.
wait_runner() {
  local deadline=$((SECONDS + $1))
  while runner_alive && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  if runner_alive; then return 1; fi
  runner_rc=0
  wait "$runner_pid" || runner_rc=$?
  runner_pid=""
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if runner_alive; then
    local pid
    pid="$(server_pid)"
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; fi
    if ! wait_runner 10; then
      pid="$(server_pid)"
      if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
      kill -KILL "$runner_pid" 2>/dev/null || true
      wait "$runner_pid" 2>/dev/null || true
    fi
  fi
  if [ "$rc" -ne 0 ] && [ -s "$work/server.log" ]; then
    echo "image_test: the server's log:" >&2
    sed 's/^/  | /' "$work/server.log" >&2
  fi
  if [ -n "$ctr" ]; then buildah rm "$ctr" >/dev/null 2>&1 || true; fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The image's configuration: command, health check, user.
config="$(buildah inspect --type image "$IMAGE")"
image_config() {  # image_config KEY: one line per element of config[KEY]
  python3 -c '
import json, sys
config = json.load(sys.stdin)["Docker"]["config"]
value = config.get(sys.argv[1]) or []
if isinstance(value, dict):
    value = value.get("Test", [])
if isinstance(value, str):
    value = [value]
print("\n".join(value))' "$1" <<<"$config"
}
mapfile -t command < <(image_config Entrypoint; image_config Cmd)
mapfile -t health < <(image_config Healthcheck)
user="$(image_config User)"
[ "${command[0]:-}" = /opt/moh/bin/moh-server ] ||
  fail "the image's command is not moh-server: ${command[*]}"
[ "${health[0]:-}" = CMD ] || fail "the image's HEALTHCHECK is not a CMD: ${health[*]}"
case "${user%%:*}" in "" | 0 | root) fail "the image runs as root" ;; esac

ctr="$(buildah from --pull=never --name "moh-image-test-$$" "$IMAGE")"
port="$(free_port)"
metrics_port="$(free_port)"
http_port="$(free_port)"
# Loopback only: the container shares the host's network.
command+=(--host=127.0.0.1 --port="$port" --metrics_port="$metrics_port"
  --http_port="$http_port")
say "serving from $IMAGE as user $user: ${command[*]}"
buildah run --isolation "$ISOLATION" --net=host "$ctr" -- "${command[@]}" \
  >"$work/server.log" 2>&1 &
runner_pid=$!

in_image() {  # runs a command in the working container, on the host's network
  buildah run --isolation "$ISOLATION" --net=host "$ctr" -- "$@"
}
client() { in_image /opt/moh/bin/moh-client --server="localhost:$port" "$@"; }

# 1. Health: the image's own HEALTHCHECK command, pointed at this port.
health_cmd=("${health[@]:1}")
health_cmd=("${health_cmd[@]/--server=localhost:50051/--server=localhost:$port}")
[[ " ${health_cmd[*]} " == *" --server=localhost:$port "* ]] ||
  fail "the HEALTHCHECK does not name --server=localhost:50051: ${health[*]}"
deadline=$((SECONDS + HEALTH_TIMEOUT))
until in_image "${health_cmd[@]}" >"$work/health.out" 2>&1; do
  runner_alive || fail "moh-server exited before it was healthy"
  [ $SECONDS -lt $deadline ] ||
    fail "not SERVING after ${HEALTH_TIMEOUT} s: $(cat "$work/health.out")"
  sleep 1
done
t_healthy=$SECONDS
say "health: $(cat "$work/health.out")"

# 2. models
client models >"$work/models.out" 2>&1 || fail "moh-client models: $(cat "$work/models.out")"
sed 's/^/  | /' "$work/models.out"
for name in demo-lm demo-vit demo-dit; do
  grep -Eq "^${name}[[:space:]].*READY" "$work/models.out" ||
    fail "moh-client models does not list $name READY"
done

# 3. generate: greedy, 8 tokens.
client generate "In the beginning" --max_new_tokens=8 \
  >"$work/generate.out" 2>"$work/generate.err" ||
  fail "moh-client generate: $(cat "$work/generate.out" "$work/generate.err")"
say "generate \"In the beginning\" -> \"$(cat "$work/generate.out")\""
sed 's/^/  | /' "$work/generate.err"
grep -q '[[:alpha:]]' "$work/generate.out" || fail "generate wrote no text"
grep -q 'completion_tokens 8' "$work/generate.err" ||
  fail "generate did not report 8 completion tokens"

# 4. classify: the held-out digit-0 sample, inside the image.
client classify /opt/moh/models/demo-vit/samples/digit-0.png \
  >"$work/classify.out" 2>"$work/classify.err" ||
  fail "moh-client classify: $(cat "$work/classify.out" "$work/classify.err")"
sed 's/^/  | /' "$work/classify.out" "$work/classify.err"
top="$(awk 'NR == 1 && $1 == "LABEL" { next } NF { print $1; exit }' "$work/classify.out")"
[ "$top" = 0 ] || fail "digit-0.png classified as '$top', not 0"

# 4b. generate-image: a 3 from demo-dit, read back by demo-vit.
client generate-image --class=3 --seed=7 --out=/tmp/three.png \
  >"$work/image.out" 2>"$work/image.err" ||
  fail "moh-client generate-image: $(cat "$work/image.out" "$work/image.err")"
sed 's/^/  | /' "$work/image.err"
client classify /tmp/three.png >"$work/classify3.out" 2>"$work/classify3.err" ||
  fail "moh-client classify three.png: $(cat "$work/classify3.out" "$work/classify3.err")"
top="$(awk 'NR == 1 && $1 == "LABEL" { next } NF { print $1; exit }' "$work/classify3.out")"
[ "$top" = 3 ] || fail "the generated 3 was classified as '$top'"

# 5. metrics (from the host: the server listens on the host's network)
if command -v curl >/dev/null; then
  curl -sf "http://localhost:$metrics_port/metrics" >"$work/metrics.out" ||
    fail "no /metrics on port $metrics_port"
  grep -q '^moh_requests_total{' "$work/metrics.out" ||
    fail "/metrics has no moh_requests_total"
  say "metrics: $(grep -c '^moh_' "$work/metrics.out") moh_ samples"
fi

# 5b. the OpenAI-compatible HTTP API (from the host)
if command -v curl >/dev/null; then
  curl -sf "http://localhost:$http_port/v1/completions" \
    -H 'Content-Type: application/json' \
    -d '{"prompt": "In the beginning", "max_tokens": 4, "temperature": 0}' \
    >"$work/completion.out" || fail "POST /v1/completions failed"
  grep -q '"object":"text_completion"' "$work/completion.out" ||
    fail "POST /v1/completions: $(cat "$work/completion.out")"
  say "http: $(cat "$work/completion.out")"
fi

# 6. SIGTERM: drains and exits 0.
pid="$(server_pid)"
[ -n "$pid" ] || fail "cannot find the moh-server process of buildah run $runner_pid"
kill -TERM "$pid"
wait_runner "$DRAIN_TIMEOUT" || fail "moh-server did not exit within ${DRAIN_TIMEOUT} s of SIGTERM"
[ "$runner_rc" = 0 ] || fail "moh-server exited with status $runner_rc after SIGTERM"
grep -q 'draining' "$work/server.log" || fail "moh-server did not log its drain"
t_end=$SECONDS

say "OK: build $((t_built - t_start)) s, healthy after $((t_healthy - t_built)) s," \
  "calls and drain $((t_end - t_healthy)) s, total $((t_end - t_start)) s"
