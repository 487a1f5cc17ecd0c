"""fairscale ShardedGradScaler with its scale on CPU backs off only if found_inf == 1.0: two overflows grow the scale

When the first scaled loss is on CPU (a CPU model, or the loss moved to CPU-offloaded params as in fairscale
issue #421) the scale lives on CPU and update() goes through fairscale's _amp_update_scale_cpu_, which backs
off only if the summed found_inf is exactly 1.0. update() sums found_inf over optimizers and devices, so when
two optimizers (or the grads of one optimizer on two devices) overflow, the sum is 2.0: the steps are
skipped, yet the update counts as a clean one and the scale that just overflowed is kept, or grown.
Needs CUDA (without it the scaler disables itself); seen with fairscale 0.4.13 on torch 2.11 with an H100.

    python fairscale-backoff-only-if-exactly-one.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `ShardedGradScaler._amp_update_scale_cpu_`: `if found_inf.item()
== 1.0:` backs off; any other value, 2.0 included, counts as a success. torch's kernel
(`torch._amp_update_scale_`) backs off on any non-zero value.

Fix: back off if `found_inf.item() >= 1.0` (torch's ShardedGradScaler, which copied this function, tests
`>= 1.0`). --with-fix replaces `_amp_update_scale_cpu_` with that version.

Related: fairscale PR #831 (added the CPU update path, for fairscale issue #421); none found on the
comparison itself.
"""
import argparse
import math
import sys
import warnings

import torch
import torch.distributed as dist
from fairscale.optim.grad_scaler import ShardedGradScaler

INIT = 256.0


def apply_fix():
    """The proposed fix, monkeypatched: _amp_update_scale_cpu_ backs off on found_inf >= 1.0."""

    def _amp_update_scale_cpu_(self, found_inf):
        if found_inf.item() >= 1.0:  # was: == 1.0
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        else:
            successful = self._growth_tracker + 1
            if successful == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker = successful

    ShardedGradScaler._amp_update_scale_cpu_ = _amp_update_scale_cpu_


def two_optimizers(real_overflow):
    """A CPU model, one optimizer per layer, the loss (hence the scale) on CPU; both optimizers' grads overflow."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opts = [torch.optim.SGD(layer.parameters(), lr=0.5) for layer in model]
    init = 2.0**16 if real_overflow else INIT
    scaler = ShardedGradScaler(init_scale=init, growth_interval=1)
    if real_overflow:
        # fp16 autocast on CPU at fairscale's default init_scale 2**16: the fp16 output grad (65536) is inf,
        # and the inf spreads to both layers' grads in the backward
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.ones(2, 4))
        scaler.scale(out.float().sum()).backward()
    else:
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        model[0].weight.grad[0, 0] = math.inf  # both optimizers' grads overflow
        model[1].weight.grad[0, 0] = math.inf
    before = [p.detach().clone() for p in model.parameters()]
    for opt in opts:
        scaler.step(opt)
    scaler.update()  # found_inf summed over the two optimizers: 2.0
    stepped = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    return ("two optimizers" + (", fp16 autocast overflow" if real_overflow else ", an inf in each"),
            stepped, init, scaler.get_scale())


def two_devices():
    """One optimizer whose params are on CPU and CUDA, the loss (hence the scale) on CPU; an inf in each grad."""
    a = torch.nn.Parameter(torch.tensor([0.5, -0.25]))
    b = torch.nn.Parameter(torch.tensor([1.0, 0.75], device="cuda"))
    opt = torch.optim.SGD([a, b], lr=0.5)
    scaler = ShardedGradScaler(init_scale=INIT, growth_interval=1)
    scaler.scale(a.sum() + b.sum().cpu()).backward()
    a.grad[0] = math.inf
    b.grad[0] = math.inf
    before = [a.detach().clone(), b.detach().cpu()]
    scaler.step(opt)
    scaler.update()  # found_inf summed over the two devices: 2.0
    stepped = not (torch.equal(before[0], a.detach()) and torch.equal(before[1], b.detach().cpu()))
    return "one optimizer, grads on CPU and CUDA, an inf on each", stepped, INIT, scaler.get_scale()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    parser.add_argument("--real-overflow", action="store_true",
                        help="a CPU model under fp16 autocast whose scaled backward overflows in both optimizers")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the scaler all-reduces
    cases = [two_optimizers(True)] if args.real_overflow else [two_optimizers(False), two_devices()]
    dist.destroy_process_group()
    bug = False
    for what, stepped, init, scale in cases:
        print(f"observed: {what}, scale on CPU, growth_interval 1: stepped {stepped}, scale {init} -> {scale}")
        print(f"expected: the steps are skipped and the scale backs off once: stepped False, scale {init} "
              f"-> {init / 2}")
        bug |= stepped or scale != init / 2
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
