"""torch ShardedGradScaler + a fused optimizer: unscale_ (to clip) then step() crashes; without
unscale_ it never agrees on an inf across ranks.

Both come from GradScaler.step's fused-optimizer path (optimizers with _step_supports_amp_scaling,
e.g. AdamW(fused=True)): after unscale_ it hands the optimizer ShardedGradScaler's found_inf, a
shape-[1] tensor the fused kernel cannot subtract from its shape-[] step counter; without unscale_
it checks grads through _check_inf_per_device, which never reaches ShardedGradScaler.unscale_'s
all_reduce. Found by the FSDP-vs-DDP matrix (torch 2.11 CUDA and 2.13 CPU). Runs on CPU (gloo).

    python -m fsdp_amp_suite.repro sharded_scaler_fused_optimizer
"""
import math

import torch
import torch.distributed as dist

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler


def _fused_step(scaler, unscale_first, inf_on_rank):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    s = make_scaler(scaler, device="cpu", init_scale=2.0**8)
    s.scale(model(torch.ones(2, 4)).sum()).backward()
    if dist.get_rank() == inf_on_rank:
        model.weight.grad[0, 0] = math.inf  # as if only this rank's shard overflowed
    if unscale_first:
        s.unscale_(opt)  # the clipping path: unscale_, clip_grad_norm_, step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = model.weight.detach().clone()
    s.step(opt)
    s.update()
    return not torch.equal(before, model.weight)


# fairscale's scaler cannot drive a fused optimizer at all (on CPU-only machines it is disabled instead)
@case("ShardedGradScaler + fused AdamW: unscale_ then step()",
      bugs=["torch-sharded-fused-adamw-after-unscale", "fairscale-fused-optimizer-kwarg"])
def test_unscale_then_fused_step(scaler):
    run_on_ranks(_fused_step, scaler, True, None, world_size=1)
    return Outcome(False, "unscale_ -> clip_grad_norm_ -> step() stepped the fused AdamW",
                   "steps the fused optimizer after an explicit unscale_")


# torch.amp.GradScaler never agrees across ranks (it relies on DDP's all-reduced grads), fused or not
@case("ShardedGradScaler + fused AdamW: an inf on one rank only (2 gloo ranks)",
      bugs=["torch-sharded-fused-adamw-no-agreement", "fairscale-fused-optimizer-kwarg",
            "torch-amp-not-shard-aware"])
def test_inf_on_one_rank_with_fused_optimizer(scaler):
    stepped = run_on_ranks(_fused_step, scaler, False, 1, world_size=2)
    return Outcome(stepped != [False, False], f"inf only on rank 1: stepped per rank {stepped}",
                   "every rank skips: [False, False]")
