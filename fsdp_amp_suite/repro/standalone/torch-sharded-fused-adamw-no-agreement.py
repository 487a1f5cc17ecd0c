"""ShardedGradScaler + fused AdamW: an inf in one rank's shard makes only that rank skip the step

torch.distributed.fsdp.ShardedGradScaler with AdamW(fused=True) and no explicit unscale_: step() takes
GradScaler's fused-optimizer path, which looks for infs with `_check_inf_per_device` and never reaches
the all_reduce in ShardedGradScaler.unscale_. Under FSDP1 each rank checks only its own grad shard, so
when one shard overflows that rank skips the step and backs its scale off while the others step: the
ranks' params, optimizer states and scales diverge silently. 2 gloo ranks on CPU; seen on torch 2.13.0
CPU and torch 2.11 CUDA.

    python torch-sharded-fused-adamw-no-agreement.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/amp/grad_scaler.py, `GradScaler.step`: for an optimizer with
`_step_supports_amp_scaling` it calls `self._check_inf_per_device(optimizer)` (stage READY), which calls
`self._unscale_grads_` with a dummy inv_scale; torch/distributed/fsdp/sharded_grad_scaler.py,
`ShardedGradScaler`, overrides `_unscale_grads_` and `unscale_` (where the found_inf all_reduce is) but
not `_check_inf_per_device`, so on this path found_inf stays per rank. (FSDP2 on one flat mesh hides it:
DTensor's handler for `_amp_foreach_non_finite_check_and_unscale_` reduces found_inf over the mesh.)

Fix: override `_check_inf_per_device` in ShardedGradScaler to all-reduce each found_inf over
`self.process_group` with ReduceOp.MAX, as unscale_ does (a CPU found_inf goes through the scaler's
device for NCCL, as there). This adds to the fused path the one collective that the unfused path already
has; no host sync. --with-fix monkeypatches that (gloo, CPU found_inf).

Related: pytorch#140514 "Error with fused AdamW" (open; the same fused path of ShardedGradScaler); none
found for the missing agreement.
"""
import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.amp.grad_scaler import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

# before 2.6, ShardedGradScaler unscales CPU grads in Python and hands a fused optimizer a found_inf of shape [1]:
# the step raises on that shape before the agreement this file shows can be checked
if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    print(f"skip: needs torch >= 2.6 (on {torch.__version__} a fused step raises first on found_inf's shape [1])")
    sys.exit(77)


def apply_fix():
    """The proposed fix, monkeypatched: ShardedGradScaler._check_inf_per_device agrees across ranks."""
    def _check_inf_per_device(self, optimizer):
        found_inf_per_device = GradScaler._check_inf_per_device(self, optimizer)
        for found_inf in found_inf_per_device.values():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.process_group)
        return found_inf_per_device

    ShardedGradScaler._check_inf_per_device = _check_inf_per_device


def written_inf(rank):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    if rank == 1:
        model.weight.grad[0, 0] = math.inf  # as if only this rank's shard overflowed
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    return {"stepped": not torch.equal(before, model.weight), "scale": scaler.get_scale()}


def real_overflow(rank):
    """FSDP1, fp16 params and reduction, Linear(4, 4, bias=False): the flat param's 16 elements are split
    8 / 8, so output unit 3's weight row lies in rank 1's shard. The loss weighs unit 3 by 100: at scale
    2**10 its d loss/d out (102400) is inf in fp16, the other units' (1024) are not."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
    torch.manual_seed(0)
    model = FSDP(torch.nn.Linear(4, 4, bias=False), device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10)
    out = model(torch.full((1, 4), 0.25)).float()
    scaler.scale((out * torch.tensor([1.0, 1.0, 1.0, 100.0])).sum()).backward()
    shard_overflowed = not all(p.grad.isfinite().all() for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    stepped = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    return {"shard overflowed": shard_overflowed, "stepped": stepped, "scale": scaler.get_scale()}


def _rank(rank, world, store_path, out, args):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    if args.with_fix:
        apply_fix()
    result = real_overflow(rank) if args.real_overflow else written_inf(rank)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    os._exit(0)  # gloo ranks that ran FSDP sometimes abort at interpreter exit otherwise


def run_ranks(world, args):
    with tempfile.TemporaryDirectory() as out:
        # the ranks meet through a file, not a port that another process could take before they bind it
        store_path = os.path.join(out, "store")
        mp.start_processes(_rank, args=(world, store_path, out, args), nprocs=world, start_method="fork")
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    parser.add_argument("--real-overflow", action="store_true",
                        help="FSDP1 fp16 on 2 ranks whose scaled backward overflows in rank 1's shard only")
    args = parser.parse_args()
    got = run_ranks(2, args)
    stepped = [r["stepped"] for r in got]
    print(f"observed: per rank: {got}")
    print("expected: every rank skips the step and backs off alike: stepped [False, False], scales equal")
    return 0 if stepped == [False, False] and got[0]["scale"] == got[1]["scale"] else 1


if __name__ == "__main__":
    sys.exit(main())
