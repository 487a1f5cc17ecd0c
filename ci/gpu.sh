#!/usr/bin/env bash
# The GPU gate (self-hosted GPU runners): every part of the suite the GPUs allow, JUnit + report.
#   ci/gpu.sh OUT_DIR [extra pytest args]
# 1 GPU: multi-rank cases run as gloo ranks sharing it; >= 2 GPUs: NCCL, one GPU per rank (the
# harness picks per test). Exits non-zero on any unexpected outcome: a failure, an error, or a
# strict xfail that passed (an upstream fix: update fsdp_amp_suite/known_bugs.py KNOWN_BUGS).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: ci/gpu.sh OUT_DIR [pytest args]}"
shift
mkdir -p "$OUT"
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
# the GPU count, the CUDA contexts the rank pools may keep on one GPU across workers, and the workers that fit
# (fsdp_amp_suite/harness/budget.py visible_gpus, context_budget, gate_workers), from nvidia-smi: importing torch here would
# cost seconds before pytest imports it again; pytest's --require-gpu then stops at start-up if torch sees no GPU
read -r GPUS CONTEXTS WORKERS TORCH < <(python3 -c "
import importlib.metadata, os
from fsdp_amp_suite.harness.budget import context_budget, gate_workers, visible_gpus
n = visible_gpus()
print(n, context_budget(0) if n else 0, gate_workers(len(os.sched_getaffinity(0)), context_budget(0)) if n else 0,
      importlib.metadata.version('torch'))") || { echo "ci/gpu.sh: python3 cannot size the gate" >&2; exit 2; }
if [ "${GPUS:-0}" -eq 0 ]; then
  echo "ci/gpu.sh: nvidia-smi sees no GPU (or CUDA_VISIBLE_DEVICES hides them); use ci/cpu.sh" >&2
  exit 2
fi
CORES=$(nproc)
echo "ci/gpu.sh: $GPUS GPU(s), $CORES cores, $CONTEXTS CUDA contexts per GPU -> pytest -n $WORKERS; torch $TORCH"
# GPU memory in use, once a second (fsdp_amp_suite/harness/budget.py CONTEXT_GIB is derived from the gate's peak), and
# which processes hold it, every 5 s (benchmarks/gpu_processes.py)
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total --format=csv,noheader,nounits -l 1 \
    > "$OUT/gpu-memory.csv" 2>/dev/null &
  SAMPLERS="$!"
  python3 -m benchmarks.gpu_processes "$OUT/gpu-processes.csv" 5 2>/dev/null &
  SAMPLERS="$SAMPLERS $!"
  # and the host's available memory (kB), once a second: a CUDA context needs host memory too
  (while sleep 1; do echo "$(date +%s),$(awk '/^MemAvailable/{print $2}' /proc/meminfo)"; done) \
    > "$OUT/host-memory.csv" 2>/dev/null &
  SAMPLERS="$SAMPLERS $!"
  trap 'kill $SAMPLERS 2>/dev/null || true' EXIT
fi
# Python may write bytecode here, whatever the runner's PYTHONDONTWRITEBYTECODE says: every pytest process
# (xdist workers, the meta job's child runs, rank pools) would else compile the suite's modules and rewrite
# their asserts again, about a second of CPU each; a fresh clone has no __pycache__ that could go stale.
unset PYTHONDONTWRITEBYTECODE
# the main job's paths (pytest.ini testpaths) and the suite's own tests, which name GPU paths of the harness;
# the slow meta-tests (planted defects, adoption, torchrun, the child runs in test_options and
# test_versions_table) are CPU work, run by ci/cpu.sh.
# Order: one test per send hands out tests in collection order, so the run ends with the tests collected last.
# Longest first: the meta-tests' child runs, then the standalone repros' forked runs, then the matrix's short cases
# last, which fill the workers' ends evenly.
# the standalone repros' runs are recorded for docs/upstream/runs.json (python -m fsdp_amp_suite.upstream.reports --merge)
FSDP_AMP_STANDALONE_RECORD="$OUT/standalone-runs" \
python3 -m pytest -n "$WORKERS" --maxschedchunk 1 -m "not slow" tests/meta tests/upstream tests/repro tests/conformance tests/matrix \
  --require-gpu -p benchmarks.cputime --junitxml="$OUT/junit.xml" --report="$OUT/report.md" --report-json="$OUT/report.json" "$@"
