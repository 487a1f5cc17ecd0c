"""Run by test_harness_sessions.py under torchrun (2 ranks): the body runs on the launcher's ranks."""
import os

import pytest
import torch
import torch.distributed as dist

from fsdp_amp_suite.harness import RankRaised, run_on_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return os.getpid(), dist.get_rank(), t.item()


def _skip_on(rank):
    if dist.get_rank() == rank:
        pytest.skip(f"rank {rank} has nothing to check")
    return dist.get_rank()


def _skip_everywhere():
    pytest.skip("every rank skips this")


def test_body_runs_on_launcher_ranks():
    out = run_on_ranks(_sum_of_ranks, world_size=2)
    assert [rank for _, rank, _ in out] == [0, 1]
    assert [total for _, _, total in out] == [3.0, 3.0]
    assert out[int(os.environ["RANK"])][0] == os.getpid()  # no pool: this very process is the rank


def test_a_skip_on_one_rank_fails_on_every_rank():
    """Rank 1 skips, rank 0 returns: both ranks hear of the skip (neither waits for the other)."""
    with pytest.raises(RankRaised) as info:
        run_on_ranks(_skip_on, 1, world_size=2)
    assert "rank(s) [1]" in str(info.value) and "Skipped: rank 1 has nothing to check" in str(info.value)


def test_a_skip_on_every_rank_skips_the_test():
    run_on_ranks(_skip_everywhere, world_size=2)


def test_wrong_world_size_is_skipped():
    run_on_ranks(_sum_of_ranks, world_size=3)
