"""fairscale FSDP(mixed_precision=True) at world size 1 leaves fp16 grads on the fp32 params

fairscale's FullyShardedDataParallel with mixed_precision=True and no CPU offload, at world size 1, hands
the optimizer fp32 params whose grads are still in the compute dtype (fp16 or bf16). A foreach optimizer
then rejects them: with flatten_parameters=False, SGD with momentum raises "Tensors of the same index must be
on the same device and the same dtype" inside fairscale's own ShardedGradScaler.step (fused AdamW rejects
them alike; torch.amp.GradScaler already refuses fp16 grads). An FSDP bug, not a scaler's: with
cpu_offload=True, or at world size 2, the grads are fp32. Needs CUDA; seen with fairscale 0.4.13 on torch
2.11 with an H100.

    python fairscale-fsdp-mixed-precision-grads.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/nn/data_parallel/fully_sharded_data_parallel.py, `_post_backward_hook`: at world size 1
(an unsharded param) it calls `self._post_reduction_hook(param, param.grad.data)`, and
`_post_reduction_hook` casts with `reduced_grad.data = reduced_grad.data.to(dtype=param.data.dtype)`, which
rebinds the data of the `.data` alias it was given, not of param.grad: the cast grad is dropped and
param.grad stays fp16 (after a reduce-scatter the cast lands in `_saved_grad_shard`, which becomes the grad).

Fix: pass the grad itself, `self._post_reduction_hook(param, param.grad)`, so the cast rebinds param.grad's
data. --with-fix wraps `_post_reduction_hook` to hand the cast grad to param.grad for an unsharded param,
which is the same.

Related: none found.
"""
import argparse
import sys
import warnings

import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.optim.grad_scaler import ShardedGradScaler


def apply_fix():
    """The proposed fix, monkeypatched: an unsharded param (world size 1) gets the grad cast to its dtype."""
    original = FSDP._post_reduction_hook

    def _post_reduction_hook(self, param, reduced_grad):
        original(self, param, reduced_grad)
        if not param._is_sharded and param.grad is not None:
            param.grad.data = reduced_grad.data  # the cast grad, which the original bound to an alias only

    FSDP._post_reduction_hook = _post_reduction_hook


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
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    gpu = torch.device("cuda", 0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(gpu)
    model = FSDP(module, mixed_precision=True, compute_dtype=torch.float16, flatten_parameters=False,
                 cpu_offload=False, move_grads_to_cpu=False, compute_device=gpu)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # foreach on CUDA
    scaler = ShardedGradScaler(init_scale=2.0**10)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(4, 8, device=gpu)).float().pow(2).mean()).backward()
    dtypes = sorted({f"{p.grad.dtype} grads on {p.dtype} params" for p in model.parameters()})
    try:
        scaler.step(opt)
        scaler.update()
        step = f"stepped {any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))}"
    except RuntimeError as exc:
        step = f"step() raised RuntimeError: {str(exc).splitlines()[0]}"
    dist.destroy_process_group()
    print(f"observed: FSDP(mixed_precision=True, flatten_parameters=False), world size 1: {', '.join(dtypes)}; {step}")
    print("expected: torch.float32 grads on torch.float32 params; stepped True")
    return 1 if dtypes != ["torch.float32 grads on torch.float32 params"] or step != "stepped True" else 0


if __name__ == "__main__":
    sys.exit(main())
