"""FSDP1 keep_low_precision_grads + CPUOffload: the backward after zero_grad(set_to_none=True) raises a grad dtype error

With MixedPrecision(keep_low_precision_grads=True) and CPUOffload(offload_params=True), the second backward
after the default optimizer.zero_grad() (set_to_none=True) raises `RuntimeError: attempting to assign a
gradient with dtype 'c10::Half' to a tensor with grad_dtype 'Float'`; with zero_grad(set_to_none=False) the
same loop trains. No scaler is involved. Needs CUDA (FSDP1 CPU offload needs an accelerator); seen on
torch 2.11 with an H100/H200 (the code is the same in 2.4.1 .. 2.15.0), fp16 and bf16 alike.

    python fsdp1-keeplow-offload-grad-dtype.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/distributed/fsdp/_flat_param.py, `FlatParamHandle.prepare_gradient_for_optim`: it
assigns `flat_param.grad = flat_param._cpu_grad` and then casts through `flat_param.grad.data = ...to(low
dtype)`, which turns the fp32 offload buffer `_cpu_grad` itself into fp16. `prepare_gradient_for_backward`
casts `_cpu_grad` back to fp32 only while `flat_param.grad is not None`; after zero_grad(set_to_none=True)
it stays fp16, the post-backward hook copies the next grad into it, and `flat_param.grad =
flat_param._cpu_grad` then assigns an fp16 grad to the fp32 flat param.

Fix: in prepare_gradient_for_optim, before `flat_param.grad = flat_param._cpu_grad`, cast `_cpu_grad` back
to the param dtype when a previous step left it low precision (`if flat_param._cpu_grad.dtype !=
flat_param._local_shard.dtype: flat_param._cpu_grad.data = flat_param._cpu_grad.to(...)`), as
prepare_gradient_for_backward does when the grad was not set to None. (Or cast a detached alias,
`flat_param.grad = flat_param._cpu_grad.detach()`, so that the buffer stays fp32 and pinned.)

Related: pytorch PR #86495 added keep_low_precision_grads with CPU offload (its test never calls
zero_grad()); torch 2.10 only reworded the message (pytorch PR #162815). No report found.
"""
import argparse
import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist

STEPS = 3


def apply_fix():
    """The proposed fix, monkeypatched: FlatParamHandle.prepare_gradient_for_optim first casts a
    low-precision _cpu_grad back to the param dtype."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    original = FlatParamHandle.prepare_gradient_for_optim

    def prepare_gradient_for_optim(self):
        flat_param = self.flat_param
        cpu_grad = getattr(flat_param, "_cpu_grad", None)
        if cpu_grad is not None and cpu_grad.dtype != flat_param._local_shard.dtype:
            cpu_grad.data = cpu_grad.to(flat_param._local_shard.dtype)
        original(self)

    FlatParamHandle.prepare_gradient_for_optim = prepare_gradient_for_optim


def train(set_to_none: bool) -> str:
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    device, fp16 = torch.device("cuda", 0), torch.float16
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(device),
                 device_id=device, cpu_offload=CPUOffload(offload_params=True),
                 mixed_precision=MixedPrecision(param_dtype=fp16, reduce_dtype=fp16, keep_low_precision_grads=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)  # foreach refuses fp16 grads of fp32 params
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        loss = model(torch.randn(4, 8, device=device, dtype=fp16)).float().pow(2).mean()
        try:
            loss.backward()
        except RuntimeError as exc:
            if "attempting to assign a gradient" not in str(exc):
                raise
            return f"the backward of step {step} raised RuntimeError: {str(exc).strip().splitlines()[0]}"
        opt.step()
    grads = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    return f"{STEPS} steps trained (grads {', '.join(grads)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    out = {mode: train(mode) for mode in (True, False)}
    dist.destroy_process_group()
    print(f"observed: zero_grad(set_to_none=True): {out[True]}; zero_grad(set_to_none=False): {out[False]}")
    print(f"expected: {STEPS} steps train in both zero_grad modes")
    return 1 if any("raised" in story for story in out.values()) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown, which FSDP processes sometimes abort in
