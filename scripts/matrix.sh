#!/usr/bin/env bash
# The oldest dependencies celery-pglock claims, tested (the newest are what test.sh
# installs): a virtualenv of their own with the pins below, then the key, lock and task
# tests, and one real-worker exclusivity test, against the same services as test.sh.
#
#   bash scripts/matrix.sh            # every pin set below
#   bash scripts/matrix.sh oldest     # one of them
#
# The virtualenvs live in .pglock-dev/matrix-NAME and are reused while pyproject.toml and
# the pins are unchanged. docs/development.md lists what is tested.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A PINS=(
  # The floors in pyproject.toml: celery>=5.3 (with the kombu it shipped with),
  # sqlalchemy>=2.0, psycopg2-binary>=2.9.5 and the psycopg extra's psycopg>=3.1.8, on the
  # oldest Python claimed where this machine has it.
  [oldest]="celery[redis]==5.3.0 kombu==5.3.0 sqlalchemy==2.0.0 psycopg2-binary==2.9.5 psycopg[binary]==3.1.8"
)
# The tests that exercise what the pins change: keys, each Celery internal relied on
# (tests/unit/test_celery_compat.py, in tests/unit), the lock, the task and its policies,
# fencing, the CLI, lock_enqueue (Celery's send path and revoke signals) and lock_period,
# and cross-process exclusion with real workers.
TESTS=(
  tests/unit
  tests/integration/test_keys_sql.py tests/integration/lock/test_lock.py
  tests/integration/task/test_task.py tests/integration/task/test_task_skips.py
  tests/integration/task/test_task_release.py tests/integration/test_fencing.py
  tests/integration/lock/test_sessions.py tests/integration/cli/test_cli.py
  tests/integration/task/test_enqueue.py tests/integration/test_period.py
  tests/acceptance/test_exclusivity.py
)
# Not these, which the pins do not change (scripts/test.sh runs them): the key function's
# hypothesis properties (our own pure code; test_keys.py's fixed keys still run here, so
# a key that changed with the Python version fails), docker-compose.yml's schema, and
# mypy over the documentation's examples (Celery is typed by the celery-types stubs, the
# same on both ends). They took 167 of the unit tests' 265 s in a CI run on a loaded
# machine.
NOT_PINNED=(
  --ignore=tests/unit/test_key_properties.py --ignore=tests/unit/test_compose.py
  --deselect=tests/unit/test_docs_examples.py::test_examples_type_check
)
# Then the lock and task tests again with psycopg 3 as the lock driver (at its floor).
PSYCOPG3_TESTS=(
  tests/unit/db/test_drivers.py
  tests/integration/lock/test_lock.py tests/integration/task/test_task.py
  tests/integration/test_fencing.py
)

names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${!PINS[@]}")
for name in "${names[@]}"; do
  pins=${PINS[$name]:-}
  if [ -z "$pins" ]; then
    echo "unknown pin set $name (known: ${!PINS[*]})" >&2
    exit 2
  fi
  python=python3
  if [ "$name" = oldest ]; then
    # The oldest Python claimed, if this machine has one (directly, or installed by pyenv
    # but not selected); else the default one, said so.
    for candidate in python3.10 $(command -v pyenv >/dev/null && echo "$(pyenv root)"/versions/3.10*/bin/python3.10); do
      if "$candidate" -c pass 2>/dev/null; then
        python=$candidate
        break
      fi
    done
    [ "$python" != python3 ] || echo "note: no Python 3.10 here; the oldest pins run on $(python3 --version)"
  fi
  venv=".pglock-dev/matrix-$name"
  stamp="$venv/.stamp"
  expected="$(sha256sum pyproject.toml | cut -c1-16) $pins $PWD"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$expected" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    echo "== $name: installing .[dev] with $pins ($("$venv/bin/python" --version))"
    # One resolver run: the pins win, or the install fails naming the conflict.
    # shellcheck disable=SC2086 # the pins are separate words on purpose
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      -e ".[dev]" $pins
    printf '%s\n' "$expected" >"$stamp"
  fi
  echo "== $name: $("$venv/bin/python" --version) $("$venv/bin/python" -c '
import celery, sqlalchemy, psycopg, psycopg2, kombu
print(f"celery {celery.__version__}, kombu {kombu.__version__}, "
      f"sqlalchemy {sqlalchemy.__version__}, psycopg2 {psycopg2.__version__.split()[0]}, "
      f"psycopg {psycopg.__version__}")')"
  "$venv/bin/python" -m pytest -p no:cacheprovider -q "${TESTS[@]}" "${NOT_PINNED[@]}"
  echo "== $name: the lock and task tests on psycopg 3"
  CELERY_PGLOCK_TEST_DRIVER=psycopg \
    "$venv/bin/python" -m pytest -p no:cacheprovider -q "${PSYCOPG3_TESTS[@]}"
done
