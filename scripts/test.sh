#!/usr/bin/env bash
# The one test command: installs what the tests need into .venv and runs the whole suite.
#
#   ./scripts/test.sh            # unit + end-to-end tests; compose tests run if a Docker engine is up
#   ./scripts/test.sh --docker   # also installs/starts a Docker engine and the base image first
#   ./scripts/test.sh -k late    # extra arguments go to pytest
#
# Under CI=true the Docker engine is always ensured, and a missing engine fails the compose tests
# instead of skipping them. .ci/run calls exactly this script.
set -euo pipefail
cd "$(dirname "$0")/.."

want_docker=0
[ "${CI:-}" = "true" ] && want_docker=1
args=()
for arg in "$@"; do
  if [ "$arg" = "--docker" ]; then want_docker=1; else args+=("$arg"); fi
done

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "test.sh: $python is older than Python 3.11" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$python" -m venv .venv
fi
echo "== installing kvpark and its test dependencies into .venv"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]' --config-settings editable_mode=strict

if [ "$want_docker" = 1 ]; then
  echo "== ensuring a Docker engine and the base image"
  bash .ci/ensure-docker.sh
  bash .ci/ensure-base-image.sh
fi

echo "== lint and types"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy

echo "== tests"
exec .venv/bin/python -m pytest "${args[@]}"
