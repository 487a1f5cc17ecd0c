#!/usr/bin/env bash
# The CPU gate (hosted runners, and .ci/run): a venv, the README's install, the workflow lint, then the
# README's two jobs: the main job (the verdict on this torch) and the suite's own tests (tests/meta).
#   ci/cpu.sh [OUT_DIR]   writes OUT_DIR/{junit.xml,report.md,report.json} and OUT_DIR/meta-{junit.xml,report.md}
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-ci-out}"
VENV="${VENV:-.ci-venv}"
mkdir -p "$OUT"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -r requirements.txt                              # README: the install
python -m pip install -q -r requirements-integrations.txt                 # the frameworks the scaler runs in
python -m pip install -q --no-deps -e .                                   # the suite's plugin, as a consumer has it
python -m pip install -q --require-hashes -r requirements-ci.txt          # CI tools, pinned by hash
actionlint .github/workflows/*.yml                                          # the workflows lint clean
ruff check --no-cache .                                                      # the code lints clean (pyproject.toml [tool.ruff])
# Python may write bytecode here, whatever the runner's PYTHONDONTWRITEBYTECODE says: every pytest process
# (xdist workers, the meta job's child runs, rank pools) would else compile the suite's modules and rewrite
# their asserts again, about a second of CPU each; a fresh clone has no __pycache__ that could go stale.
unset PYTHONDONTWRITEBYTECODE
SECONDS=0
python -m pytest -n auto -p benchmarks.cputime --junitxml="$OUT/junit.xml" --report="$OUT/report.md" --report-json="$OUT/report.json"
echo "ci/cpu.sh: the main job took ${SECONDS} s"
SECONDS=0
python -m pytest -n auto --dist loadfile tests/meta -p benchmarks.cputime --junitxml="$OUT/meta-junit.xml" --report="$OUT/meta-report.md"
echo "ci/cpu.sh: the suite's own tests took ${SECONDS} s"
