"""torch ShardedGradScaler with its scale on CPU grows the scale to inf, then skips every step.

When the scale tensor lives on CPU (device="cpu", or a CPU loss under FSDP CPU offload), update()
goes through ShardedGradScaler._amp_update_scale_cpu_, a Python copy of the torch._amp_update_scale_
kernel without its isfinite check on the grown scale: float32 max * growth_factor becomes inf. From
then on every scaled grad is inf or NaN, every step is skipped and every backoff is inf * 0.5 = inf:
training silently stops for good. torch.amp.GradScaler("cpu") uses the kernel and keeps the scale.
fairscale's ShardedGradScaler has the same Python copy (on a machine without CUDA it disables itself
instead). Runs on CPU (torch 2.13): scale 2**127, growth_interval 1, three clean steps.

    python -m fsdp_amp_suite.repro cpu_scale_grows_to_inf
"""
import math

import torch

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler

TOP = 2.0**127  # float32 max is just under 2**128: one more growth is inf


def _clean_steps_at_the_top(scaler, steps):
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
    c = torch.tensor([0.25, 0.5, -1.0])  # grad of w; c * 2**127 is finite
    opt = torch.optim.SGD([w], lr=2.0**-4)
    s = make_scaler(scaler, device="cpu", init_scale=TOP, growth_factor=2.0, growth_interval=1)
    scales, stepped = [], []
    for _ in range(steps):
        opt.zero_grad()
        before = w.detach().clone()
        s.scale((w * c).sum()).backward()
        s.step(opt)
        s.update()  # growth_interval 1: every clean step tries to grow the scale
        scales.append(s.get_scale())
        stepped.append(not torch.equal(before, w.detach()))
    return scales, stepped


def _pow2(x):
    return f"2**{math.log2(x):g}" if math.isfinite(x) and x > 0 and math.log2(x).is_integer() else str(x)


@case("Scale on CPU at 2**127, growth_interval 1, three clean steps", bugs=["sharded-cpu-scale-grows-to-inf"])
def test_growth_at_float32_max(scaler):
    scales, stepped = run_on_ranks(_clean_steps_at_the_top, scaler, 3, world_size=1)[0]
    return Outcome(any(s != TOP for s in scales),
                   f"scale after each clean step [{', '.join(map(_pow2, scales))}], steps applied {stepped}",
                   "growth skipped: scale stays [2**127, 2**127, 2**127], steps applied [True, True, True]")
