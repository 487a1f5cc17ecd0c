"""torch FSDP1 (not a scaler bug): MixedPrecision(keep_low_precision_grads=True) with
CPUOffload(offload_params=True) crashes the second backward after the default
`optimizer.zero_grad()` (set_to_none=True):

    _flat_param.py prepare_gradient_for_optim: flat_param.grad = flat_param._cpu_grad
    RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'

prepare_gradient_for_optim casts the grad to the low precision through `.data`, which turns the
fp32 `_cpu_grad` buffer itself into bf16/fp16; prepare_gradient_for_backward casts it back only when
`flat_param.grad is not None`, so once zero_grad() has set the grad to None the next backward
assigns a low-precision `_cpu_grad` to the fp32 flat param. With zero_grad(set_to_none=False) the
same loop trains. Every scaler hits it (the scaler plays no part; the matrix found it in its
FSDP1 offload keeplow cells). fp16 fails the same way (seen on the H200, torch 2.11); bf16 is used
here because torch.amp.GradScaler refuses fp16 grads before the second backward is reached.
PyTorch's own test of this setting never zeroes the grads.

Setup: one rank (NCCL), FSDP1 over a 2-layer MLP, bf16 mixed precision keeping bf16 grads, CPU
offload, SGD, 3 scaled steps, once per zero_grad mode. Needs one GPU.

    python -m fsdp_amp_suite.repro fsdp1_keeplow_offload_grad_dtype
"""
import torch

from fsdp_amp_suite.harness import rank_device, run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler

STEPS = 3


def _train(scaler, set_to_none: bool) -> str:
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    device = rank_device()
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(device),
                 device_id=device, cpu_offload=CPUOffload(offload_params=True),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                keep_low_precision_grads=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)  # foreach rejects bf16 grads on fp32 params
    s = make_scaler(scaler, device="cuda", init_scale=2.0**10)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        loss = model(torch.randn(4, 8, device=device, dtype=torch.bfloat16)).float().pow(2).mean()
        try:
            s.scale(loss).backward()
        except RuntimeError as exc:
            return f"step {step} backward raised RuntimeError: {str(exc).splitlines()[0]}"
        s.step(opt)
        s.update()
    grads = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    return f"{STEPS} steps trained (grads {', '.join(grads)})"


def _both_modes(scaler):
    return {mode: _train(scaler, mode) for mode in (True, False)}


# a bug of the FSDP implementation: every scaler hits it, ours included
@case("FSDP1 keep_low_precision_grads + CPUOffload, zero_grad in both modes (1 rank)",
      bugs=["fsdp1-keeplow-offload-grad-dtype"], needs="cuda")
def test_zero_grad_to_none_then_backward(scaler):
    out = run_on_ranks(_both_modes, scaler, world_size=1, device="cuda", timeout=120)[0]
    return Outcome(any("raised" in story for story in out.values()),
                   f"zero_grad(set_to_none=True): {out[True]}; zero_grad(set_to_none=False): {out[False]}",
                   f"{STEPS} steps train in both zero_grad modes")
