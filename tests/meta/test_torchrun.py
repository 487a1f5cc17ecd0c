"""The README's torchrun recipe works: 2 torchrun processes (CPU, gloo) run a real slice of the
conformance suite and the matrix, with the harness running each body on the launcher's ranks.

The control: the same slice against a scaler that never agrees across ranks must fail.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_amp_suite.child_run import ROOT, clean_env

pytestmark = [pytest.mark.gate, pytest.mark.slow]

SLICE = ["tests/conformance/test_ranks.py", "tests/matrix/test_matrix.py", "-m", "conformance or matrix",
         "-k", "not unmatched and (test_inf_on_some_ranks or test_ranks_keep or (ws2 and fsdp2 and nooffload))"]


def torchrun(scaler, log_dir) -> tuple[int, list[str]]:
    """(exit code, [each rank's pytest output]). Each rank writes its own log (--redirects 3):
    two ranks printing to one pipe interleave their lines, so a console summary can't be parsed."""
    # no hang test in the slice: under torchrun a hang is bounded only by the process group's timeout
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--log-dir={log_dir}", "--redirects=3", "-m", "pytest",
           "-p", "no:xdist", "-p", "no:cacheprovider", "-q", *SLICE, "--scaler", scaler]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    logs = sorted(Path(log_dir).rglob("stdout.log"))
    assert len(logs) == 2, (logs, (proc.stdout + proc.stderr)[-5000:])
    return proc.returncode, [p.read_text() for p in logs]


def summary(out: str) -> dict:
    """{'passed': n, 'failed': n, ...} from a pytest run's last line."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", out.strip().splitlines()[-1])}


def test_a_slice_runs_green_under_torchrun(tmp_path):
    rc, outs = torchrun("ours", tmp_path)
    assert rc == 0, "\n".join(o[-3000:] for o in outs)
    for out in outs:  # one summary per rank
        counts = summary(out)
        assert counts.get("passed", 0) >= 10 and not counts.get("failed") and not counts.get("error"), out[-3000:]


def test_a_broken_scaler_fails_under_torchrun(tmp_path):
    rc, outs = torchrun("fsdp_amp_suite.planted.scalers:no_agreement", tmp_path)
    assert rc != 0, "\n".join(o[-3000:] for o in outs)
    assert all(summary(out).get("failed", 0) >= 1 for out in outs), "\n".join(o[-3000:] for o in outs)
