"""A repro file runs on any scaler: as a script (`python -m fsdp_amp_suite.repro NAME --scaler SPEC`), and under pytest
through the root conftest's scaler parametrization (a plugged scaler gets no built-in known bug: showing the bug
fails its case)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_amp_suite.child_run import ROOT, clean_env, runpytest
from fsdp_amp_suite.scalers import spec_id

pytestmark = pytest.mark.harness
REPRO = "tests/repro/test_cpu_scale_grows_to_inf.py"  # runs on CPU
NAME = "cpu_scale_grows_to_inf"  # its name for python -m fsdp_amp_suite.repro
MUTANT = "fsdp_amp_suite.planted.scalers:grows_to_inf"  # has that bug


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=300)


def test_the_script_shows_a_plugged_scalers_outcome():
    proc = _run("-m", "fsdp_amp_suite.repro", NAME, "--scaler", "ours", "--scaler", MUTANT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line and not line[0].isspace()}
    assert lines["ours"].split()[1] == "ok:" and lines[MUTANT].split()[1] == "BUG:", proc.stdout
    assert "known upstream bug" not in lines[MUTANT], "a plugged scaler has no built-in known bug"


def test_an_unknown_name_is_a_usage_error_naming_it_and_no_name_lists_the_files():
    proc = _run("-m", "fsdp_amp_suite.repro", "no_such_repro")
    assert proc.returncode == 2 and "no_such_repro" in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = _run("-m", "fsdp_amp_suite.repro")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in (Path(ROOT) / "tests" / "repro").glob("test_*.py"))
    assert proc.stdout.split() == [f[len("test_"):-len(".py")] for f in files], proc.stdout


def test_the_repro_case_runs_on_plugged_scalers_under_pytest(pytester, monkeypatch):
    """One child session for both scalers (a child session's start-up is most of its cost): the correct one
    passes the case, the one with the bug fails it."""
    result = runpytest(pytester, monkeypatch, os.path.join(ROOT, REPRO), "-p", "no:xdist", "-rA",
                       "--scaler", "ours", "--scaler", MUTANT)
    result.assert_outcomes(passed=1, failed=1)
    summary = [line for line in result.outlines if line.startswith(("PASSED ", "FAILED "))]
    assert any(line.startswith("PASSED ") and "[ours]" in line for line in summary), summary
    assert any(line.startswith("FAILED ") and f"[{spec_id(MUTANT)}]" in line for line in summary), summary


def _repro_files_in_parts(parts: int) -> list[list[str]]:
    """The repro files dealt into `parts` child runs (one run of them all was the GPU gate's longest test, 82 s):
    the files with a case that runs without CUDA first, so that every part has something to pass on CPU too."""
    from fsdp_amp_suite.repro.runner import cases, names

    def cpu_runnable(name):
        return any(case.repro.repro_of.needs != "cuda" for case in cases(name))

    ordered = sorted(names(), key=lambda name: not cpu_runnable(name))
    return [[f"tests/repro/test_{name}.py" for name in ordered[i::parts]] for i in range(parts)]


@pytest.mark.parametrize("files", _repro_files_in_parts(3), ids=["part1", "part2", "part3"])
def test_every_repro_file_passes_a_correct_plugged_scaler(pytester, monkeypatch, files):
    """A correct scaler plugged in by spec is judged by its outcomes alone: no case may look its spec up in a
    table keyed by the built-in names (one did, and failed a correct plugged scaler with a KeyError)."""
    result = runpytest(pytester, monkeypatch, *(os.path.join(ROOT, f) for f in files), "-p", "no:xdist",
                       "--scaler", "scaler_impl:make_scaler")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) > 0 and not outcomes.get("failed") and not outcomes.get("errors"), (
        "a correct plugged scaler failed a repro case:\n" + "\n".join(result.outlines[-40:]))
