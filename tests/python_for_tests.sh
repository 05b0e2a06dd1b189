#!/usr/bin/env bash
# Runs Python with the project's test virtual environment when it is
# installed (scripts/install_deps.sh --test: the official openai and
# anthropic clients, on top of Debian's packages), else Debian's
# /usr/bin/python3.
# shellcheck source=../scripts/test_venv.env
. "$(dirname "$0")/../scripts/test_venv.env"
python="$MOH_TEST_VENV/bin/python"
[ -x "$python" ] || python=/usr/bin/python3
exec "$python" "$@"
