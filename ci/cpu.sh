#!/usr/bin/env bash
# The CPU gate (hosted runners, and .ci/run): a venv, the README's two commands, then the workflow lint.
#   ci/cpu.sh [OUT_DIR]      writes OUT_DIR/junit.xml and OUT_DIR/report.md (default: ci-out/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-ci-out}"
VENV="${VENV:-.ci-venv}"
mkdir -p "$OUT"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -r requirements.txt                              # README step 1
python -m pip install -q --require-hashes -r requirements-ci.txt          # CI tools, pinned by hash
actionlint .github/workflows/*.yml                                          # the workflows lint clean
python -m pytest -n auto --junitxml="$OUT/junit.xml" --report="$OUT/report.md"  # README step 2 (PATH after "=": an absolute OUT is not taken for a test path)
