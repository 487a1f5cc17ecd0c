"""Sequences: any legal sequence of GradScaler calls, on two or four ranks, does what the contract model says
(the machine, the oracle and the replay command: sequences.py; the calls: calls.py). On a mesh too: 4 ranks on a
2x2 DeviceMesh, a test of its own so that it adds no choice to the plain sequences' draws. CI runs the "ci"
Hypothesis profile (derandomized, a fixed budget); `--hypothesis-profile=deep` runs many more (conftest.py).
"""
import pytest

from fsdp_amp_suite import versions
from fsdp_amp_suite.conformance.problem import placement_params
from fsdp_amp_suite.conformance.sequences import SEQUENCE_PLACEMENTS, MeshContract, ScalerContract, run_machine

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("sequences")]


@pytest.mark.parametrize("placement", placement_params(SEQUENCE_PLACEMENTS))
def test_every_sequence_of_calls_follows_the_contract(scaler, placement, request):
    run_machine(lambda: ScalerContract(scaler, placement), request)


@pytest.mark.skipif(versions.holds(torch=versions.DTENSOR_TORCH), reason=versions.DTENSOR_REASON)
@pytest.mark.parametrize("placement", placement_params(["cpu"]))  # gloo's CPU mesh: every machine runs it
def test_every_sequence_on_a_mesh_follows_the_contract(scaler, placement, request):
    run_machine(lambda: MeshContract(scaler, placement), request)
