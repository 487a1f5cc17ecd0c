"""fairscale ShardedGradScaler zeroes the CPU grads when the GPU is busy at step() (CUDA scale, CPU grads)

With the scale on CUDA and the grads on CPU (FSDP CPU offload, the loss on the GPU), the scaler copies
inv_scale to the CPU with non_blocking=True and unscales the CPU grads with `inv_scale.item()` at once,
before the copy has landed whenever the GPU still has work queued (a metric, the next batch, anything
queued between backward and step). The grads are then multiplied by whatever the pinned buffer held:
zero in 19 of 20 clean trials on an H100, each such step a zero update. With an idle GPU the copy usually
wins the race. Needs CUDA (a timing bug; run it alone on the GPU); seen with fairscale 0.4.13 on torch
2.11 with an H100.

    python fairscale-busy-gpu.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `_GeneralMultiDeviceReplicator.get`: `self.master.to(device=device,
non_blocking=True, copy=True)`; for a CPU target that is an asynchronous device-to-host copy into pinned
memory, and `ShardedGradScaler._foreach_non_finite_check_and_unscale_cpu_` reads it (`inv_scale.item()`)
without waiting for it. (found_inf's copy is raced alike; on an inf the CPU check replaces its storage,
so at world size 1 the inf is still seen.)

Fix: copy to the CPU with non_blocking=False in `_GeneralMultiDeviceReplicator.get` (a host sync per
unscale_ of CPU grads, which the CPU kernel needs anyway), or record an event after the copy and
synchronize it before use. --with-fix patches `get` to block for CPU targets.

Related: pytorch PR #176429 (blocking copies in torch's `_GeneralMultiDeviceReplicator`, closed unmerged);
pytorch PR #115710 (an earlier race of this kind: found_inf copied back before the all_reduce finished).
"""
import argparse
import sys
import warnings

import torch
import torch.distributed as dist
from fairscale.optim import grad_scaler as fs
from fairscale.optim.grad_scaler import ShardedGradScaler

TRIALS = 20


def apply_fix():
    """The proposed fix, monkeypatched: _GeneralMultiDeviceReplicator.get copies to the CPU blocking."""

    def get(self, device):
        retval = self._per_device_tensors.get(device, None)
        if retval is None:
            retval = self.master.to(device=device, non_blocking=device.type != "cpu", copy=True)  # was: True
            self._per_device_tensors[device] = retval
        return retval

    fs._GeneralMultiDeviceReplicator.get = get


def keep_gpu_busy(matmuls=8, n=4096):
    """Queue ~20 ms of matmuls (an idle H100) on the current stream and return at once."""
    a = torch.ones(n, n, device="cuda") / n
    b = torch.empty_like(a)
    for _ in range(matmuls):
        torch.mm(a, a, out=b)
        a, b = b, a


def trial(t):
    """Params and grads on CPU, the loss and scale on CUDA (FSDP CPU offload); a clean step, the GPU busy."""
    g = torch.Generator().manual_seed(t)
    param = torch.nn.Parameter(torch.randint(-8, 8, (4096,), generator=g) / 8)
    c = torch.randint(-4, 4, (4096,), generator=g) / 8  # grad of sum(param * c) is c, exact at any 2**k scale
    opt = torch.optim.SGD([param], lr=0.5)
    scaler = ShardedGradScaler(init_scale=2.0 ** (4 + t % 8))  # a new scale each trial: a stale copy is wrong
    scaler.scale((param.cuda() * c.cuda()).sum()).backward()
    torch.cuda.synchronize()  # the GPU is idle after backward...
    keep_gpu_busy()  # ...and busy again at step(), as with GPU work queued in between
    scaler.step(opt)
    scaler.update()
    return torch.equal(param.grad, c), not param.grad.any()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the scaler all-reduces
    results = [trial(t) for t in range(TRIALS)]
    dist.destroy_process_group()
    wrong, zeroed = sum(not exact for exact, _ in results), sum(zero for _, zero in results)
    print(f"observed: CPU grads, CUDA scale, GPU busy at step(), {TRIALS} clean trials: grads not exactly "
          f"unscaled in {wrong} (all zero in {zeroed})")
    print(f"expected: the grads are exactly unscaled in every trial (wrong in 0 of {TRIALS})")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
