"""The suite catches planted defects: each mutant scaler (mutants.py) must fail its named checks.

Runs the conformance suite once, in a child pytest, against every mutant at once, and reads
the per-test outcomes from its JUnit XML. `ours` itself is the control: it must pass there.
"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.conformance.mutants import EXPECTED

pytestmark = [pytest.mark.conformance, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


HANG_TEST = "test_unmatched_step_surfaces_as_a_hang_in_bounded_time"


def _child_run(xml, specs, selection):
    """The conformance suite in a child pytest against specs; returns {(spec, test): [outcomes]}."""
    cmd = [sys.executable, "-m", "pytest", "tests/conformance", "-m", "not slow", "-k", selection, "-q",
           "-p", "no:cacheprovider", "-n", "2", f"--junitxml={xml}"]
    for spec in specs:
        cmd += ["--scaler", spec]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "PYTEST_ADDOPTS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode in (0, 1), proc.stdout[-5000:] + proc.stderr[-5000:]
    ids = sorted(((spec.replace(":", "-"), spec) for spec in specs), key=lambda p: -len(p[0]))
    result = {}
    for case in ET.parse(xml).iter("testcase"):
        test, _, params = case.get("name").partition("[")
        spec = next(s for i, s in ids if params.startswith(i + "-") or params == i + "]")
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        result.setdefault((spec, test), []).append("failed" if failed else "skipped" if skipped else "passed")
    return result


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mutants")
    specs = ["ours"] + [f"tests.conformance.mutants:{name}" for name in EXPECTED]
    result = _child_run(tmp / "all.xml", specs, f"not {HANG_TEST}")
    # the hang check costs its 15 s timeout per scaler: run it only where a mutant expects it
    hang_specs = ["ours"] + [f"tests.conformance.mutants:{n}" for n, tests in EXPECTED.items() if HANG_TEST in tests]
    result.update(_child_run(tmp / "hang.xml", hang_specs, HANG_TEST))
    return result


def test_ours_passes_every_check_in_the_same_run(outcomes):
    mine = {test: o for (spec, test), o in outcomes.items() if spec == "ours"}
    assert mine, "no results for ours"
    assert not [t for t, o in mine.items() if "failed" in o]


@pytest.mark.parametrize("mutant", sorted(EXPECTED))
def test_mutant_is_caught_by_its_checks(outcomes, mutant):
    spec = f"tests.conformance.mutants:{mutant}"
    for test in EXPECTED[mutant]:
        got = outcomes.get((spec, test), [])
        assert "failed" in got, f"{mutant}: {test} should fail on this defect, got {got or 'no results'}"
