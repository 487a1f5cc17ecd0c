"""ShardedGradScaler: unscale_ then step() with a fused AdamW raises (found_inf has shape [1])

torch.distributed.fsdp.ShardedGradScaler with AdamW(fused=True) on the clipping path (unscale_,
clip_grad_norm_, step): GradScaler.step hands the optimizer ShardedGradScaler's found_inf, made with
torch.full((1,), ...), and the fused step's `_foreach_sub_` of found_inf from its shape-[] step counters
raises. No overflow is needed: every step after an explicit unscale_ raises, the first one included, so
FSDP training that clips grads cannot use a fused Adam, AdamW or Adagrad (Adagrad from torch 2.12) with
this scaler. One gloo rank on CPU; seen on torch 2.13.0 CPU and torch 2.11 CUDA.

    python torch-sharded-fused-adamw-after-unscale.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/distributed/fsdp/sharded_grad_scaler.py, `ShardedGradScaler.unscale_`: it creates
found_inf as `torch.full((1,), 0.0, ...)` (GradScaler.unscale_ and `_check_inf_per_device` use shape
`()`). GradScaler.step's `_step_supports_amp_scaling` branch (torch/amp/grad_scaler.py) sets
`optimizer.found_inf` to it, and torch/optim/adam.py `_fused_adam` ends with
`torch._foreach_sub_(device_state_steps, [device_found_inf] * ...)`, which cannot write a shape-[1]
result into a shape-[] step counter (the update itself has already been applied by then).

Fix: create found_inf with `torch.full((), 0.0, ...)` in `ShardedGradScaler.unscale_`, as GradScaler
does (all_reduce and update() work on 0-dim tensors). --with-fix wraps unscale_ and makes each
found_inf 0-dim.

Related: pytorch#140514 "Error with fused AdamW" (open; a maintainer says found_inf should be 0-dim);
pytorch PR #116054 (consolidates ShardedGradScaler with GradScaler, 0-dim found_inf; closed unmerged).
"""
import argparse
import datetime
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def apply_fix():
    """The proposed fix, monkeypatched: ShardedGradScaler.unscale_ leaves a 0-dim found_inf."""
    original = ShardedGradScaler.unscale_

    def unscale_(self, optimizer):
        original(self, optimizer)
        if self._enabled:
            state = self._per_optimizer_states[id(optimizer)]
            state["found_inf_per_device"] = {d: t.reshape(()) for d, t in state["found_inf_per_device"].items()}

    ShardedGradScaler.unscale_ = unscale_


def clean_step_after_unscale():
    """One clean step (no inf anywhere): unscale_, clip_grad_norm_, step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    try:
        scaler.step(opt)
    except RuntimeError as e:
        return f"raised RuntimeError: {str(e).strip().splitlines()[-1]}", False
    scaler.update()
    steps = [opt.state[p]["step"].item() for p in model.parameters()]
    return f"stepped; step counters {steps}", steps == [1.0, 1.0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    if args.with_fix:
        apply_fix()
    got, ok = clean_step_after_unscale()
    dist.destroy_process_group()
    print(f"observed: a clean step, unscale_ -> clip_grad_norm_ -> step(): {got}")
    print("expected: stepped; step counters [1.0, 1.0]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
