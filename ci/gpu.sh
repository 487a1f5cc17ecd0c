#!/usr/bin/env bash
# The GPU gate (self-hosted GPU runners): every part of the suite the GPUs allow, JUnit + report.
#   ci/gpu.sh OUT_DIR [extra pytest args]
# 1 GPU: multi-rank cases run as gloo ranks sharing it; >= 2 GPUs: NCCL, one GPU per rank (the
# harness picks per test). Exits non-zero on any unexpected outcome: a failure, an error, or a
# strict xfail that passed (an upstream fix: update tests/known_bugs.py KNOWN_BUGS).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: ci/gpu.sh OUT_DIR [pytest args]}"
shift
mkdir -p "$OUT"
# the GPU count, and the CUDA contexts the rank pools may keep on one GPU across workers
# (tests/harness/budget.py: GPU memory over CONTEXT_GIB, or FSDP_AMP_GPU_CONTEXTS; a worker's pools hold up to
# 1 + 2 + 4 of them at once), from one Python start-up (importing torch there takes seconds)
# The runner brings torch (the one to judge, CUDA build); the rest is requirements-suite.txt. Say what is missing.
MISSING=$(python3 -c "
import importlib.util
need = {'torch': 'the torch to judge', 'pytest': 'pytest', 'xdist': 'pytest-xdist', 'hypothesis': 'hypothesis',
        'packaging': 'packaging', 'fairscale': 'fairscale'}
print(' '.join(pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None))") \
  || { echo "ci/gpu.sh: python3 does not run" >&2; exit 2; }
if [ -n "$MISSING" ]; then
  echo "ci/gpu.sh: python3 lacks: $MISSING. Install torch (a CUDA build), then: python3 -m pip install -r requirements-suite.txt" >&2
  exit 2
fi
read -r GPUS CONTEXTS TORCH < <(python3 -c "
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
if n:
    from tests.harness.ranks import context_budget
print(n, context_budget(0) if n else 0, torch.__version__)") || { echo "ci/gpu.sh: python3 cannot import torch" >&2; exit 2; }
if [ "${GPUS:-0}" -eq 0 ]; then
  echo "ci/gpu.sh: torch sees no GPU; use ci/cpu.sh" >&2
  exit 2
fi
CORES=$(nproc)
# one xdist worker per 2 cores, at most 8 (more did not help: 14 on 16 cores was slower), and no more
# than the GPU's context budget keeps alive without pools taking turns
WORKERS=$(( CORES / 2 < 8 ? (CORES / 2 > 0 ? CORES / 2 : 1) : 8 ))
WORKERS=$(( CONTEXTS / 7 < WORKERS ? (CONTEXTS / 7 > 0 ? CONTEXTS / 7 : 1) : WORKERS ))
echo "ci/gpu.sh: $GPUS GPU(s), $CORES cores, $CONTEXTS CUDA contexts per GPU -> pytest -n $WORKERS; torch $TORCH"
# the main job's paths (pytest.ini testpaths) and the suite's own tests, which name GPU paths of the harness;
# the slow meta-tests (planted defects, adoption, torchrun, the child runs in test_options and
# test_versions_table) are CPU work, run by ci/cpu.sh.
# Order: xdist's default hands each worker a block of ~130 consecutive tests and refills late ones in small
# batches, so the meta-tests' child runs (45-70 s each), collected last, started last and were the gate's tail
# (its item times replayed through that scheduler: 385 s, measured 388). tests/meta first with one test per
# send starts them at once on different workers: 328 s for the same item times.
# the standalone repros' runs are recorded for docs/upstream/runs.json (python -m tests.upstream.reports --merge)
FSDP_AMP_STANDALONE_RECORD="$OUT/standalone-runs" \
python3 -m pytest -n "$WORKERS" --maxschedchunk 1 -m "not slow" tests/meta tests/conformance tests/matrix tests/repro tests/upstream \
  --junitxml="$OUT/junit.xml" --report="$OUT/report.md" --report-json="$OUT/report.json" "$@"
