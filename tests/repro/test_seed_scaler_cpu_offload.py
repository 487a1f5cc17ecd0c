"""fairscale issue #421: FSDP cpu_offload + mixed precision + a grad scaler, on one GPU.

The thread's two repros, as written there, with only APIs renamed since (torch.cuda.amp.autocast ->
torch.autocast("cuda")) and the scaler under test in place of `ShardedGradScaler()` (built with the
same defaults, init_scale 2**16). The rank harness does the thread's init_process_group (NCCL,
world size 1, one GPU).

1. test_scaler_cpu_offload: FSDP(nn.Linear(5, 5), cpu_offload=True, mixed_precision=True), loss on
   the GPU, one step: the scale lives on the GPU, the grads on CPU. In 2021 step() crashed with
   "Could not run 'aten::_amp_foreach_non_finite_check_and_unscale_' with arguments from the 'CPU'
   backend".
2. _train_for_several_steps (from fairscale's test_fsdp.py) with the same wrapper: the loss is moved
   to the params' device (`loss.to(model_device)`, CPU under cpu_offload) before scaling, 2 steps. In
   2021 scale() failed `assert outputs.is_cuda`. The thread's test module is replaced by
   nn.Linear(5, 5) with the interface the function calls (get_input, get_loss, run_backward).

Both pass today (checked on an H200, torch 2.11: torch.amp.GradScaler("cuda"), fairscale's and torch's
ShardedGradScaler at world size 1): no exception, a finite loss, every step applied. See
test_seed_historical_crashes.py for what fixed each crash. Timing note: in repro 1 the scale is on the
GPU and the grads on CPU, and the upstream scalers copy inv_scale/found_inf between them with
non_blocking=True and use the copy before it has surely landed (the async-copy race, KNOWN_BUGS
async-copy-race-busy-gpu). With the GPU idle at step(), as here (fairscale's backward ends by
synchronizing its grad copies), 0 of 20 trials missed on the H200, but the suite treats such cells as
timing-dependent (fsdp_amp_suite/known_bugs.py race_reason), so for those scalers repro 1 checks only what the
issue's crash was about: no exception and a finite loss (tests/conformance/test_busy_gpu.py checks the
race on purpose). Needs one GPU; skips without one.

    python -m fsdp_amp_suite.repro seed_scaler_cpu_offload
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.known_bugs import race_reason
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler

# both repros of fairscale issue #421 pass with every built-in scaler today


def _seed_scaler(spec):
    """The thread's `ShardedGradScaler()`: torch's defaults, on a CUDA machine."""
    return make_scaler(spec, device="cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                       growth_interval=2000)


def _params(model):
    return [p.detach().cpu().clone() for p in model.parameters()]


def _moved(before, model):
    return any(not torch.equal(b, a) for b, a in zip(before, _params(model)))


# ------------------------------------------------------------------ 1. test_scaler_cpu_offload

def _test_scaler_cpu_offload(spec):
    from fairscale.nn import FullyShardedDataParallel

    device = torch.device("cuda")
    torch.manual_seed(0)

    scaler = _seed_scaler(spec)
    model = FullyShardedDataParallel(nn.Linear(5, 5), cpu_offload=True, mixed_precision=True)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)

    input = torch.rand((1, 5), dtype=torch.float).to(device)
    before = _params(model)  # added: to see the step applied
    optim.zero_grad()
    with torch.autocast("cuda"):  # was: torch.cuda.amp.autocast()
        output = model(input)
        loss = F.mse_loss(input, output)

    scaler.scale(loss).backward()
    grad = next(model.parameters()).grad  # added: where the grads landed
    grads_on = grad.device.type if grad is not None else "nowhere"  # added
    scaler.step(optim)
    scaler.update()
    return dict(loss=loss.item(), applied=[_moved(before, model)], scale=scaler.get_scale(),
                where=f"loss on {loss.device.type}, grads on {grads_on}")


# ------------------------------------------------------------------ 2. _train_for_several_steps

class Linear5(nn.Module):
    """nn.Linear(5, 5) with the test-module interface of fairscale's test_fsdp.py."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def get_input(self, device):
        torch.manual_seed(1)  # keep everything deterministic
        return (torch.rand((1, 5), dtype=torch.float).to(device),)

    def forward(self, x):
        return self.linear(x)

    def get_loss(self, input, output):
        return F.mse_loss(input[0], output)

    def run_backward(self, loss):
        loss.backward()


