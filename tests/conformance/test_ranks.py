"""The contract across ranks: one rank's inf makes every rank skip and back off, in lockstep.

Two gloo ranks on CPU (and, on a GPU machine, two gloo ranks sharing one GPU). Each rank holds a
different shard of grads, as under FSDP, so a scaler that does not agree on found_inf diverges.
"""
import math

import pytest
import torch
import torch.distributed as dist

from fsdp_amp_suite.conformance.problem import (INF_VALUES, Problem, build_scaler, equal_lists, placement_params,
                                       reference_scales, run_at, run_steps, sgd, step_with_rank1_without_grads)
from fsdp_amp_suite.harness import RankHung, cached_group, run_on_ranks

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("across ranks")]

RANK_PLACEMENTS = placement_params(["cpu", "cuda", "offload", "cpu_loss", "mixed"])


def _one_step(spec, placement, bad_ranks, value, explicit_unscale=False):
    rank = dist.get_rank()
    pb = Problem(placement, seed_offset=rank)  # a different shard on every rank
    s = build_scaler(spec, pb, init_scale=256.0, backoff_factor=0.25)
    opt = sgd(pb.params)
    before = pb.snapshot()
    pb.backward(s, inject={1: INF_VALUES[value]} if rank in bad_ranks else None)
    if explicit_unscale:  # the clipping path: agreement must not depend on who unscales
        s.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(pb.params, 1.0)
    s.step(opt)
    s.update()
    return dict(stepped=not equal_lists(pb.snapshot(), before), scale=s.get_scale())


@pytest.mark.parametrize("explicit_unscale", [False, True], ids=["step", "unscale_clip_step"])
@pytest.mark.parametrize("value", ["inf", "nan"])
@pytest.mark.parametrize("bad_ranks", [(0,), (1,), (0, 1)], ids=["rank0", "rank1", "both"])
@pytest.mark.parametrize("placement", RANK_PLACEMENTS)
def test_inf_on_some_ranks_makes_every_rank_skip_and_back_off(scaler, placement, bad_ranks, value,
                                                              explicit_unscale):
    out = run_at(placement, _one_step, scaler, placement, bad_ranks, value, explicit_unscale, world_size=2)
    assert [o["stepped"] for o in out] == [False, False], f"inf/NaN on ranks {bad_ranks}: every rank must skip"
    assert [o["scale"] for o in out] == [64.0, 64.0], "every rank must back off exactly once (256 * 0.25)"


def _clean_step(spec, placement):
    return _one_step(spec, placement, (), "inf")


@pytest.mark.parametrize("placement", RANK_PLACEMENTS)
def test_clean_ranks_all_step_and_keep_their_scale(scaler, placement):
    out = run_at(placement, _clean_step, scaler, placement, world_size=2)
    assert [o["stepped"] for o in out] == [True, True] and [o["scale"] for o in out] == [256.0, 256.0]


def _lockstep(spec, placement, pattern):
    rank = dist.get_rank()
    pb = Problem(placement, seed_offset=rank)
    s = build_scaler(spec, pb, init_scale=512.0, growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=2)
    opt = sgd(pb.params, lr=0.0)
    return run_steps(s, pb, opt, [rank in bad_ranks for bad_ranks in pattern], bad_index=rank % 3)


@pytest.mark.parametrize("placement", RANK_PLACEMENTS)
def test_ranks_keep_scale_in_lockstep(scaler, placement):
    pattern = [(), (1,), (), (), (0,), (), (0, 1), (), (), (), (1,), (), ()]
    out = run_at(placement, _lockstep, scaler, placement, pattern, world_size=2)
    want = reference_scales(512.0, 2.0, 0.5, 2, [bool(b) for b in pattern])
    assert out[0] == out[1], "ranks ended up with different scales: they will diverge"
    assert out[0] == want


