"""torch < 2.6: ShardedGradScaler on CPU grads turns found_inf into shape [1]; fused AdamW raises at the first overflow

torch.distributed.fsdp.ShardedGradScaler(device="cpu") with AdamW(fused=True) and CPU grads (FSDP on
CPU, or CPU offload), no explicit unscale_: before torch 2.6 the first step with an inf/NaN grad raises
RuntimeError: output with shape [] doesn't match the broadcast shape [1], where it should skip the
step. Seen on torch 2.4.1 (2.5.1 has the same code); fixed in 2.6.0, so on torch 2.6 and later this file
exits 0 (checked on torch 2.13.0 CPU).

    python torch-sharded-cpu-unscale-found-inf-shape.py [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/distributed/fsdp/sharded_grad_scaler.py (torch 2.4, 2.5),
`ShardedGradScaler._unscale_grads_` sends CPU grads to the Python fallback
`_foreach_non_finite_check_and_unscale_cpu_`, which on a non-finite grad does
`found_inf.data = torch.tensor([1.0])`, replacing the shape-[] found_inf that GradScaler.step's fused
path made (`_check_inf_per_device`) by a shape-[1] one; torch/optim/adam.py `_fused_adam` then fails in
`torch._foreach_sub_(device_state_steps, [device_found_inf] * ...)` on its shape-[] step counters
(fused Adam and Adagrad alike).

Fix: none needed on torch >= 2.6: `_unscale_grads_` unscales CPU grads with
`torch._amp_foreach_non_finite_check_and_unscale_` (which has a CPU kernel since pytorch PR #109281 and
writes into found_inf in place), and the Python fallback is gone: pytorch PR #135232 "Use
_amp_foreach_non_finite_check_and_unscale_ for CPU grads of ShardedGradScaler" (September 2024, in 2.6).

Related: pytorch#140514 "Error with fused AdamW" (open; the same shape-[1] failure after unscale_).
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

WANT = {"step 1 (overflow)": "skipped", "step 2 (clean)": "stepped"}


def two_steps(model, make_loss, write_inf, init_scale):
    """Step 1 overflows, step 2 is clean; fused AdamW, no explicit unscale_."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = ShardedGradScaler(device="cpu", init_scale=init_scale)
    got = {}
    for name in WANT:
        opt.zero_grad()
        scaler.scale(make_loss()).backward()
        if write_inf and name.startswith("step 1"):
            next(model.parameters()).grad.view(-1)[0] = math.inf
        before = [p.detach().clone() for p in model.parameters()]
        try:
            scaler.step(opt)
        except RuntimeError as e:
            got[name] = f"raised RuntimeError: {str(e).strip().splitlines()[-1]}"
            break
        scaler.update()
        got[name] = "stepped" if any(not torch.equal(b, p) for b, p in zip(before, model.parameters())) else "skipped"
    return got


def written_inf(rank):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return two_steps(model, lambda: model(torch.ones(2, 4)).sum(), write_inf=True, init_scale=256.0)


def real_overflow(rank):
    """FSDP1, fp16 params and reduction, CPU: at the default init_scale d loss/d out = 2**16 is inf in fp16,
    so step 1 overflows by itself; at 2**15 step 2 is clean."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
    torch.manual_seed(0)
    model = FSDP(torch.nn.Linear(4, 4, bias=False), device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16))
    return two_steps(model, lambda: model(torch.full((1, 4), 0.25)).float().sum(), write_inf=False,
                     init_scale=2.0**16)


def _rank(rank, world, store_path, out, args):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
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
    parser.add_argument("--real-overflow", action="store_true",
                        help="FSDP1 fp16 on CPU (2 gloo ranks) whose first scaled backward overflows by itself")
    args = parser.parse_args()
    world = 2 if args.real_overflow else 1
    got = run_ranks(world, args)
    print(f"observed: fused AdamW, CPU grads, per rank: {got}")
    print(f"expected: {[WANT] * world}")
    return 0 if got == [WANT] * world else 1


if __name__ == "__main__":
    sys.exit(main())
