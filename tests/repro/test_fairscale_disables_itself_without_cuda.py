"""fairscale ShardedGradScaler on a machine without CUDA disables itself, then steps on inf grads.

fairscale.optim.grad_scaler.ShardedGradScaler has no device argument. On a machine without CUDA its
constructor sees amp_definitely_not_available(), warns "torch.cuda.amp.GradScaler is enabled, but
CUDA is not available.  Disabling." and sets _enabled = False: is_enabled() is False, scale()
returns the loss as it is and step() calls optimizer.step() whatever the grads hold, inf included.
CPU training (FSDP on CPU with gloo) built with it has no overflow protection at all, and a warning
is all that says so. The scalers that take a device, built with device="cpu", stay enabled and
skip the step. Runs on CPU (fairscale 0.4.13, torch 2.13); on a machine with CUDA the bug does not
apply and the file skips.

    python -m fsdp_amp_suite.repro fairscale_disables_itself_without_cuda
"""
import math
import warnings

import torch

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler



def _build(scaler):
    if scaler == "fairscale_sharded":  # it has no device argument: this is the only way to build it
        from fairscale.optim.grad_scaler import ShardedGradScaler

        return ShardedGradScaler(init_scale=256.0)
    return make_scaler(scaler, device="cpu", init_scale=256.0)  # told its device, it stays enabled


def _inf_step(scaler):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = _build(scaler)
    s.scale(model(torch.ones(2, 4)).sum()).backward()
    model.weight.grad[0, 0] = math.inf  # an overflow in backward
    s.step(opt)
    s.update()
    return dict(enabled=s.is_enabled(), scale=s.get_scale(),
                warned=[str(w.message) for w in caught if "Disabling" in str(w.message)],
                stepped_on_inf=not torch.isfinite(model.weight).all().item())


@case("A scaler built on a machine without CUDA, then an inf grad (CPU)", bugs=["fairscale-disabled-without-cuda"],
      needs="no-cuda")
def test_inf_grad_on_a_machine_without_cuda(scaler):
    out = run_on_ranks(_inf_step, scaler, world_size=1)[0]
    bug = not out["enabled"] or out["stepped_on_inf"]
    warned = f" (warned {out['warned'][0]!r})" if out["warned"] else ""
    return Outcome(bug, f"is_enabled() {out['enabled']}{warned}; step() "
                        f"{'applied the inf grad (weight now non-finite)' if out['stepped_on_inf'] else 'skipped'}"
                        f", scale {out['scale']}",
                   "stays enabled, skips the step on the inf grad and backs off: scale 256.0 -> 128.0")
