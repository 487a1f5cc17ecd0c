"""torch.amp.GradScaler with sharded grads (FSDP): an inf on one rank makes only that rank skip.

torch.amp.GradScaler checks for inf/NaN only in the grads its own rank holds. Under DDP that is
enough, since every rank holds the same all-reduced grads. Under FSDP each rank holds a different
shard of the grads, so an overflow in one rank's shard is seen by that rank alone: it skips the step
and backs off, the other ranks step and keep their scale, and from then on the ranks' params and
scales disagree. A shard-aware scaler all-reduces found_inf over the process group so that every
rank skips and backs off. Two gloo ranks on CPU, each holding its own grads (as FSDP's shards), an
inf on rank 1 only. Runs on CPU (torch 2.13).

    python -m fsdp_amp_suite.repro torch_amp_not_shard_aware
"""
import math

import torch
import torch.distributed as dist

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler


def _inf_on_rank1(scaler):
    rank = dist.get_rank()
    shard = torch.nn.Parameter(torch.arange(4.0) + 4 * rank)  # this rank's shard of the params
    opt = torch.optim.SGD([shard], lr=0.5)
    s = make_scaler(scaler, device="cpu", init_scale=256.0)
    s.scale((shard * 0.25).sum()).backward()
    if rank == 1:
        shard.grad[2] = math.inf  # an overflow in rank 1's shard only
    before = shard.detach().clone()
    s.step(opt)
    s.update()
    return dict(stepped=not torch.equal(before, shard.detach()), scale=s.get_scale())


# fairscale's scaler: disabled without CUDA; with CUDA, fairscale-cpu-found-inf-not-agreed (its CPU found_inf
# is never agreed)
@case("Sharded grads, an inf on rank 1 only (2 gloo ranks, CPU)",
      bugs=["torch-amp-not-shard-aware", "fairscale-cpu-found-inf-not-agreed"])
def test_inf_on_one_rank_of_two(scaler):
    out = run_on_ranks(_inf_on_rank1, scaler, world_size=2)
    stepped, scales = [o["stepped"] for o in out], [o["scale"] for o in out]
    return Outcome(stepped != [False, False] or scales != [128.0, 128.0],
                   f"inf only on rank 1: stepped per rank {stepped}, scale per rank {scales}",
                   "every rank skips and backs off: stepped [False, False], scale [128.0, 128.0]")
