#!/usr/bin/env bash
# Build the documentation site in strict mode (a broken link, anchor or API reference
# fails the build) into site/, which is gitignored.
#
#   bash scripts/docs.sh            # build
#   bash scripts/docs.sh serve      # live preview on http://127.0.0.1:8000
#
# Installs the `docs` extra into the virtualenv once (scripts/_venv.sh), so a second run
# needs no package index.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/_venv.sh
install_once docs

if [ "${1:-build}" = serve ]; then
  exec "$venv/bin/mkdocs" serve
fi
export NO_MKDOCS_2_WARNING=1  # the theme advertises its successor on every build
exec "$venv/bin/mkdocs" build --strict --clean
