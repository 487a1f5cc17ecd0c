"""The two crashes of fairscale issue #421 (fairscale's ShardedGradScaler, torch 1.8), and what fixed each.

(a) With CPU-offloaded grads, scaler.step() -> unscale_ -> torch._amp_foreach_non_finite_check_and_unscale_
    raised "RuntimeError: Could not run 'aten::_amp_foreach_non_finite_check_and_unscale_' with
    arguments from the 'CPU' backend": the op had a CUDA kernel only. fairscale's scaler stopped
    calling it on CPU grads in fairscale 0.4.3 (#831: its own Python check-and-unscale loop; every
    grad checked since 0.4.4, #890). The op itself has a CPU kernel since torch 2.3 (pytorch#109281,
    with GradScaler on CPU, pytorch#109993), which torch.amp.GradScaler, torch's ShardedGradScaler
    and ours call on CPU grads. Checked here on CPU: the op itself on fp32 CPU grads holding an inf,
    and one clean and one overflowing step through each scaler with CPU grads and a CPU scale.
(b) With the loss moved to the params' device (CPU under cpu_offload: `loss.to(model_device)`),
    scaler.scale(loss) failed `assert outputs.is_cuda` in torch/cuda/amp/grad_scaler.py, whose
    scale() fairscale's scaler inherited. fairscale 0.4.3 (#831) gave it its own scale() accepting
    CPU tensors; torch's ShardedGradScaler.scale() accepts them by design (_is_supported_device); and
    in torch 2.13 (torch/amp/grad_scaler.py) GradScaler.scale() has no device check at all: a
    GradScaler("cuda") makes its scale on the device of the first tensor it scales (CPU here) and
    the CPU kernels of torch 2.3 unscale and update it there. This part needs a GPU (a CUDA scaler,
    a loss computed on the GPU and moved to CPU) and skips without one.

    python -m fsdp_amp_suite.repro seed_historical_crashes
"""
import math

import pytest
import torch

from fsdp_amp_suite.harness import run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler

# both crashes are fixed for every built-in scaler (without CUDA fairscale's disables itself: its own known bug)
# a plugged scaler (--scaler module:factory) has no history here: its outcome alone says whether it is fixed
PLUGGED = "a plugged scaler"
# (a): who unscales CPU grads, and since when
FIXED_A = {
    "ours": "calls torch._amp_foreach_non_finite_check_and_unscale_ per (device, dtype) group",
    "torch_amp": "calls the op on CPU grads: its CPU kernel exists since torch 2.3 (pytorch#109281)",
    "torch_sharded": "calls the op on CPU grads: its CPU kernel exists since torch 2.3 (pytorch#109281)",
    "fairscale_sharded": "never calls the op on CPU grads: a Python loop since fairscale 0.4.3 (#831), "
                         "checking every grad since 0.4.4 (#890)",
}
# (b): who accepts a CPU loss in scale(), and since when
FIXED_B = {
    "ours": "keeps the scale as a host number and hands it to each device",
    "torch_amp": "torch.amp.GradScaler.scale() has no device assertion since GradScaler moved to torch/amp "
                 "(torch 2.3): the scale is made on the CPU loss's device",
    "torch_sharded": "torch ShardedGradScaler.scale() accepts CPU tensors (_is_supported_device)",
    "fairscale_sharded": "fairscale's own scale() accepts CPU tensors since fairscale 0.4.3 (#831)",
}


# ------------------------------------------------------------------ (a) the op has a CPU kernel

def op_on_cpu_grads():
    grads = [torch.tensor([2.0, 4.0, 8.0]), torch.tensor([16.0, math.inf, 1.0])]  # fp32 CPU grads, one inf
    found_inf, inv_scale = torch.zeros(()), torch.full((), 0.25)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)  # issue #421's crash (a)
    want = [torch.tensor([0.5, 1.0, 2.0]), torch.tensor([4.0, math.inf, 0.25])]
    unscaled = all(torch.equal(g, w) for g, w in zip(grads, want))
    return Outcome(found_inf.item() != 1.0 or not unscaled,
                   f"ran on CPU: found_inf {found_inf.item()}, grads {[g.tolist() for g in grads]}",
                   f"found_inf 1.0, grads multiplied by 0.25: {[w.tolist() for w in want]}")


