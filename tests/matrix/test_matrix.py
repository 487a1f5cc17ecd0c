"""FSDP vs DDP: every cell trains the same problem both ways (cell.py) and the two must agree.

Compared at every step and on every rank: the loss, the step/skip decision and the scale after
update(); at the end every parameter gathered full, and the optimizer state (through one zero-grad
probe step). Every cell must also have exercised the scaler: a growth, a backoff, an applied step.
A failure names the first step, rank and quantity where FSDP and DDP diverged, and the command
that reruns exactly that cell in fresh processes.
"""
import pytest
import torch

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.matrix import axes
from fsdp_amp_suite.matrix.cell import train_cell
from fsdp_amp_suite.matrix.compare import cell_problem, step_table
from fsdp_amp_suite.report import rerun_command

pytestmark = pytest.mark.matrix


def _n_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_fsdp_matches_ddp(cell, scaler, request):
    out = run_on_ranks(train_cell, cell, scaler, cell.impl, world_size=cell.world_size,
                       device=axes.cell_device_mode(cell, _n_gpus()))
    if out[0].unsupported:
        pytest.skip(out[0].unsupported)
    problem = cell_problem(cell, out)
    if problem:
        pytest.fail(f"{problem}\n\n{step_table(out)}\n\nrerun this cell alone:\n  {rerun_command(request.node)}",
                    pytrace=False)
