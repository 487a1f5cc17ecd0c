"""torch.amp.GradScaler with sharded grads (FSDP1): an inf in one rank's shard makes only that rank skip and back off

torch.amp.GradScaler checks only the grads its own rank holds and never all-reduces found_inf. Under DDP
that suffices (every rank holds the same all-reduced grads); under FSDP1 or fairscale FSDP each rank holds
a different shard, so one rank skips the step and halves its scale while the others step: params and
scales diverge for good. By design (ShardedGradScaler exists for this), but it is the scaler many FSDP
users reach for. Seen on torch 2.13.0 CPU (2 gloo ranks) and torch 2.11 CUDA.

    python torch-amp-not-shard-aware.py [--real-overflow]

Exit status: 1 while the behaviour is present, 0 once the ranks agree, 77 where this machine cannot run it.

Root cause: torch/amp/grad_scaler.py, `GradScaler.unscale_`/`_unscale_grads_`: found_inf is computed from
the local grads only, and no collective makes the ranks agree (ShardedGradScaler.unscale_ in
torch/distributed/fsdp/sharded_grad_scaler.py all-reduces it). FSDP2 hides this: DTensor's handler for
_amp_foreach_non_finite_check_and_unscale_ all-reduces found_inf over the mesh.

Fix: none proposed (by design): use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler.

Related: fairscale#180 and fairscale PR #181 (why shard-aware scalers exist).
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


def inf_in_rank1_grad():
    """Each rank holds its own shard of the params (as FSDP does); rank 1's grad gets an inf."""
    rank = dist.get_rank()
    shard = torch.nn.Parameter(torch.arange(4.0) + 4 * rank)
    opt = torch.optim.SGD([shard], lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale((shard * 0.25).sum()).backward()
    if rank == 1:
        shard.grad[2] = math.inf
    before = shard.detach().clone()
    scaler.step(opt)
    scaler.update()
    return dict(stepped=not torch.equal(before, shard.detach()), scale=scaler.get_scale())


def fsdp1_fp16_overflow():
    """FSDP1 fp16 mixed precision, a bias-free Linear(4, 2) whose flat param (8 elements) is split row by row:
    rank 0 owns weight row 0, rank 1 row 1. The loss weighs output 1 by 2**7, so at scale 2**10 its fp16
    grad (2**17) overflows in the backward; after the reduce-scatter only rank 1 holds the inf."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

    torch.manual_seed(0)
    fp16 = torch.float16
    model = FSDP(torch.nn.Linear(4, 2, bias=False), device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=fp16, reduce_dtype=fp16, buffer_dtype=fp16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # grads are upcast to fp32: accepted
    out = model(torch.full((1, 4), 0.5))
    loss = (out.float() * torch.tensor([1.0, 2.0**7])).sum()
    scaler.scale(loss).backward()
    (flat,) = list(model.parameters())
    before = flat.detach().clone()
    shard_finite = bool(flat.grad.isfinite().all())
    scaler.step(opt)
    scaler.update()
    return dict(stepped=not torch.equal(before, flat.detach()), scale=scaler.get_scale(), finite=shard_finite)


def _rank(rank, world, store_path, out, real):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    result = fsdp1_fp16_overflow() if real else inf_in_rank1_grad()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    os._exit(0)  # gloo ranks that ran FSDP sometimes abort at interpreter exit otherwise


def run_ranks(world, real):
    with tempfile.TemporaryDirectory() as out:
        # the ranks meet through a file, not a port that another process could take before they bind it
        store_path = os.path.join(out, "store")
        mp.start_processes(_rank, args=(world, store_path, out, real), nprocs=world, start_method="fork")
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-overflow", action="store_true",
                        help="FSDP1 fp16 training whose backward overflows in rank 1's shard only")
    args = parser.parse_args()
    out = run_ranks(2, args.real_overflow)
    stepped, scales = [o["stepped"] for o in out], [o["scale"] for o in out]
    where = ("FSDP1 fp16, the backward overflowed in one weight row: grad shard finite per rank "
             f"{[o['finite'] for o in out]}" if args.real_overflow else "an inf in rank 1's grad only")
    init = 2.0**10 if args.real_overflow else 256.0
    print(f"observed: {where}: stepped per rank {stepped}, scale per rank {scales}")
    print(f"expected: every rank skips and backs off: stepped [False, False], scale [{init / 2}, {init / 2}]")
    return 1 if stepped != [False, False] or scales != [init / 2] * 2 else 0


if __name__ == "__main__":
    sys.exit(main())
