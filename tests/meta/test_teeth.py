"""The matrix catches defects inside real FSDP training: planted scalers and broken wrappers fail cells.

A slice of the CPU-runnable cells at world size 2 without offload runs in a child pytest against `ours` (the
control: it must pass every cell) and the mutant scalers a real FSDP run should expose: FSDP1's cells whose grads
stay in fp16/bf16 (keeplow: flat and orig params, with clipping) and the natural-overflow cells of FSDP1 and FSDP2
(climb: the scale grows until backward overflows, several times, DTensor grads on FSDP2). Each mutant fails at
least one of them; the other cells of the ws2 slice add no mutant and would triple the run. Then every ws2 cell,
offload too, with `ours` under plugged wrappers: a correct one passes, broken ones fail.
The wide model's cells (the model axis) run against the defects that only hundreds of grads or
multi-chunk grads expose, which the small model's cells cannot. The mesh slice (FSDP2's fp32 SGD cell on a 2x2
hsdp and on a tp mesh) runs against the defects only a mesh shows: a scaler agreeing along one mesh dim, a wrapper
that skips one unit's replicate reduction, a TP plan that leaves replicated grads partial.
"""
import pytest

from fsdp_amp_suite import planted
from fsdp_amp_suite.child_run import child_run_once, outcomes

pytestmark = pytest.mark.slow  # child runs of the matrix: minutes on 2 cores, once per run (child_run_once)

SLICE = "ws2 and nooffload and (fsdp1 or fsdp2) and (keeplow or climb)"
# fsdp_amp_suite/planted/scalers/ declares each mutant's matrix role, with a comment saying where the matrix exposes it
MUTANTS = planted.matrix_mutants("small")  # the defects the matrix's schedule (cell.py) must expose
WIDE_MUTANTS = planted.matrix_mutants("wide")  # wide cells only: the small model has 8 grads of <= 143 elements
WRAPPERS = "fsdp_amp_suite.matrix.implementations"  # the built-ins, plugged as a user's wrapper would be
BROKEN = planted.broken_wrappers("small")  # fsdp_amp_suite/planted/wrappers.py
MESH_SLICE = "fsdp2 and (hsdp or tp) and fp32 and sgd and ws4"  # ids name a mesh only off 1d; a plugged fsdp2 spec
                                                                # matches too
MESH_MUTANTS = planted.matrix_mutants("mesh")
MESH_BROKEN = planted.broken_wrappers("mesh")


@pytest.fixture(scope="module")
def scalers(tmp_path_factory):
    specs = ["ours"] + [planted.SCALERS[m].spec for m in MUTANTS]
    return child_run_once(tmp_path_factory, "teeth-scalers", ["tests/matrix/test_matrix.py"], SLICE,
                     scalers=specs, marker="matrix")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    specs = ["ours"] + [planted.SCALERS[m].spec for m in WIDE_MUTANTS]
    # world size 1: the cheapest wide cells (~3x a small one) expose both; the others run in the matrix itself
    return child_run_once(tmp_path_factory, "teeth-wide", ["tests/matrix/test_matrix.py"], "wide and ws1",
                     scalers=specs, marker="matrix")


@pytest.fixture(scope="module")
def wrappers(tmp_path_factory):
    fsdps = [f"{WRAPPERS}:fsdp1", f"{WRAPPERS}:fsdp2"] + [planted.WRAPPERS[b].spec for b in BROKEN]
    return child_run_once(tmp_path_factory, "teeth-wrappers", ["tests/matrix/test_matrix.py"], "ws2",
                     scalers=["ours"], fsdps=fsdps, marker="matrix")


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    """One child run (a child's start-up costs more than these cells): ours and the mesh mutants under the built-in
    FSDP2 plugged as a user's wrapper would be, and ours under the broken mesh wrappers."""
    specs = ["ours"] + [planted.SCALERS[m].spec for m in MESH_MUTANTS]
    fsdps = [f"{WRAPPERS}:fsdp2"] + [planted.WRAPPERS[b].spec for b in MESH_BROKEN]
    return child_run_once(tmp_path_factory, "teeth-mesh", ["tests/matrix/test_matrix.py"], MESH_SLICE,
                          scalers=specs, fsdps=fsdps, marker="matrix")


def test_ours_passes_every_cell_of_the_slice(scalers):
    got = outcomes(scalers, scaler="ours", test="test_fsdp_matches_ddp")
    assert "passed" in got and set(got) <= {"passed", "skipped"}, got  # skipped: needs a GPU


@pytest.mark.parametrize("mutant", MUTANTS)
def test_mutant_fails_cells(scalers, mutant):
    got = outcomes(scalers, scaler=planted.SCALERS[mutant].spec, test="test_fsdp_matches_ddp")
    assert "failed" in got, f"{mutant}: no matrix cell failed ({got or 'no results'})"


def test_ours_passes_every_wide_cell(wide):
    got = outcomes(wide, scaler="ours", test="test_fsdp_matches_ddp")
    assert "passed" in got and set(got) <= {"passed", "skipped"}, got


@pytest.mark.parametrize("mutant", WIDE_MUTANTS)
def test_a_defect_past_the_first_chunk_fails_wide_cells(wide, mutant):
    got = outcomes(wide, scaler=planted.SCALERS[mutant].spec, test="test_fsdp_matches_ddp")
    assert "failed" in got, f"{mutant}: no wide cell failed ({got or 'no results'})"


@pytest.mark.parametrize("impl", ["fsdp1", "fsdp2"])
def test_a_correct_plugged_wrapper_passes_with_no_expected_failures(wrappers, impl):
    got = outcomes(wrappers, scaler="ours", test="test_fsdp_matches_ddp", impl=f"{WRAPPERS}:{impl}")
    assert "passed" in got and set(got) <= {"passed", "skipped"}, got  # skipped: needs a GPU


@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_plugged_wrapper_fails_cells(wrappers, broken):
    got = outcomes(wrappers, scaler="ours", test="test_fsdp_matches_ddp", impl=planted.WRAPPERS[broken].spec)
    assert "failed" in got, f"{broken}: no cell failed ({got or 'no results'})"


def test_ours_and_a_correct_plugged_wrapper_pass_every_mesh_cell(meshes):
    got = outcomes(meshes, scaler="ours", test="test_fsdp_matches_ddp", impl=f"{WRAPPERS}:fsdp2")
    assert "passed" in got and set(got) <= {"passed", "skipped"}, got


@pytest.mark.parametrize("mutant", MESH_MUTANTS)
def test_a_scaler_defect_only_a_mesh_shows_fails_mesh_cells(meshes, mutant):
    got = outcomes(meshes, scaler=planted.SCALERS[mutant].spec, test="test_fsdp_matches_ddp", impl=f"{WRAPPERS}:fsdp2")
    assert "failed" in got, f"{mutant}: no mesh cell failed ({got or 'no results'})"


@pytest.mark.parametrize("broken", MESH_BROKEN)
def test_a_broken_mesh_wrapper_fails_mesh_cells(meshes, broken):
    got = outcomes(meshes, scaler="ours", test="test_fsdp_matches_ddp", impl=planted.WRAPPERS[broken].spec)
    assert "failed" in got, f"{broken}: no mesh cell failed ({got or 'no results'})"