def _two_optimizers_on_ranks(spec, placement):
    rank = dist.get_rank()
    pb = Problem(placement, n_params=2, seed_offset=rank)
    s = build_scaler(spec, pb, init_scale=256.0)
    opt_a, opt_b = sgd([pb.params[0]]), sgd([pb.params[1]])
    before = pb.snapshot()
    pb.backward(s, inject={1: math.inf} if rank == 1 else None)  # only optimizer b, only on rank 1
    s.step(opt_a)
    s.step(opt_b)
    s.update()
    return dict(stepped=[not torch.equal(a, b) for a, b in zip(pb.snapshot(), before)], scale=s.get_scale())


@pytest.mark.parametrize("placement", RANK_PLACEMENTS)
def test_each_optimizer_agrees_across_ranks(scaler, placement):
    out = run_at(placement, _two_optimizers_on_ranks, scaler, placement, world_size=2)
    assert [o["stepped"] for o in out] == [[True, False], [True, False]], "b skips on every rank, a steps"
    assert [o["scale"] for o in out] == [128.0, 128.0]


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "inf_on_rank0"])
@pytest.mark.parametrize("placement", RANK_PLACEMENTS)
def test_rank_without_grads_takes_part(scaler, placement, bad):
    out = run_at(placement, step_with_rank1_without_grads, scaler, placement, bad, world_size=2, timeout=20)
    assert out[0]["stepped"] is (not bad) and out[1]["stepped"] is False  # rank 1 has nothing to step
    assert out[0]["scale"] == out[1]["scale"] == (128.0 if bad else 256.0)


def _own_group(spec, placement):
    rank = dist.get_rank()
    groups = [cached_group([0]), cached_group([1])]  # every rank makes every group, in order
    pb = Problem(placement, seed_offset=rank)
    s = build_scaler(spec, pb, init_scale=256.0, process_group=groups[rank])
    opt = sgd(pb.params)
    before = pb.snapshot()
    pb.backward(s, inject={0: math.inf} if rank == 1 else None)
    s.step(opt)
    s.update()
    return dict(stepped=not equal_lists(pb.snapshot(), before), scale=s.get_scale())


@pytest.mark.parametrize("placement", placement_params(["cpu", "offload"]))
def test_agreement_uses_the_given_process_group(scaler, placement):
    """Each rank alone in its group: rank 1's inf must not reach rank 0 through WORLD."""
    out = run_at(placement, _own_group, scaler, placement, world_size=2)
    assert out[0] == dict(stepped=True, scale=256.0), "rank 0's group saw no inf"
    assert out[1] == dict(stepped=False, scale=128.0)


def _some_ranks_step(spec, placement, stepping):
    pb = Problem(placement, seed_offset=dist.get_rank())
    s = build_scaler(spec, pb)
    opt = sgd(pb.params)
    pb.backward(s)
    if dist.get_rank() in stepping:  # a rank that skips the optimizer step: the classic mismatched collective
        s.step(opt)
        s.update()
    return True


@pytest.mark.parametrize("placement", placement_params(["cpu"]))
def test_unmatched_step_surfaces_as_a_hang_in_bounded_time(scaler, placement):
    """A scaler that agrees across ranks must block here; the harness turns that into a failure."""
    # the same step on every rank first (matched, so no hang): the first optimizer step of a process imports
    # torch._dynamo (and triton with a CUDA build, which on a loaded runner can outlast the timeout below), and
    # the short timeout below must time the mismatch, not first-use imports
    run_at(placement, _some_ranks_step, scaler, placement, (0, 1), world_size=2)
    with pytest.raises(RankHung, match="rank"):
        run_at(placement, _some_ranks_step, scaler, placement, (0,), world_size=2, timeout=15)  # rank 1 skips


@pytest.mark.multigpu
@pytest.mark.parametrize("bad_ranks", [(1,), (0, 1)], ids=["rank1", "both"])
@pytest.mark.parametrize("placement", placement_params(["cuda", "offload"]))
def test_inf_on_some_ranks_over_nccl(scaler, placement, bad_ranks):
    """The same agreement over NCCL, one GPU per rank: the found_inf collective must be a CUDA tensor."""
    out = run_on_ranks(_one_step, scaler, placement, bad_ranks, "inf", world_size=2, device="cuda", timeout=60)
    assert [o["stepped"] for o in out] == [False, False]
    assert [o["scale"] for o in out] == [64.0, 64.0]
