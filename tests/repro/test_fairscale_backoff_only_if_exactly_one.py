"""fairscale ShardedGradScaler, scale on CPU: two optimizers that both overflow grow the scale.

With its scale on CPU (the loss moved to the params' device under CPU offload, as in fairscale issue
#421), update() goes through fairscale's _amp_update_scale_cpu_, which backs off only if the summed
found_inf is exactly 1.0 (`found_inf.item() == 1.0`; torch's kernel backs off on any non-zero value,
torch's ShardedGradScaler on >= 1.0). update() sums found_inf over optimizers (and devices), so when
two optimizers both see inf the sum is 2.0: both steps are skipped, but the update counts as a clean
one and, at growth_interval 1, doubles the scale that just overflowed. Needs one GPU (fairscale's
scaler disables itself without CUDA); params and grads on CPU, the loss computed on the GPU and
moved to CPU, world size 1 (NCCL).

    python -m fsdp_amp_suite.repro fairscale_backoff_only_if_exactly_one
"""
import math

import torch

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler


def _two_optimizers_both_inf(scaler):
    gpu = torch.device("cuda", torch.cuda.current_device())
    a = torch.nn.Parameter(torch.tensor([0.5, -0.25]))  # CPU params (and grads), as under cpu_offload
    b = torch.nn.Parameter(torch.tensor([1.0, 0.75]))
    c = torch.tensor([0.25, -0.5], device=gpu)
    opt_a, opt_b = torch.optim.SGD([a], lr=0.5), torch.optim.SGD([b], lr=0.5)
    s = make_scaler(scaler, device="cuda", init_scale=256.0, growth_interval=1)
    loss = ((a.to(gpu) * c).sum() + (b.to(gpu) * c).sum()).to("cpu")  # loss.to(model_device): scale on CPU
    s.scale(loss).backward()
    a.grad[0] = math.inf  # both optimizers' grads overflow
    b.grad[0] = math.inf
    before = [a.detach().clone(), b.detach().clone()]
    s.step(opt_a)
    s.step(opt_b)
    s.update()  # found_inf summed over the two optimizers: 2.0
    return dict(stepped=[not torch.equal(x, p.detach()) for x, p in zip(before, (a, b))], scale=s.get_scale())


@case("Scale on CPU, two optimizers that both see inf, growth_interval 1 (needs a GPU)",
      bugs=["fairscale-backoff-only-if-exactly-one"], needs="cuda")
def test_two_optimizers_both_overflow(scaler):
    out = run_on_ranks(_two_optimizers_both_inf, scaler, world_size=1, device="cuda")[0]
    return Outcome(out["stepped"] != [False, False] or out["scale"] != 128.0,
                   f"stepped per optimizer {out['stepped']}, scale 256.0 -> {out['scale']}",
                   "both skip and the scale backs off once: stepped [False, False], scale 256.0 -> 128.0")
