"""GradScaler, CUDA scale + CPU grads (FSDP CPU offload): non_blocking copies of inv_scale/found_inf read before they land

The scalers serve inv_scale and found_inf to CPU grads through `.to("cpu", non_blocking=True)` copies and
run the CPU unscale kernel at once. With GPU work still queued at step() (a metric, the next batch), the
copies have not landed: the grads are unscaled by whatever the pinned buffer held (zeroed, or a stale
scale), and the kernel's found_inf = 1.0 is overwritten by the late copy of 0.0, so an inf is missed and
the step applied. torch.amp.GradScaler and torch's ShardedGradScaler alike (fairscale's has the same race).
Needs CUDA; seen on torch 2.11 with an H100/H200.

    python async-copy-race-busy-gpu.py [--with-fix] [--real-training]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/amp/grad_scaler.py, `_MultiDeviceReplicator.get` (inherited by
`_GeneralMultiDeviceReplicator` in torch/distributed/fsdp/sharded_grad_scaler.py): `self.master.to(device,
non_blocking=True, copy=True)`, then `GradScaler._unscale_grads_` / `ShardedGradScaler._unscale_grads_`
hand the CPU copies to torch._amp_foreach_non_finite_check_and_unscale_ (a CPU kernel, which does not wait
for the GPU) and `_maybe_opt_step` reads found_inf with .item(). non_blocking is safe only between devices
whose consumers are stream-ordered; CPU consumers are not.

Fix: copy synchronously when a CUDA (or other accelerator) tensor is served to the CPU:
`non_blocking=not (device.type == "cpu" and self.master.device.type != "cpu")` in
_MultiDeviceReplicator.get. This adds a host sync (it waits for the queued GPU work) in step() when grads
live on CPU, once per device per step; the CPU grads cannot be unscaled before the scale exists there.

Related: pytorch PR #176429 (blocking copies in _GeneralMultiDeviceReplicator only, so not for
torch.amp.GradScaler; closed 2026-03, not merged); pytorch PR #115710 fixed a race of the same kind
(found_inf copied back before the async all_reduce finished).
"""
import argparse
import datetime
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist

TRIALS = 20


def apply_fix():
    """The proposed fix, monkeypatched: _MultiDeviceReplicator.get copies to the CPU synchronously."""
    from torch.amp.grad_scaler import _MultiDeviceReplicator

    def get(self, device):
        retval = self._per_device_tensors.get(device, None)
        if retval is None:
            to_host = torch.device(device).type == "cpu" and self.master.device.type != "cpu"
            retval = self.master.to(device=device, non_blocking=not to_host, copy=True)
            self._per_device_tensors[device] = retval
        return retval

    _MultiDeviceReplicator.get = get


def keep_gpu_busy(matmuls=8, n=4096):
    """Queue ~20 ms of matmuls (an idle H100) on the current stream and return at once."""
    a = torch.ones(n, n, device="cuda") / n
    b = torch.empty_like(a)
    for _ in range(matmuls):
        torch.mm(a, a, out=b)
        a, b = b, a


def trial(make_scaler, t, with_inf):
    """Params and grads on CPU, loss and scale on CUDA (as under CPU offload); loss = sum(p * c), so grad
    p == c exactly. A new power-of-two scale every trial: a stale copy from the last trial is always wrong."""
    g = torch.Generator().manual_seed(t)
    params = [(torch.randint(-8, 8, (4096,), generator=g) / 8).requires_grad_() for _ in range(3)]
    targets = [torch.randint(-4, 4, (4096,), generator=g) / 8 for _ in range(3)]
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    init_scale = 2.0 ** (4 + t % 8)
    scaler = make_scaler(init_scale)
    scaler.scale(sum((p.cuda() * c.cuda()).sum() for p, c in zip(params, targets))).backward()
    if with_inf:
        with torch.no_grad():
            params[0].grad[0] = math.inf
    torch.cuda.synchronize()  # the grads are final; the GPU is idle
    before = [p.detach().clone() for p in params]
    keep_gpu_busy()
    scaler.step(opt)
    scaler.update()
    stepped = any(not torch.equal(b, p.detach()) for b, p in zip(before, params))
    exact = all(torch.equal(p.grad, c) for p, c in zip(params, targets))
    scale = scaler.get_scale()
    if with_inf:
        return stepped or scale != init_scale / 2
    return not (stepped and exact and scale == init_scale)


def scenario(name, make_scaler):
    clean = sum(trial(make_scaler, t, False) for t in range(TRIALS))
    inf = sum(trial(make_scaler, t, True) for t in range(TRIALS))
    print(f"observed: {name}, CPU grads, GPU busy at step(): clean trials with grads not exactly unscaled, "
          f"skipped or scale changed: {clean} of {TRIALS}; inf trials stepped or not backed off: {inf} of {TRIALS}")
    print(f"expected: 0 of {TRIALS} and 0 of {TRIALS}")
    return clean + inf > 0


def real_training(steps=20):
    """FSDP1 fp16 mixed precision with CPU offload (grads land on CPU in fp32), torch.amp.GradScaler("cuda")
    with its defaults, and GPU work queued between backward and scaler.step (here: some matmuls, as a metric
    or the next batch would queue). No value is written into a grad; the checks only read them."""
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision

    torch.manual_seed(0)
    fp16, device = torch.float16, torch.device("cuda", 0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device),
                 device_id=device, cpu_offload=CPUOffload(offload_params=True),
                 mixed_precision=MixedPrecision(param_dtype=fp16, reduce_dtype=fp16, buffer_dtype=fp16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda")
    lost = wrong = missed = 0
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(32, 64, device=device), torch.randn(32, 1, device=device)
        scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
        scaled = [p.grad.clone() for p in model.parameters()]  # on CPU, landed (FSDP synchronizes)
        clean, scale = all(bool(g.isfinite().all()) for g in scaled), scaler.get_scale()
        keep_gpu_busy()
        scaler.step(opt)
        scaler.update()
        skipped = scaler.get_scale() < scale
        lost += clean and skipped
        missed += not clean and not skipped
        wrong += clean and any(not torch.equal(p.grad, g / scale) for p, g in zip(model.parameters(), scaled))
    print(f"observed: FSDP1 CPU offload fp16, torch.amp.GradScaler, GPU busy at step(), {steps} steps: clean steps "
          f"skipped {lost}, clean steps with grads not exactly unscaled {wrong}, overflows missed {missed}")
    print("expected: 0, 0 and 0 (no clean step lost, grads unscaled exactly, every overflow skipped)")
    return lost + wrong + missed > 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    parser.add_argument("--real-training", action="store_true",
                        help="an FSDP1 CPU-offload fp16 training loop instead (no overflow needed)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    torch.cuda.set_device(0)
    # ShardedGradScaler and FSDP need a process group: one rank
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    if args.real_training:
        bug = real_training()
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        bug = scenario("torch.amp.GradScaler", lambda s: torch.amp.GradScaler("cuda", init_scale=s))
        bug |= scenario("ShardedGradScaler", lambda s: ShardedGradScaler("cuda", init_scale=s))
    dist.destroy_process_group()
    return 1 if bug else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown, which FSDP processes sometimes abort in