@pytest.mark.repro  # no scaler: a plain test (python -m fsdp_amp_suite.repro runs only the @case functions)
def test_the_op_runs_on_cpu_grads():
    outcome = op_on_cpu_grads()
    assert not outcome.bug, f"{outcome.happened} (want: {outcome.expected})"


def _cpu_grads_steps(scaler):
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))  # params, grads, loss and scale all on CPU
    c = torch.tensor([0.25, 0.5, -1.0])  # the exact grad of w
    opt = torch.optim.SGD([w], lr=0.5)
    s = make_scaler(scaler, device="cpu", init_scale=256.0)
    s.scale((w * c).sum()).backward()
    s.unscale_(opt)  # clean step: issue #421 crashed in here, unscaling CPU grads
    exact = torch.equal(w.grad, c)
    before = w.detach().clone()
    s.step(opt)
    s.update()
    clean_stepped = not torch.equal(before, w.detach())
    opt.zero_grad()
    s.scale((w * c).sum()).backward()
    w.grad[1] = math.inf  # overflowing step
    before = w.detach().clone()
    s.step(opt)
    s.update()
    return dict(exact=exact, clean_stepped=clean_stepped, inf_skipped=torch.equal(before, w.detach()),
                scale=s.get_scale())


@case("fairscale#421 crash (a) through each scaler: CPU grads and scale, a clean step, then an inf step")
def test_cpu_grads_unscaled_and_checked(scaler):
    out = run_on_ranks(_cpu_grads_steps, scaler, world_size=1)[0]
    ok = out["exact"] and out["clean_stepped"] and out["inf_skipped"] and out["scale"] == 128.0
    return Outcome(not ok, f"clean step: grads exact {out['exact']}, applied {out['clean_stepped']}; inf step: "
                           f"skipped {out['inf_skipped']}, scale {out['scale']}; {FIXED_A.get(scaler, PLUGGED)}",
                   "clean step unscaled exactly and applied; inf step skipped, scale 256.0 -> 128.0")


# ------------------------------------------------------------------ (b) a CPU loss into a CUDA scaler

def _cpu_loss_step(scaler):
    gpu = torch.device("cuda", torch.cuda.current_device())
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))  # a CPU param and grad, as under cpu_offload
    c = torch.tensor([0.25, 0.5, -1.0], device=gpu)
    opt = torch.optim.SGD([w], lr=0.5)
    s = make_scaler(scaler, device="cuda", init_scale=256.0)  # a CUDA scaler, as in issue #421
    loss = (w.to(gpu) * c).sum().to("cpu")  # computed on the GPU, moved to the params' device
    scaled = s.scale(loss)  # issue #421's crash (b): assert outputs.is_cuda
    scaled.backward()
    before = w.detach().clone()
    s.step(opt)
    s.update()
    return dict(scaled_device=str(scaled.device), scaled_exact=torch.equal(scaled.detach(), loss.detach() * 256),
                exact=torch.equal(w.grad, c.cpu()), stepped=not torch.equal(before, w.detach()), scale=s.get_scale())


@case("fairscale#421 crash (b): a CUDA scaler's scale() given the loss moved to CPU (needs a GPU)", needs="cuda")
def test_cuda_scaler_takes_a_cpu_loss(scaler):
    out = run_on_ranks(_cpu_loss_step, scaler, world_size=1, device="cuda")[0]
    ok = (out["scaled_device"] == "cpu" and out["scaled_exact"] and out["exact"] and out["stepped"]
          and out["scale"] == 256.0)
    return Outcome(not ok, f"scale(CPU loss) -> {out['scaled_device']} tensor, loss * 256 {out['scaled_exact']}; "
                           f"grads exact {out['exact']}, step applied {out['stepped']}, scale {out['scale']}; "
                           f"{FIXED_B.get(scaler, PLUGGED)}",
                   "scale() returns loss * 256 on CPU; the step unscales exactly and applies; scale stays 256.0")
