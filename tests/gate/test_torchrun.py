"""The README's torchrun recipe works: 2 torchrun processes (CPU, gloo) run a real slice of the
conformance suite and the matrix, with the harness running each body on the launcher's ranks.

The control: the same slice against a scaler that never agrees across ranks must fail.
"""
import subprocess
import sys

import pytest

from tests.child_run import ROOT, clean_env

pytestmark = [pytest.mark.gate, pytest.mark.slow]

SLICE = ["tests/conformance/test_ranks.py", "tests/matrix/test_matrix.py", "-m", "conformance or matrix",
         "-k", "not unmatched and (test_inf_on_some_ranks or test_ranks_keep or (ws2 and fsdp2 and nooffload))"]


def torchrun(scaler):
    # no hang test in the slice: under torchrun a hang is bounded only by the process group's timeout
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "pytest",
           "-p", "no:xdist", "-p", "no:cacheprovider", "-q", *SLICE, "--scaler", scaler]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)


def test_a_slice_runs_green_under_torchrun():
    proc = torchrun("ours")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    finals = [line for line in out.splitlines() if " passed" in line and line.rstrip().endswith("s")]
    assert len(finals) == 2 and all("failed" not in f for f in finals), finals  # one summary per rank
    assert all(int(f.split(" passed")[0].split()[-1]) >= 10 for f in finals), finals


def test_a_broken_scaler_fails_under_torchrun():
    proc = torchrun("tests.conformance.mutants:no_agreement")
    assert proc.returncode != 0 and "FAILED" in proc.stdout, (proc.stdout + proc.stderr)[-5000:]
