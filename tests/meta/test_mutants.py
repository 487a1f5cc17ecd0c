"""The suite catches planted defects: each mutant scaler (fsdp_amp_suite/planted/scalers/) must fail its named checks.

Runs the conformance suite once, in a child pytest, against every mutant at once, each on the checks it names
(--only-pairs), and reads the per-test outcomes from its report records (--report-json). `ours` itself is the
control: it runs there every check but the four whose cost is their length (below), and must pass them.
"""
import ast
import json
import pathlib

import pytest

from fsdp_amp_suite.child_run import ROOT, child_run_once
from fsdp_amp_suite.planted import EXPECTED, SCALERS

pytestmark = pytest.mark.slow  # a child run of the suite: minutes on 2 cores, once per run (child_run_once)
# what these checks cost `ours` is their length: the hang's timeout, the Hypothesis budget a passing scaler spends
# whole, 4 ranks x ~50 mesh cells; they run only for the mutants that name them, and ours's outcomes there are
# the main job's. A caught mutant need only fail: no shrinking (its readable sequence is test_sequences.py's).
LONG_FOR_OURS = {"test_unmatched_step_surfaces_as_a_hang_in_bounded_time",
                 "test_every_sequence_of_calls_follows_the_contract",
                 "test_every_rank_of_the_mesh_takes_the_same_decision",
                 "test_every_sequence_on_a_mesh_follows_the_contract"}


def _conformance_checks() -> list[str]:
    """The name of every check function in tests/conformance."""
    return sorted(node.name for path in (pathlib.Path(ROOT) / "tests" / "conformance").glob("test_*.py")
                  for node in ast.parse(path.read_text()).body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """{(spec, test): [outcomes]}: every mutant on the checks it names, ours on all but LONG_FOR_OURS."""
    checks = _conformance_checks()
    assert LONG_FOR_OURS < set(checks), "a check of LONG_FOR_OURS was renamed: update it"
    ours = [name for name in checks if name not in LONG_FOR_OURS]
    pairs = {"ours": ours, **{SCALERS[name].spec: tests for name, tests in EXPECTED.items()}}
    path = tmp_path_factory.mktemp("pairs") / "pairs.json"
    path.write_text(json.dumps(pairs))
    result = {}
    for rec in child_run_once(tmp_path_factory, "mutants", ["tests/conformance"], "",
                              scalers=["ours"] + [SCALERS[name].spec for name in EXPECTED],
                              extra=[f"--only-pairs={path}", "--hypothesis-profile=no-shrink"]):
        result.setdefault((rec["scaler"], rec["test"]), []).append(rec["outcome"])
    return result


def test_ours_passes_every_check_in_the_same_run(outcomes):
    mine = {test: o for (spec, test), o in outcomes.items() if spec == "ours"}
    assert mine, "no results for ours"
    assert not [t for t, o in mine.items() if "failed" in o]


@pytest.mark.parametrize("mutant", sorted(EXPECTED))
def test_mutant_is_caught_by_its_checks(outcomes, mutant):
    spec = SCALERS[mutant].spec
    for test in EXPECTED[mutant]:
        got = outcomes.get((spec, test), [])
        assert "failed" in got, f"{mutant}: {test} should fail on this defect, got {got or 'no results'}"
