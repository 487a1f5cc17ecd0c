"""fairscale ShardedGradScaler with CPU DTensor grads: found_inf is never agreed; only the rank whose shard overflowed skips

fairscale's ShardedGradScaler predates DTensor. With DTensor grads on CPU (FSDP2 or tensor parallelism on a
CPU mesh, e.g. for CPU training or offload) it checks each rank's local shard in a Python loop and
all-reduces the CPU found_inf on a CUDA copy whose result it drops. An inf or NaN in one rank's shard makes
that rank alone skip and back off while the others step: params and scales diverge across ranks. Needs
CUDA (without it fairscale disables itself); the grads and the mesh are on CPU. Seen with fairscale 0.4.13
on torch 2.11 with an H100 (2 gloo ranks sharing the GPU).

    python fairscale-cpu-found-inf-not-agreed-dtensor.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `ShardedGradScaler.unscale_`: for a found_inf on CPU it runs
`v_on_cuda = v.cuda(); dist.all_reduce(v_on_cuda, async_op=True, group=self.group); v_on_cuda.cpu()`, and
the reduced value is never written back into v. `_foreach_non_finite_check_and_unscale_cpu_` sees only the
local shard of a DTensor grad (isinf(grad).any() is a Partial DTensor whose .item() reads the local value),
so nothing else agrees on it either.

Fix: write the reduced value back, `v.copy_(v_on_cuda)` once the all-reduce is done (the fix torch's own
ShardedGradScaler made); this needs the host sync the wait already does. --with-fix monkeypatches
ShardedGradScaler.unscale_ with that write-back.

Related: none found for DTensor grads (fairscale 0.4.13, its last release, predates DTensor); the same drop
with plain CPU grads is the fairscale-cpu-found-inf-not-agreed report.
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


def apply_fix():
    """The proposed fix, monkeypatched: ShardedGradScaler.unscale_ writes the reduced CPU found_inf back."""
    from fairscale.optim.grad_scaler import OptState, ShardedGradScaler

    def unscale_(self, optimizer):
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            raise RuntimeError("unscale_() already called, or called after step(), since the last update().")
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((1,), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["stage"] = OptState.UNSCALED
        for v in state["found_inf_per_device"].values():
            if v.device.type == "cpu":
                v_on_cuda = v.cuda()
                dist.all_reduce(v_on_cuda, group=self.group)
                v.copy_(v_on_cuda.cpu())  # the write-back fairscale lacks
            else:
                dist.all_reduce(v, group=self.group)

    ShardedGradScaler.unscale_ = unscale_


def injected(mesh, rank):
    """A Shard(0) DTensor grad on a CPU mesh, as FSDP2 places it; an inf in rank 1's shard only."""
    from fairscale.optim.grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor, Shard

    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False))
    scaler = ShardedGradScaler(init_scale=256.0)
    scaler.scale(torch.ones(()))  # the scale lives on CPU, as the loss does; grads below are c * scale
    local = torch.full((2,), 256.0)
    if rank == 1:
        local[0] = math.inf
    weight.grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    scaler.step(torch.optim.SGD([weight], lr=0.5))
    scaler.update()
    return {"stepped": not torch.equal(weight.to_local(), torch.ones(2)), "scale": float(scaler.get_scale())}


def real_overflow(mesh, rank):
    """FSDP2 on the CPU mesh, fp16 autocast: the backward overflows in rows 2, 3 of the first weight (rank 1's
    shard)."""
    from fairscale.optim.grad_scaler import ShardedGradScaler
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[1].weight.fill_(0.01)
        model[1].weight[:, 2:] = 100.0  # hidden units 2, 3 weigh a lot: their grads overflow fp16
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=1024.0)
    with torch.autocast("cpu", dtype=torch.float16):
        y = model(torch.ones(2, 4))
    scaler.scale(y.float().sum()).backward()  # grad of hidden units 2, 3: 1024 * 4 * 100 > fp16 max
    before = model[1].weight.to_local().clone()
    scaler.step(opt)
    scaler.update()
    return {"stepped": not torch.equal(model[1].weight.to_local(), before), "scale": float(scaler.get_scale())}


def _rank(rank, world, store_path, out, args):
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (world,))
    result = (real_overflow if args.real_overflow else injected)(mesh, rank)
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
    parser.add_argument("--real-overflow", action="store_true",
                        help="FSDP2 model whose fp16 backward overflows in one rank's shard")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    results = run_ranks(2, args)
    want = [{"stepped": False, "scale": 128.0 if not args.real_overflow else 512.0}] * 2
    print(f"observed: per rank {results}")
    print(f"expected: every rank skips and backs off once: {want}")
    return 0 if results == want else 1


if __name__ == "__main__":
    sys.exit(main())
