#!/usr/bin/env bash
# moh-client checks that need no server: bad usage prints the usage and exits
# 2; an RPC to an address where nothing listens fails with UNAVAILABLE and a
# non-zero exit status. Usage: client_cli_test.sh PATH/TO/moh-client
set -u
client=${1:?usage: client_cli_test.sh PATH/TO/moh-client}
dead=--server=127.0.0.1:1  # Privileged port: nothing listens there.
failures=0
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT

# expect STATUS STREAM PATTERN -- ARGS...: runs moh-client ARGS and checks its
# exit status and that STREAM (stdout|stderr) matches the grep -E PATTERN.
expect() {
  local want=$1 stream=$2 pattern=$3
  shift 4
  timeout 30 "$client" "$@" >"$out" 2>"$err"
  local got=$?
  local file=$out
  [[ $stream == stderr ]] && file=$err
  if [[ $got != "$want" ]] || ! grep -Eq -- "$pattern" "$file"; then
    echo "FAIL: moh-client $* -> exit $got (want $want), $stream should match '$pattern'"
    echo "--- stdout:"; cat "$out"; echo "--- stderr:"; cat "$err"
    failures=$((failures + 1))
  else
    echo "ok: moh-client $*"
  fi
}

# Bad local usage: exit 2 with the usage message.
expect 2 stderr '^usage: moh-client' --
expect 2 stderr "unknown command 'frobnicate'" -- frobnicate
expect 2 stderr 'generate needs one PROMPT' -- generate
expect 2 stderr 'either PROMPT or --token_ids' -- generate hi --token_ids=1,2
expect 2 stderr 'is not an integer' -- generate --token_ids=1,x
expect 2 stderr 'unknown flag --no_such_flag' -- models --no_such_flag=1
expect 2 stderr '--ratio does not apply to models' -- models --ratio=0.5
expect 2 stderr "Illegal value 'abc'" -- generate hi --ratio=abc
expect 2 stderr '--text needs --labels' -- classify --text=hello
expect 0 stdout '^usage: moh-client' -- --help

# No server: the RPC error is reported as "moh-client: UNAVAILABLE: ...".
expect 1 stderr '^moh-client: UNAVAILABLE: ' -- "$dead" models
expect 1 stderr '^moh-client: UNAVAILABLE: ' -- "$dead" generate "Once upon"
expect 1 stderr '^moh-client: UNAVAILABLE: ' -- "$dead" classify --text=x --labels=a,b
expect 1 stderr '^moh-client: UNAVAILABLE: ' -- "$dead" health

if ((failures > 0)); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
