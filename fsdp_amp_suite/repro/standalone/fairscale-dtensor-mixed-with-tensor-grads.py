"""fairscale ShardedGradScaler.step raises "got mixed torch.Tensor and DTensor" for CUDA DTensor and plain params in one optimizer

An optimizer holding DTensor params (FSDP2, tensor parallelism) and plain tensor params on CUDA, as a model
only partly under FSDP2 or TP gives, makes fairscale's ShardedGradScaler raise on every step, with or
without an overflow. Needs CUDA; seen with fairscale 0.4.13 on torch 2.11 with an H100 (2 gloo ranks
sharing the GPU, a 1D CUDA mesh).

    python fairscale-dtensor-mixed-with-tensor-grads.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `ShardedGradScaler._unscale_grads_`: it groups grads by device
and dtype only and unscales each CUDA group with one torch._amp_foreach_non_finite_check_and_unscale_
call, which DTensor dispatch refuses for a list mixing DTensor and torch.Tensor ("got mixed torch.Tensor
and DTensor"). Its CPU grads go through a per-tensor Python loop, which does not raise. torch's own
GradScaler and ShardedGradScaler group the same way and raise the same error.

Fix: group by (device, dtype, is-DTensor), so DTensor and plain grads go to separate kernel calls that
accumulate into the same per-device found_inf. --with-fix monkeypatches _unscale_grads_ with that grouping;
no new host sync or collective.
The default foreach SGD step on CUDA then raises the same error in its own _foreach_add_ (torch.optim
groups by device and dtype too), so the repro uses foreach=False.

Related: pytorch #153354 (FSDP2 "got mixed torch.Tensor and DTensor"); torchtune PR #2687 (disables
foreach grad scaling under TP); fairscale 0.4.13, its last release, predates DTensor.
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


def apply_fix():
    """The proposed fix, monkeypatched: ShardedGradScaler._unscale_grads_ groups by (device, dtype, is DTensor)."""
    from fairscale.optim.grad_scaler import ShardedGradScaler, _GeneralMultiDeviceReplicator
    from torch.distributed.tensor import DTensor

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        per_device_inv_scale = _GeneralMultiDeviceReplicator(inv_scale)
        per_device_found_inf = _GeneralMultiDeviceReplicator(found_inf)
        groups = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad._values() if param.grad.is_sparse else param.grad
                    groups[(grad.device, grad.dtype, isinstance(grad, DTensor))].append(grad)
            for (device, _, _), grads in groups.items():
                unscale = (self._foreach_non_finite_check_and_unscale_cpu_ if device.type == "cpu"
                           else torch._amp_foreach_non_finite_check_and_unscale_)
                unscale(grads, per_device_found_inf.get(device), per_device_inv_scale.get(device))
        return per_device_found_inf._per_device_tensors

    ShardedGradScaler._unscale_grads_ = _unscale_grads_


def dtensor_and_plain():
    from fairscale.optim.grad_scaler import ShardedGradScaler
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    device = torch.device("cuda", 0)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    sharded = torch.nn.Parameter(DTensor.from_local(torch.ones(2, device=device), mesh, [Shard(0)], run_check=False))
    plain = torch.nn.Parameter(torch.ones(2, device=device))  # e.g. a param left out of FSDP2 / TP
    scaler = ShardedGradScaler(init_scale=256.0)
    scaler.scale(torch.ones((), device=device))  # grads below are c * scale, as a backward would give
    sharded.grad = DTensor.from_local(torch.full((2,), 256.0, device=device), mesh, [Shard(0)], run_check=False)
    plain.grad = torch.full((2,), 256.0, device=device)
    try:
        # foreach=False: on CUDA the default foreach SGD step raises the same error itself (_foreach_add_)
        scaler.step(torch.optim.SGD([sharded, plain], lr=0.5, foreach=False))
        scaler.update()
    except RuntimeError as e:
        if "got mixed torch.Tensor and DTensor" not in str(e):
            raise
        return f"raised RuntimeError: {str(e).strip().splitlines()[-1]}"
    return f"plain param after the step: {plain.detach().cpu().tolist()}"


def _rank(rank, world, store_path, out, args):
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    torch.cuda.set_device(0)  # the gloo ranks share one GPU
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    result = dtensor_and_plain()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    os._exit(0)


def run_ranks(world, args):
    with tempfile.TemporaryDirectory() as out:
        # the ranks meet through a file, not a port that another process could take before they bind it
        store_path = os.path.join(out, "store")
        mp.start_processes(_rank, args=(world, store_path, out, args), nprocs=world, start_method="forkserver")
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    results = run_ranks(2, args)
    want = "plain param after the step: [0.5, 0.5]"
    print(f"observed: every rank: {results[0]}" if len(set(results)) == 1 else f"observed: per rank: {results}")
    print(f"expected: every rank: {want}")
    return 0 if results == [want] * 2 else 1


if __name__ == "__main__":
    sys.exit(main())
