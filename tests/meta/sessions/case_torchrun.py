"""Run by test_harness.py under torchrun (2 ranks): the body runs on the launcher's ranks."""
import os

import torch
import torch.distributed as dist

from tests.harness import run_on_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return os.getpid(), dist.get_rank(), t.item()


def test_body_runs_on_launcher_ranks():
    out = run_on_ranks(_sum_of_ranks, world_size=2)
    assert [rank for _, rank, _ in out] == [0, 1]
    assert [total for _, _, total in out] == [3.0, 3.0]
    assert out[int(os.environ["RANK"])][0] == os.getpid()  # no pool: this very process is the rank


def test_wrong_world_size_is_skipped():
    run_on_ranks(_sum_of_ranks, world_size=3)
