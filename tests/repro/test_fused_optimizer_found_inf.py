"""A fused optimizer left to skip an overflowing step by itself: what torch's scalers hand it, and what it does.

torch.amp.GradScaler and torch's ShardedGradScaler do not skip the step of an optimizer with
`_step_supports_amp_scaling` (Adam, AdamW, SGD, Adagrad with fused=True): they set its `found_inf` and
call step(), and the kernel returns early iff found_inf == 1.0 exactly.
(a) fused SGD with momentum makes its momentum buffers with torch.empty_like on its first step and fills
    them in the kernel, so a first step skipped there leaves uninitialised memory that the next, clean
    step applies (deterministic mode fills it with NaN, so the case shows it on every run).
(b) ShardedGradScaler.unscale_ all-reduces found_inf with SUM, so after an explicit unscale_ on two
    overflowing ranks the optimizer is handed 2.0 and applies the inf update.
Both run on CPU; (b) on 2 gloo ranks.

    python -m fsdp_amp_suite.repro fused_optimizer_found_inf
"""
import math

import torch
import torch.distributed as dist

from fsdp_amp_suite.conformance.problem import deterministic_fill
from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler

C = torch.tensor([0.25, 0.5, -1.0])  # the exact grad of w in loss = <w, C>


def _skipped_first_step_then_clean(scaler):
    with deterministic_fill():  # uninitialised memory is NaN: no luck involved
        w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
        opt = torch.optim.SGD([w], lr=0.5, momentum=0.9, fused=True)
        s = make_scaler(scaler, device="cpu", init_scale=256.0)
        s.scale((w * C).sum()).backward()
        w.grad[1] = math.inf  # the first step overflows
        s.step(opt)
        s.update()
        opt.zero_grad()
        s.scale((w * C).sum()).backward()  # a clean step
        s.step(opt)
        s.update()
        return w.detach().tolist()


@case("fused SGD (momentum 0.9): the first step overflows, the second is clean",
      bugs=["fused-sgd-skipped-first-step", "fairscale-fused-optimizer-kwarg"])
def test_fused_sgd_after_a_skipped_first_step(scaler):
    got = run_on_ranks(_skipped_first_step_then_clean, scaler, world_size=1)[0]
    want = (torch.tensor([0.5, -0.25, 1.0]) - 0.5 * C).tolist()  # one step, the buffer initialised to the grad
    return Outcome(got != want, f"params after the clean step: {got}", f"{want} (the first step skipped entirely)")


def _overflow_on_every_rank_after_unscale(scaler):
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
    opt = torch.optim.SGD([w], lr=0.5, fused=True)  # no momentum: no buffer, only the found_inf value matters
    s = make_scaler(scaler, device="cpu", init_scale=256.0)
    s.scale((w * C).sum()).backward()
    w.grad[dist.get_rank()] = math.inf  # each rank's shard overflows
    s.unscale_(opt)  # the clipping path
    s.step(opt)
    s.update()
    return w.detach().tolist()


@case("fused SGD, 2 gloo ranks that both overflow, unscale_ then step()",
      bugs=["torch-sharded-hands-fused-a-sum", "fairscale-fused-optimizer-kwarg"])
def test_fused_step_after_unscale_when_every_rank_overflows(scaler):
    got = run_on_ranks(_overflow_on_every_rank_after_unscale, scaler, world_size=2)
    want = [0.5, -0.25, 1.0]
    return Outcome(got != [want, want], f"params per rank after the step: {got}", f"{[want, want]} (skipped)")
