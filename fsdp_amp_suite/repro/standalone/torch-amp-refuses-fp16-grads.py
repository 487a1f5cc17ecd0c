"""torch.amp.GradScaler refuses the fp16 grads of FSDP mixed precision ("Attempting to unscale FP16 gradients.")

torch.amp.GradScaler.unscale_ calls _unscale_grads_(..., allow_fp16=False) and raises for any fp16 grad.
That is by design (fp32 master params), but FSDP mixed precision hands the scaler fp16 grads where it does
not upcast them: FSDP1 MixedPrecision(keep_low_precision_grads=True), fairscale FSDP mixed_precision without
offload at world size 1. The sharded scalers pass allow_fp16=True. Here: FSDP1 keep_low_precision_grads on
CPU (a 1-rank gloo group), one clean step. Seen on torch 2.13.0 CPU.

    python torch-amp-refuses-fp16-grads.py

Exit status: 1 while the behaviour is present, 0 once fp16 grads are unscaled, 77 where this machine cannot
run it.

Root cause: torch/amp/grad_scaler.py, `GradScaler.unscale_`: it passes allow_fp16=False to
`_unscale_grads_`, which raises ValueError for a grad of dtype float16 (ShardedGradScaler.unscale_ in
torch/distributed/fsdp/sharded_grad_scaler.py passes True, and the unscale kernel handles fp16).

Fix: none proposed (by design); a user with fp16 grads needs ShardedGradScaler or an fp32 copy of the grads.

Related: fairscale#834 (the same error under fairscale FSDP; fairscale PR #831 fixed fairscale's own scaler);
pytorch PR #116054 discusses the allow_fp16 default.
"""
import argparse
import datetime
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    fp16 = torch.float16
    model = FSDP(torch.nn.Linear(4, 2), device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=fp16, reduce_dtype=fp16, keep_low_precision_grads=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(model(torch.ones(3, 4)).float().sum()).backward()
    (flat,) = list(model.parameters())
    before, grad_dtype = flat.detach().clone(), flat.grad.dtype
    try:
        scaler.step(opt)
        scaler.update()
        observed, bug = f"stepped {not torch.equal(before, flat.detach())}, scale {scaler.get_scale()}", False
    except ValueError as exc:
        observed, bug = f"raised ValueError: {str(exc).strip().splitlines()[-1]}", True
    dist.destroy_process_group()
    print(f"observed: FSDP1 keep_low_precision_grads, one clean step with {grad_dtype} grads: {observed}")
    print("expected: the fp16 grads are unscaled and the step applies (as with allow_fp16=True)")
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
