# Sourced by demo.sh and test.sh (from the checkout's root): the virtualenv and the
# package installed into it, without reinstalling when nothing changed.
#
#   PGLOCK_VENV  where the virtualenv lives (default: .venv in the checkout); CI points it
#                at a fresh directory to prove a first run on a bare machine
#   PYTHON       the interpreter that creates it (default: python3)
#
# Why a stamp: `pip install -e .` builds in an isolated environment and so downloads the
# build backend (hatchling) every time, which fails without a package index (a train, an
# air-gapped runner) although everything is installed. The install is editable, so edits
# to the code need no reinstall; only pyproject.toml (dependencies, entry points) does.
# The stamp records what the install depended on: pyproject.toml's hash, the checkout's
# path (the editable install points there) and the interpreter's version.

venv=${PGLOCK_VENV:-.venv}

# install_once EXTRA [ALSO...]: make sure .[EXTRA] is installed in $venv; when it had to
# be installed, record it for EXTRA and for each ALSO (extras that EXTRA includes).
install_once() {
  local extra=$1 stamp expected name
  shift
  if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  expected=$("$venv/bin/python" -c '
import hashlib, os, sys
digest = hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest()
print(digest, os.getcwd(), sys.version.split()[0])
')
  stamp="$venv/.celery-pglock-$extra.stamp"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$expected" ]; then
    return 0
  fi
  echo "== installing .[$extra] into $venv (once; again only when pyproject.toml changes)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$extra]"
  for name in "$extra" "$@"; do
    printf '%s\n' "$expected" >"$venv/.celery-pglock-$name.stamp"
  done
}
