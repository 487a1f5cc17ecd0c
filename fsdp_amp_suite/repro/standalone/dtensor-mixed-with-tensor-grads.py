"""GradScaler.step raises "got mixed torch.Tensor and DTensor" for an optimizer holding DTensor and plain params

A model only partly under FSDP2 (fully_shard on a submodule, the root's own params left as plain tensors) or
only partly under tensor parallelism hands one optimizer DTensor params and plain params on the same device
and dtype. torch.amp.GradScaler.step (and unscale_) then raises on every step, with or without an overflow;
torch's ShardedGradScaler (torch/distributed/fsdp/sharded_grad_scaler.py) groups grads the same way and
raises the same error. Seen on torch 2.13.0 and 2.11.0 (2 gloo ranks, FSDP2 on a CPU mesh, fp16
autocast; on 2.11 also on a CUDA mesh).

    python dtensor-mixed-with-tensor-grads.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/amp/grad_scaler.py, `GradScaler._unscale_grads_`: it groups grads by device and dtype
only and unscales each group with one torch._amp_foreach_non_finite_check_and_unscale_ call. DTensor
dispatch refuses an op whose tensor list mixes DTensor and torch.Tensor, so the call raises
"aten._amp_foreach_non_finite_check_and_unscale_.default: got mixed torch.Tensor and DTensor".

Fix: group by (device, dtype, is-DTensor) so DTensor grads and plain grads go to separate kernel calls (the
same found_inf per device accumulates both; DTensor's handler agrees on it over the DTensor grads' mesh).
Grouping by mesh as well would keep grads on different (sub-)meshes apart. --with-fix monkeypatches
_unscale_grads_ with that grouping; no new host sync or collective.
A foreach optimizer step (the default on CUDA) raises the same error in its own _foreach_add_ on such
a param list (seen on torch 2.13 CPU with foreach=True and 2.11 CUDA), so the repro uses foreach=False.
Known workaround: wrapping scaler.step in torch.distributed.tensor.experimental.implicit_replication() makes
the repro exit 0 (the plain params are treated as replicated DTensors; checked on torch 2.13.0 CPU). A model
only partly under fully_shard may count as unsupported; the error says nothing of either.

Related: pytorch PR #134551 (implicit_replication extended to foreach ops, offered for optimizer.step() when
a 2-D model is only partly tensor-parallel: the same workaround); torchtune PR #2687 (disables foreach grad
scaling under TP); pytorch #153354 shows the same error message, from an activation-checkpoint recompute.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:  # torch < 2.5 keeps DTensor private (torch.distributed._tensor) and has no public fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
except ImportError as exc:
    print(f"skip: needs torch >= 2.5 (the public DTensor API): {exc}")
    sys.exit(77)


def apply_fix():
    """The proposed fix, monkeypatched: GradScaler._unscale_grads_ groups by (device, dtype, is DTensor)."""
    from torch.amp.grad_scaler import _MultiDeviceReplicator

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        groups = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if (not allow_fp16) and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grad = param.grad._values() if param.grad.is_sparse else param.grad
                    groups[(grad.device, grad.dtype, isinstance(grad, DTensor))].append(grad)
            for (device, _, _), grads in groups.items():
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, per_device_found_inf.get(device), per_device_inv_scale.get(device))
        return per_device_found_inf._per_device_tensors

    torch.amp.GradScaler._unscale_grads_ = _unscale_grads_


def train_step():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(model[0], mesh=mesh)  # only the body under FSDP2; the head's params stay plain tensors
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)  # on CUDA a foreach step raises too
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = model[1].weight.detach().clone()
    with torch.autocast("cpu", dtype=torch.float16):
        y = model(torch.ones(2, 4))
    scaler.scale(y.float().sum()).backward()
    try:
        scaler.step(opt)
        scaler.update()
    except RuntimeError as e:
        if "got mixed torch.Tensor and DTensor" not in str(e):
            raise
        return f"raised RuntimeError: {str(e).strip().splitlines()[-1]}"
    return "stepped" if not torch.equal(model[1].weight, before) else "skipped"


def _rank(rank, world, store_path, out):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    result = train_step()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    os._exit(0)


def run_ranks(world):
    with tempfile.TemporaryDirectory() as out:
        # the ranks meet through a file, not a port that another process could take before they bind it
        store_path = os.path.join(out, "store")
        mp.start_processes(_rank, args=(world, store_path, out), nprocs=world, start_method="fork")
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    if args.with_fix:
        apply_fix()
    results = run_ranks(2)
    shown = results[0] if len(set(results)) == 1 else results
    print(f"observed: every rank: {shown}" if shown is results[0] else f"observed: per rank: {shown}")
    print("expected: every rank: stepped (a clean step updates the plain and the DTensor params alike)")
    return 0 if results == ["stepped"] * 2 else 1


if __name__ == "__main__":
    sys.exit(main())