def _train_for_several_steps(model, num_steps, autocast, spec, lr=0.01, norm_type=None):  # added: spec
    from fairscale.nn import FullyShardedDataParallel
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState

    model_device = next(model.parameters()).device
    # use SGD with momentum instead of Adam, since Adam is scale invariant
    # and this makes it bad for tests
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = _seed_scaler(spec)  # was: ShardedGradScaler()
    applied = []  # added: whether each step was applied
    for _ in range(num_steps):
        before = _params(model)  # added
        optim.zero_grad()
        with torch.autocast("cuda", enabled=autocast):  # was: torch.cuda.amp.autocast(enabled=autocast)
            # Inputs always cuda regardless of move_grads_cpu, or model.device
            input = model.module.get_input(torch.device("cuda"))
            output = model(*input)
            loss = model.module.get_loss(input, output).to(model_device)
        loss = scaler.scale(loss)
        assert loss.dtype == torch.float32
        model.module.run_backward(loss)
        if norm_type is not None:
            clip_norm = 0.3
            if isinstance(model, FullyShardedDataParallel):
                model.clip_grad_norm_(clip_norm, norm_type)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm, norm_type)
        scaler.step(optim)
        scaler.update()
        applied.append(_moved(before, model))  # added
    if hasattr(model, "assert_idle"):
        model.assert_idle()
    if isinstance(model, FullyShardedDataParallel):
        model.assert_state(TrainingState.IDLE)
    return loss.detach(), applied, str(model_device), scaler.get_scale()  # was: return loss.detach()


def _seed_training(spec, num_steps):
    from fairscale.nn import FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(Linear5(), cpu_offload=True, mixed_precision=True)
    loss, applied, model_device, scale = _train_for_several_steps(model, num_steps, True, spec)
    return dict(loss=loss.item(), applied=applied, scale=scale, where=f"loss.to(model_device) = {model_device}")


# ------------------------------------------------------------------ outcomes

def _outcome(out, steps, timing_dependent=False):
    finite, applied = math.isfinite(out["loss"]), out["applied"] == [True] * steps
    story = f"{out['where']}: loss {out['loss']:.6g}, steps applied {out['applied']}, scale {out['scale']:g}"
    if timing_dependent:  # only the crash is checked: no exception and a finite loss
        return Outcome(not finite, f"{story} (whether the step applied is not checked for this scaler: CUDA "
                                   f"scale + CPU grads is timing-dependent: the async-copy race, "
                                   f"async-copy-race-busy-gpu)",
                       "no exception, a finite loss")
    return Outcome(not (finite and applied), story,
                   f"no exception, a finite loss, every step applied: {[True] * steps}")


@case("fairscale#421 repro 1: test_scaler_cpu_offload (fairscale FSDP cpu_offload + mixed precision, loss on the "
      "GPU; needs a GPU)", needs="cuda")
def test_scaler_cpu_offload(scaler):
    out = run_on_ranks(_test_scaler_cpu_offload, scaler, world_size=1, device="cuda")[0]
    # the suite's own table says which built-ins race here (scale on CUDA, grads on CPU: placement "offload")
    racy = race_reason(scaler, "test_scaler_cpu_offload", {"placement": "offload"}, cuda=True)
    return _outcome(out, 1, timing_dependent=bool(racy))


@case("fairscale#421 repro 2: _train_for_several_steps, loss.to(model_device) (CPU), 2 steps (needs a GPU)",
      needs="cuda")
def test_train_for_several_steps_loss_on_model_device(scaler):
    out = run_on_ranks(_seed_training, scaler, 2, world_size=1, device="cuda")[0]
    return _outcome(out, 2)  # scale and grads both on CPU: nothing races
