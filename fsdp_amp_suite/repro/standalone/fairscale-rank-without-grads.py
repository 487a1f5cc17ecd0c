"""fairscale ShardedGradScaler: a rank without grads raises "No inf checks were recorded" while the others hang

Under FSDP a rank can hold no grad in a step: its shard holds only frozen params (pytorch#99174: FSDP
use_orig_params=True with non-uniform requires_grad), or an unused branch. fairscale's unscale_ records no
found_inf on such a rank, so that rank issues no found_inf all_reduce and then fails step()'s own assert,
while the ranks with grads wait in the all_reduce: a crash on one rank, a hang on the others (here bounded
by a 10 s gloo timeout). Needs CUDA (without it the scaler disables itself); seen with fairscale 0.4.13 on
torch 2.11 with an H100, 2 gloo ranks sharing it.

    python fairscale-rank-without-grads.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `ShardedGradScaler._unscale_grads_` returns an empty
found_inf_per_device when the optimizer has no grads, so `unscale_` makes no all_reduce and `step()` fails
`assert len(optimizer_state["found_inf_per_device"]) > 0, "No inf checks were recorded for this optimizer."`.

Fix: with no grads, record a zero found_inf on the scale's device, so every rank takes part in the
all_reduce and steps (a no-op without grads) or skips with the others; this is pytorch PR #99175, the fix
of pytorch#99174 in torch's ShardedGradScaler. --with-fix wraps `_unscale_grads_` so.

Related: pytorch#99174 and PR #99175 (the same defect, fixed in torch in 2023, never in fairscale).
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fairscale.optim.grad_scaler import ShardedGradScaler

TIMEOUT_S = 10


def apply_fix():
    """The proposed fix, monkeypatched: _unscale_grads_ records a zero found_inf on the scale's device when the
    optimizer has no grads (pytorch PR #99175)."""
    original = ShardedGradScaler._unscale_grads_

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        per_device = original(self, optimizer, inv_scale, found_inf, allow_fp16)
        if not per_device:
            per_device[self._scale.device] = torch.zeros(1, device=self._scale.device)
        return per_device

    ShardedGradScaler._unscale_grads_ = _unscale_grads_


def step(rank):
    """Params and grads on CUDA, a shard per rank; rank 0 has grads, rank 1's shard got none this step."""
    shard = torch.nn.Parameter(torch.arange(4.0, device="cuda") + 4 * rank)
    opt = torch.optim.SGD([shard], lr=0.5)
    scaler = ShardedGradScaler(init_scale=256.0)
    loss = (shard * 0.25).sum()
    if rank == 0:
        scaler.scale(loss).backward()
    else:
        scaler.scale(loss.detach())  # the same loss, no grad for this rank's params
    before = shard.detach().clone()
    try:
        scaler.step(opt)
        scaler.update()
    except AssertionError as exc:  # the bug, on the rank without grads
        return dict(error=f"AssertionError: {exc}")
    except RuntimeError as exc:  # the bug, on the rank left waiting: the all_reduce times out
        return dict(error=f"{type(exc).__name__} in the found_inf all_reduce (gloo timeout, {TIMEOUT_S} s)")
    return dict(stepped=not torch.equal(before, shard.detach()), scale=scaler.get_scale())


def _rank(rank, world, store_path, out, args):
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)  # the ranks share one GPU
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if args.with_fix:
        apply_fix()
    result = step(rank)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    if "error" in result:  # stay up until every rank has reported: a rank that exits would end the others' wait
        deadline = time.monotonic() + 3 * TIMEOUT_S
        while time.monotonic() < deadline and len(os.listdir(out)) < world:
            time.sleep(0.1)
    else:
        dist.destroy_process_group()
    os._exit(0)


def run_ranks(world, args):
    # the ranks meet through a file, not a port that another process could take before they bind it: a file
    # outside out, whose entries the ranks count
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as out:
        store_path = os.path.join(tmp, "store")
        ctx = mp.start_processes(_rank, args=(world, store_path, out, args), nprocs=world, start_method="forkserver",
                                 join=False)
        deadline = time.monotonic() + 6 * TIMEOUT_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:  # bound a hang the gloo timeout did not end
                for p in ctx.processes:
                    p.kill()
                break
        return [json.load(open(os.path.join(out, f"{r}.json"))) if os.path.exists(os.path.join(out, f"{r}.json"))
                else dict(error=f"hung past {6 * TIMEOUT_S} s") for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    out = run_ranks(2, args)
    if any("error" in o for o in out):
        print("observed: " + "; ".join(f"rank {r} {'raised ' + o['error'] if 'error' in o else 'returned'}"
                                       for r, o in enumerate(out)))
        bug = True
    else:
        stepped, scales = [o["stepped"] for o in out], [o["scale"] for o in out]
        print(f"observed: stepped per rank {stepped}, scale per rank {scales}")
        bug = stepped != [True, False] or scales != [256.0, 256.0]
    print("expected: rank 0 steps, rank 1 (no grads) takes part without stepping: stepped [True, False], "
          "scale per rank [256.0, 256.0]")
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
