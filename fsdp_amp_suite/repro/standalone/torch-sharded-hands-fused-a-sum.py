"""ShardedGradScaler hands a fused optimizer found_inf summed over ranks (2.0), and the step is applied

torch.distributed.fsdp.ShardedGradScaler.unscale_ (the clipping path: unscale_, clip, step) all-reduces
found_inf with the default ReduceOp.SUM. GradScaler.step then hands that value to an optimizer with
_step_supports_amp_scaling (Adam, AdamW, SGD, Adagrad with fused=True), whose kernels skip the update
only when found_inf == 1.0 exactly. When two ranks overflow the optimizer gets 2.0 and applies the inf/NaN
update, while update() backs the scale off as for a skipped step. 2 gloo ranks on CPU; seen on torch 2.13.0.

    python torch-sharded-hands-fused-a-sum.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/distributed/fsdp/sharded_grad_scaler.py, `ShardedGradScaler.unscale_`: each
`dist.all_reduce(found_inf, ...)` uses the default SUM, so found_inf counts the overflowing ranks;
torch/amp/grad_scaler.py, `GradScaler.step` (its `_step_supports_amp_scaling` branch) passes that count
(summed again over devices) to the optimizer as `optimizer.found_inf`; the fused kernels (e.g.
`_fused_sgd_`, `_fused_adam_`) return early only on `*found_inf == 1`. Fused Adam, AdamW and Adagrad
crash first after unscale_ (found_inf has shape [1], a separate report), fused SGD steps on NaN.

Fix: all-reduce with `op=dist.ReduceOp.MAX` in `ShardedGradScaler.unscale_`, so found_inf stays a 0/1
flag (no new collective; update() is unaffected, it tests >= 1). Clamping the sum to 1 in
GradScaler.step's fused branch would also cover grads on several devices, summed there. --with-fix wraps
unscale_ and clamps each reduced found_inf to at most 1, which is what MAX gives for 0/1 flags.

Related: pytorch#140514 "Error with fused AdamW" (open; the shape side of the same path); pytorch PR
#97415 (found_inf for fused optimizers), backed out by #98613 / #98624.
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
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

C = torch.tensor([0.25, 0.5, -1.0])  # the exact grad of w in loss = <w, C>


def apply_fix():
    """The proposed fix, monkeypatched: ShardedGradScaler.unscale_'s reduced found_inf is a 0/1 flag (MAX)."""
    original = ShardedGradScaler.unscale_

    def unscale_(self, optimizer):
        original(self, optimizer)
        if self._enabled:
            for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                found_inf.clamp_(max=1.0)  # == all_reduce(op=MAX) for 0/1 flags

    ShardedGradScaler.unscale_ = unscale_


def written_inf(rank):
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
    opt = torch.optim.SGD([w], lr=0.5, fused=True)  # no momentum: only the found_inf value matters
    scaler = ShardedGradScaler(device="cpu", init_scale=256.0)
    scaler.scale((w * C).sum()).backward()
    w.grad[rank] = math.inf  # each rank's grad overflows
    scaler.unscale_(opt)  # the clipping path
    found_inf = _found_inf(scaler, opt)
    scaler.step(opt)
    scaler.update()
    return {"found_inf": found_inf, "params": w.detach().tolist()}


def _found_inf(scaler, opt):
    return sum(t.item() for t in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())


def real_overflow(rank):
    """FSDP1, fp16 params and reduction: at the default init_scale d loss/d out = 2**16 is inf in fp16, so
    the grad of every element, hence both ranks' shards, overflows; unscale_, clip, then step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
    torch.manual_seed(0)
    model = FSDP(torch.nn.Linear(4, 4, bias=False), device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    scaler = ShardedGradScaler(device="cpu")  # init_scale 2**16
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.full((1, 4), 0.25)).float().sum()).backward()
    shard_overflowed = not all(p.grad.isfinite().all() for p in model.parameters())
    scaler.unscale_(opt)
    found_inf = _found_inf(scaler, opt)
    model.clip_grad_norm_(1.0)
    scaler.step(opt)
    scaler.update()
    changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    finite = all(p.isfinite().all() for p in model.parameters())
    return {"shard overflowed": shard_overflowed, "found_inf": found_inf, "params changed": changed,
            "params finite": bool(finite)}


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
                        help="FSDP1 fp16 on 2 ranks whose scaled backward overflows on both ranks' shards")
    args = parser.parse_args()
    got = run_ranks(2, args)
    if args.real_overflow:
        want = {"shard overflowed": True, "found_inf": 1.0, "params changed": False, "params finite": True}
        print(f"observed: per rank after unscale_, clip, step: {got}")
        print(f"expected: {[want, want]} (the step skipped on every rank)")
        return 0 if got == [want, want] else 1
    want = {"found_inf": 1.0, "params": [0.5, -0.25, 1.0]}
    print(f"observed: per rank after unscale_ and step: {got}")
    print(f"expected: {[want, want]} (the step skipped on every rank)")
    return 0 if got == [want, want] else 1


if __name__ == "__main__":
    sys.exit(main())
