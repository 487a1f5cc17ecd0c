"""The suite catches planted defects: each mutant scaler (tests/planted/scalers/) must fail its named checks.

Runs the conformance suite once, in a child pytest, against every mutant at once, each on the checks it names
(--only-pairs), and reads the per-test outcomes from its report records (--report-json). `ours` itself is the
control: it runs every check there, and must pass them.
"""
import json

import pytest

from tests.child_run import child_run_once
from tests.planted import EXPECTED, SCALERS
from tests.known_bugs import MESH, MESH_SEQUENCES, SEQUENCES

pytestmark = pytest.mark.slow  # child runs of the suite: minutes on 2 cores, once per run (child_run_once)
HANG_TEST = "test_unmatched_step_surfaces_as_a_hang_in_bounded_time"


def _child_run(tmp_path_factory, name, specs, selection, extra=()):
    """The conformance suite in a child pytest against specs; returns {(spec, test): [outcomes]}."""
    result = {}
    for rec in child_run_once(tmp_path_factory, name, ["tests/conformance"], selection, scalers=specs, extra=extra):
        result.setdefault((rec["scaler"], rec["test"]), []).append(rec["outcome"])
    return result


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    # every mutant on the checks it names only (--only-pairs), ours on all of them
    specs = ["ours"] + [SCALERS[name].spec for name in EXPECTED]
    pairs = {"ours": "*", **{SCALERS[name].spec: tests for name, tests in EXPECTED.items()}}
    path = tmp_path_factory.mktemp("pairs") / "pairs.json"
    path.write_text(json.dumps(pairs))
    result = _child_run(tmp_path_factory, "mutants-all", specs,
                        f"not {HANG_TEST} and not {SEQUENCES} and not {MESH} and not {MESH_SEQUENCES}",
                        extra=[f"--only-pairs={path}"])
    # the hang check costs its 15 s timeout per scaler: only where a mutant expects it
    hang_specs = ["ours"] + [SCALERS[n].spec for n, tests in EXPECTED.items() if HANG_TEST in tests]
    result.update(_child_run(tmp_path_factory, "mutants-hang", hang_specs, HANG_TEST))
    # the sequence test runs its whole example budget on every scaler it does not catch: only where expected,
    # and unshrunk (a caught mutant need only fail; its readable sequence is test_sequences.py's own business)
    # the mesh checks (4 ranks, ~50 cells a scaler) and the sequences on a mesh: only where expected too
    mesh_specs = ["ours"] + [SCALERS[n].spec for n, tests in EXPECTED.items() if {MESH, MESH_SEQUENCES} & set(tests)]
    result.update(_child_run(tmp_path_factory, "mutants-meshes", mesh_specs, f"{MESH} or {MESH_SEQUENCES}",
                             extra=["--hypothesis-profile=no-shrink"]))
    seq_specs = ["ours"] + [SCALERS[n].spec for n, tests in EXPECTED.items() if SEQUENCES in tests]
    result.update(_child_run(tmp_path_factory, "mutants-sequences", seq_specs, SEQUENCES,
                             extra=["--hypothesis-profile=no-shrink"]))
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
