"""Run by test_harness_gpu.py in a child pytest with a small FSDP_AMP_GPU_CONTEXTS (not collected by
default): two workers whose pools together want more CUDA contexts than the budget allows."""
import os

import pytest
import torch.distributed as dist

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.harness import session


def _rank():
    return dist.get_rank()


@pytest.mark.parametrize("i", range(6))
@pytest.mark.parametrize("world_size, device", [(4, "cuda-shared"), (2, "cuda-shared"), (1, "cuda")])
def test_pools_take_turns_within_the_budget(world_size, device, i):
    assert run_on_ranks(_rank, world_size=world_size, device=device) == list(range(world_size))
    held = sum(len(p.slots) for p in session().pools.values())
    assert held <= session().gpu_budget.budget(0) == int(os.environ["FSDP_AMP_GPU_CONTEXTS"])
