#!/usr/bin/env bash
# Idempotent: the documentation site's tools (infra/docs-requirements.txt) in a venv of their own at
# $DOCS_VENV (default $FACTORY_HOME/docs-venv, .state/docs-venv), apart from the main venv's torch/vLLM pins.
# A stamp with the hash of this script and the requirements makes reruns instant.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${FACTORY_HOME:-$PWD/.state}"
VENV="${DOCS_VENV:-$STATE/docs-venv}"
stamp="$VENV/.factory-installed"
source infra/uv.sh
venv_built "$stamp" infra/docs-venv.sh infra/docs-requirements.txt && exit 0
mkdir -p "$STATE"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
venv_uv "$VENV" -r infra/docs-requirements.txt
"$VENV/bin/python" -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python" \
  || { echo "docs-venv: $VENV cannot import the docs tools; see the output above" >&2; exit 1; }
echo "$VENV_WANT" > "$stamp"
echo "docs-venv: ready ($VENV)"
