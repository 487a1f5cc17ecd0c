"""ShardedGradScaler issues one found_inf all_reduce per grad device: CPU+CUDA grads on one rank, none on another, hang

ShardedGradScaler.unscale_ all-reduces each entry of found_inf_per_device separately. A rank without grads
(an unused branch, a frozen part, an empty shard) records one found_inf, on the scale's device, and takes
part in one all_reduce; a rank whose optimizer holds grads on two devices (some params offloaded to CPU,
the rest on the GPU) issues two, and waits for a second all_reduce that no peer issues. Any difference in
the set of grad devices between ranks does the same. Here: 2 gloo ranks sharing one GPU, scale on CUDA, a
clean step; the hang is bounded by a 10 s gloo timeout. Needs CUDA; seen on torch 2.11 with an H100.

    python torch-sharded-collective-per-device.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/distributed/fsdp/sharded_grad_scaler.py, `ShardedGradScaler.unscale_`: `for found_inf in
optimizer_state["found_inf_per_device"].values(): ... dist.all_reduce(...)`, one collective per device that
holds grads on this rank, a number the ranks do not agree on.

Fix: one collective per optimizer: sum the devices' found_inf on the scale's device, all-reduce that one
tensor, and copy the result back into every device's found_inf. Adds no host sync beyond the copy back
to CPU that unscale_ already does.

Related: pytorch#99174 / PR #99175 (the found_inf that a rank without grads records); none found for this
hang.
"""
import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOO_TIMEOUT_S = 10


def apply_fix():
    """The proposed fix, monkeypatched: ShardedGradScaler.unscale_ with a single all_reduce per optimizer."""
    from torch.amp.grad_scaler import OptState
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    def unscale_(self, optimizer):
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((1,), 0.0, dtype=torch.float32, device=self._scale.device)
        per_device = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["found_inf_per_device"] = per_device
        state["stage"] = OptState.UNSCALED
        # the fix: one collective, whatever devices this rank's grads are on
        combined = torch.zeros(1, device=self._scale.device)
        for f in per_device.values():
            combined += f.to(self._scale.device)
        dist.all_reduce(combined, group=self.process_group)
        for f in per_device.values():
            f.copy_(combined)

    ShardedGradScaler.unscale_ = unscale_


def one_step(rank):
    """Rank 0: params 0 and 2 on CPU, 1 on CUDA, a clean scaled backward. Rank 1: no grads this step."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    g = torch.Generator().manual_seed(rank)
    params = [(torch.randint(-8, 8, (6,), generator=g) / 8).to(d).requires_grad_() for d in ("cpu", "cuda", "cpu")]
    opt = torch.optim.SGD(params, lr=0.5)
    scaler = ShardedGradScaler("cuda", init_scale=256.0)
    loss = sum((p.cuda() * 0.25).sum() for p in params)
    if rank == 0:
        scaler.scale(loss).backward()
    else:
        scaler.scale(loss.detach())
    torch.cuda.synchronize()
    before = [p.detach().cpu().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    return dict(stepped=any(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, params)),
                scale=scaler.get_scale())


def _rank(rank, world, store_path, out, with_fix):
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)  # the ranks share one GPU
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    if with_fix:
        apply_fix()
    try:
        result = one_step(rank)
    except RuntimeError as exc:  # the gloo timeout of a collective that no peer takes part in
        if not (isinstance(exc, dist.DistBackendError) or "timed out" in str(exc).lower()):
            raise
        message = re.sub(r"^\[[^\]]*\] ", "", str(exc).strip().splitlines()[0])  # drop gloo's source location
        result = dict(error=f"raised {type(exc).__name__}: {message[:160]}")
    with open(os.path.join(out, f"{rank}.tmp"), "w") as f:
        json.dump(result, f)
    os.rename(os.path.join(out, f"{rank}.tmp"), os.path.join(out, f"{rank}.json"))
    deadline = time.monotonic() + 3 * GLOO_TIMEOUT_S  # leave the group only once every rank is done
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"{r}.json"))
                                                  for r in range(world)):
        time.sleep(0.1)
    if "error" not in result:
        dist.destroy_process_group()
    os._exit(0)


def run_ranks(world, with_fix, limit=6 * GLOO_TIMEOUT_S):
    ctx = mp.get_context("forkserver")
    with tempfile.TemporaryDirectory() as out:
        # the ranks meet through a file, not a port that another process could take before they bind it
        store_path = os.path.join(out, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store_path, out, with_fix)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + limit
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(out, f"{r}.json")
            if os.path.exists(path):
                results.append(json.load(open(path)))
            elif p.exitcode == -9:  # killed above: still hanging
                results.append(dict(error=f"still waiting after {limit} s (killed)"))
            else:
                raise RuntimeError(f"rank {r} failed (exit code {p.exitcode}); its traceback is above")
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    out = run_ranks(2, args.with_fix)
    told = [o["error"] if "error" in o else f"stepped {o['stepped']}, scale {o['scale']}" for o in out]
    print(f"observed: rank 0 (grads on CPU and CUDA): {told[0]}; rank 1 (no grads): {told[1]}")
    print("expected: rank 0: stepped True, scale 256.0; rank 1: stepped False, scale 256.0")
    return 0 if out == [dict(stepped=True, scale=256.0), dict(stepped=False, scale=256.0)] else 1


if __name__ == "__main__":
    sys.exit(main())
