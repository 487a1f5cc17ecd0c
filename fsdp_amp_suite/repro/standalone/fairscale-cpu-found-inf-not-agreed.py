"""fairscale ShardedGradScaler never agrees on an inf found in CPU grads: only the rank that saw it skips

With CPU grads (FSDP CPU offload) fairscale's scaler checks them into a CPU found_inf, all-reduces a CUDA
copy of it and throws the reduced copy away. An inf in one rank's grad shard then makes only that rank
skip the step and back off: the other ranks apply their shards of the overflowed step, and the ranks'
params and scales diverge from then on (per optimizer, and step after step). Needs CUDA (without it the
scaler disables itself); seen with fairscale 0.4.13 on torch 2.11 with an H100, 2 gloo ranks sharing it.

    python fairscale-cpu-found-inf-not-agreed.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `ShardedGradScaler.unscale_`: for a found_inf on CPU it runs
`v_on_cuda = v.cuda(); dist.all_reduce(v_on_cuda, async_op=True, group=self.group); v_on_cuda.cpu()`. The
result of `.cpu()` is discarded, so `v`, the found_inf that step() and update() read, keeps this rank's
own value.

Fix: copy the reduced value back into `v` once the all_reduce has finished (`v.copy_(v_on_cuda)` after
waiting on it), as torch's ShardedGradScaler does since pytorch PR #115710. --with-fix replaces `unscale_`
with a version that does so; the copy back is a device-to-host sync after a wait that exists already.

Related: fairscale issue #421 (FSDP CPU offload + ShardedGradScaler; the CPU path came with fairscale
PR #831); fairscale PR #890 (the CPU inf check looked only at the first grad); pytorch PR #76918 (torch's
ShardedGradScaler, copied from this code) and PR #115710 (its fix).
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
from fairscale.optim import grad_scaler as fs
from fairscale.optim.grad_scaler import ShardedGradScaler


def apply_fix():
    """The proposed fix, monkeypatched: unscale_ writes the all-reduced CPU found_inf back."""

    def unscale_(self, optimizer):
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not fs.OptState.READY:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.zeros(1, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["stage"] = fs.OptState.UNSCALED
        for v in state["found_inf_per_device"].values():
            if v.device.type == "cpu":
                v_on_cuda = v.cuda()
                dist.all_reduce(v_on_cuda, group=self.group)
                v.copy_(v_on_cuda)  # the fix: keep the agreed value
            else:
                dist.all_reduce(v, group=self.group)

    ShardedGradScaler.unscale_ = unscale_


def inf_in_rank1_grad(rank):
    """Each rank holds its own shard on CPU (as under CPU offload); the loss too, so the scale lives on CPU
    (fairscale issue #421's loss.to(params' device)). An inf goes into rank 1's grad only."""
    shard = torch.nn.Parameter(torch.arange(4.0) + 4 * rank)
    opt = torch.optim.SGD([shard], lr=0.5)
    scaler = ShardedGradScaler(init_scale=256.0)
    scaler.scale((shard * 0.25).sum()).backward()
    if rank == 1:
        shard.grad[2] = math.inf
    before = shard.detach().clone()
    scaler.step(opt)
    scaler.update()
    return dict(stepped=not torch.equal(before, shard.detach()), scale=scaler.get_scale(), finite=rank != 1)


def fsdp1_offload_overflow(rank):
    """torch FSDP1, CPUOffload, fp16 mixed precision, a bias-free Linear(8, 4): its flat param (32 elements)
    is split row by row, rank 0 owns weight rows 0-1, rank 1 rows 2-3. One sample's target is far off in
    output unit 3, so at scale 2**10 that unit's fp16 output grad (about -2**23) overflows in the backward:
    after the reduce-scatter only rank 1's CPU grad shard holds the inf."""
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision

    torch.manual_seed(0)
    fp16, gpu = torch.float16, torch.device("cuda", 0)
    model = FSDP(torch.nn.Linear(8, 4, bias=False), device_id=gpu, cpu_offload=CPUOffload(offload_params=True),
                 mixed_precision=MixedPrecision(param_dtype=fp16, reduce_dtype=fp16, buffer_dtype=fp16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ShardedGradScaler(init_scale=2.0**10)
    target = torch.tensor([[0.0, 0.0, 0.0, 4096.0]], device=gpu)
    loss = (model(torch.full((1, 8), 0.5, device=gpu)).float() - target).pow(2).sum()
    (flat,) = list(model.parameters())  # this rank's shard, on CPU
    scaler.scale(loss.to(flat.device)).backward()  # loss.to(params' device): the scale lives on CPU
    before = flat.detach().clone()
    finite = bool(flat.grad.isfinite().all())
    scaler.step(opt)
    scaler.update()
    return dict(stepped=not torch.equal(before, flat.detach()), scale=scaler.get_scale(), finite=finite)


def _rank(rank, world, store_path, out, args):
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)  # the ranks share one GPU
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    if args.with_fix:
        apply_fix()
    result = (fsdp1_offload_overflow if args.real_overflow else inf_in_rank1_grad)(rank)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    os._exit(0)  # gloo ranks that ran FSDP sometimes abort at interpreter exit otherwise


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
                        help="FSDP1 CPU-offload fp16 training whose backward overflows in rank 1's shard only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    out = run_ranks(2, args)
    stepped, scales = [o["stepped"] for o in out], [o["scale"] for o in out]
    init = 2.0**10 if args.real_overflow else 256.0
    where = (f"FSDP1 CPU offload fp16, an overflow in one weight row: CPU grad shard finite per rank "
             f"{[o['finite'] for o in out]}" if args.real_overflow else "CPU grads, an inf in rank 1's grad only")
    print(f"observed: {where}: stepped per rank {stepped}, scale per rank {scales}")
    print(f"expected: every rank skips and backs off: stepped [False, False], scale [{init / 2}, {init / 2}]")
    return 1 if stepped != [False, False] or scales != [init / 2] * 2 else 0


if __name__ == "__main__":
    sys.exit(main())
