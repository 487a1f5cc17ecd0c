#!/usr/bin/env bash
# The CPU gate: a fresh venv, the README's two commands. Used by .ci/run; runs anywhere without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.ci-venv}"
python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -r requirements.txt        # README step 1
python -m pytest -n auto                            # README step 2
