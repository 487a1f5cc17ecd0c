"""GradScaler + DTensor: found_inf is reduced only along the mesh dims where the FIRST grad is sharded

torch.amp.GradScaler relies on DTensor to agree on found_inf across ranks. DTensor's handler for
_amp_foreach_non_finite_check_and_unscale_ reduces found_inf only along the mesh dims where the first grad of
the list is sharded. With a TP-replicated param first (a bias or norm: the no-decay group, as many trainers
build it), an inf in one TP rank's shard is not seen by the other TP ranks: they step while it skips, and
the ranks' params and scales diverge. Under FSDP2 HSDP every grad is (Replicate(), Shard(0)), so an inf
present in one replica only makes that replica alone skip. Seen on torch 2.13.0 and 2.11.0 (4 gloo
ranks on CPU).

    python dtensor-found-inf-first-grad-placements.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/distributed/tensor/_dispatch.py, `found_inf_reduce_handler`: it takes the placements and
mesh of args[0][0] only and builds found_inf's placements from them, Partial("max") where that grad is
sharded and Replicate() where it is replicated, then calls full_tensor(). A Replicate() dim is never
reduced, although other grads of the list (or of the job) are sharded along it, or (HSDP) hold an inf
that the other replica never had. The ordering of optimizer params silently decides the agreement.

Fix: reduce found_inf (MAX) along every dim of every distinct mesh among the grads, not only along the
first grad's sharded dims. This adds one scalar all-reduce per mesh dim that was replicated before (for
HSDP: one over the replicate dim) per unscale call. --with-fix monkeypatches the handler.

Related: pytorch PR #132816 "Gradient scaler for DTensor" (where the handler came from; upstream's FSDP2
test test_fully_shard_grad_scaler.py injects the inf only into params[0], a TP-sharded param); #120003
(DTensor-based sharded grad scaler design); #98860 (Sharded Grad Scaler tracker).
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

try:  # torch < 2.5 keeps DTensor private (torch.distributed._tensor) and has no public fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError as exc:
    print(f"skip: needs torch >= 2.5 (the public DTensor API): {exc}")
    sys.exit(77)


def apply_fix():
    """The proposed fix, monkeypatched: found_inf_reduce_handler reduces over every dim of every grad mesh."""
    from torch.distributed.tensor import _dispatch
    from torch.utils import _pytree as pytree

    def found_inf_reduce_handler(op_call, args, kwargs):
        op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        local_args = pytree.tree_unflatten(op_info.local_args, op_info.args_tree_spec)
        op_call(*local_args, **op_info.local_kwargs)
        meshes = []
        for grad in args[0]:
            if grad.device_mesh not in meshes:
                meshes.append(grad.device_mesh)
        for mesh in meshes:
            if mesh.get_coordinate() is not None:  # this rank is in that (sub-)mesh
                for dim in range(mesh.ndim):
                    dist.all_reduce(args[1], op=dist.ReduceOp.MAX, group=mesh.get_group(dim))

    _dispatch.found_inf_reduce_handler = found_inf_reduce_handler
    op = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
    DTensor._op_dispatcher._custom_op_handlers[op] = found_inf_reduce_handler


def tp_replicated_first(mesh, rank):
    """(dp, tp) mesh: a TP-replicated norm first in the optimizer, an inf in rank 1's shard of a TP-sharded weight."""
    norm = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Shard(0), Replicate()], run_check=False))
    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0), Shard(1)], run_check=False))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones(()))  # the scale would come from the loss; grads below are set as c * scale
    norm.grad = DTensor.from_local(torch.full((2,), 256.0), mesh, [Shard(0), Replicate()], run_check=False)
    local = torch.full((2, 2), 256.0)
    if rank == 1:
        local[0, 0] = math.inf
    weight.grad = DTensor.from_local(local, mesh, [Shard(0), Shard(1)], run_check=False)
    scaler.step(torch.optim.SGD([norm, weight], lr=0.5))  # the no-decay param first
    scaler.update()
    return not torch.equal(weight.to_local(), torch.ones(2, 2))


def hsdp_one_replica(mesh, rank):
    """(replicate, shard) mesh, every grad (Replicate(), Shard(0)) as FSDP2 HSDP places it: an inf on rank 3 only."""
    hsdp = [Replicate(), Shard(0)]
    params = [torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, hsdp, run_check=False)) for _ in range(2)]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones(()))
    for i, p in enumerate(params):
        local = torch.full((2,), 256.0)
        if rank == 3 and i == 1:
            local[0] = math.inf
        p.grad = DTensor.from_local(local, mesh, hsdp, run_check=False)
    scaler.step(torch.optim.SGD(params, lr=0.5))
    scaler.update()
    return not torch.equal(params[0].to_local(), torch.ones(2))


def tp_real_overflow(mesh, rank):
    """FSDP2 over dp, Colwise/Rowwise TP over tp, fp16 autocast: the backward overflows in tp rank 1's rows only."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[1].weight.fill_(0.01)
        model[1].weight[:, 2:] = 100.0  # hidden units 2, 3 (tp rank 1's rows of model[0]) weigh a lot
        model[1].bias.zero_()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    groups = [{"params": [model[1].bias], "weight_decay": 0.0},  # no-decay group first (TP-replicated bias)
              {"params": [model[0].weight, model[1].weight], "weight_decay": 0.01}]
    opt = torch.optim.SGD(groups, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with torch.autocast("cpu", dtype=torch.float16):
        y = model(torch.ones(2, 4))
    scaler.scale(y.float().sum()).backward()  # grad of hidden units 2, 3: 1024 * 4 * 100 > fp16 max
    before = model[0].weight.to_local().clone()
    scaler.step(opt)
    scaler.update()
    return not torch.equal(model[0].weight.to_local(), before)


def _rank(rank, world, store_path, out, real_overflow):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    if real_overflow:
        result = {"tp": tp_real_overflow(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), rank)}
    else:
        result = {"tp": tp_replicated_first(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), rank),
                  "hsdp": hsdp_one_replica(init_device_mesh("cpu", (2, 2),
                                                            mesh_dim_names=("replicate", "shard")), rank)}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    os._exit(0)


def run_ranks(world, real_overflow):
    with tempfile.TemporaryDirectory() as out:
        # the ranks meet through a file, not a port that another process could take before they bind it
        store_path = os.path.join(out, "store")
        mp.start_processes(_rank, args=(world, store_path, out, real_overflow), nprocs=world, start_method="fork")
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    parser.add_argument("--real-overflow", action="store_true",
                        help="FSDP2 x tensor parallel model whose fp16 backward overflows on one TP rank")
    args = parser.parse_args()
    if args.with_fix:
        apply_fix()
    results = run_ranks(4, args.real_overflow)
    labels = {"tp": "TP-replicated param first, inf on tp rank 1" + (" (real fp16 overflow)"
                                                                     if args.real_overflow else ""),
              "hsdp": "HSDP, inf in replica 1 only"}
    bug = False
    for key, label in labels.items():
        if key not in results[0]:
            continue
        stepped = [r[key] for r in results]
        bug |= any(stepped)
        print(f"observed: {label}: stepped per rank {stepped}")
        print(f"expected: {label}: every rank skips [False, False, False, False]")
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
