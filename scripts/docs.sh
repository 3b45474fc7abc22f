#!/usr/bin/env bash
# Build the documentation site in strict mode (a broken link, anchor or API reference
# fails the build) into site/, which is gitignored.
#
#   bash scripts/docs.sh            # build
#   bash scripts/docs.sh serve      # live preview on http://127.0.0.1:8000
#
# Installs the `docs` extra into .venv (created if missing) only when mkdocs is not there
# yet, so a second run needs no package index.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
if ! .venv/bin/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[docs]'
fi

if [ "${1:-build}" = serve ]; then
  exec .venv/bin/mkdocs serve
fi
export NO_MKDOCS_2_WARNING=1  # the theme advertises its successor on every build
exec .venv/bin/mkdocs build --strict --clean
