#!/usr/bin/env bash
# The test command: lint, type-check and run the whole suite.
#
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/unit -q   # extra arguments go to pytest
#
# Works on a fresh machine with nothing running, as root or not: it creates the virtualenv
# (.venv, or PGLOCK_VENV) and installs the package with its dev extras once, and the test
# session starts its own PostgreSQL and Redis unless CELERY_PGLOCK_TEST_DATABASE_URL /
# CELERY_PGLOCK_TEST_BROKER_URL point at running ones. PGLOCK_SKIP_LINT=1 skips ruff and
# mypy. See docs/development.md.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh

install_once dev testing  # dev includes testing: the demo needs no install after this

if [ "${PGLOCK_SKIP_LINT:-0}" != 1 ]; then
  echo "== ruff"
  "$venv/bin/ruff" check celery_pglock tests examples benchmarks
  "$venv/bin/ruff" format --check celery_pglock tests examples benchmarks
  # The formatter owns layout: no opt-outs (house style).
  if grep -rnE "fmt: (skip|off)" celery_pglock tests examples benchmarks; then
    echo "FAILED: remove the fmt: skip/off above; let ruff format lay it out" >&2
    exit 1
  fi
  echo "== mypy --strict"
  "$venv/bin/mypy"
  "$venv/bin/mypy" tests/typing  # the public API, as users call it, must type-check
  "$venv/bin/mypy" benchmarks tests/chaos  # the harnesses whose figures the docs quote
fi

echo "== pytest"
exec "$venv/bin/python" -m pytest "$@"
