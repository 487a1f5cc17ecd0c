"""fairscale ShardedGradScaler silently disables itself without CUDA, then steps on inf grads

fairscale.optim.grad_scaler.ShardedGradScaler has no device argument. On a machine without CUDA its
constructor warns "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling." and sets
_enabled = False: scale() returns the loss unscaled and step() calls optimizer.step() on whatever the grads
hold, inf included. CPU training built with it (FSDP over gloo) has no overflow protection, and a warning
is all that says so. Seen with fairscale 0.4.13 on torch 2.13.0 CPU; on a machine with CUDA it skips.

    python fairscale-disabled-without-cuda.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `ShardedGradScaler.__init__`: it builds a
torch.cuda.amp.GradScaler (device "cuda") and sets `self._enabled = False` when
`amp_definitely_not_available()`, though the rest of the class handles a scale and grads on CPU
(`_amp_update_scale_cpu_`, `_foreach_non_finite_check_and_unscale_cpu_`). `unscale_` also all-reduces a
CPU found_inf through `v.cuda()`, which cannot work without CUDA.

Fix: take torch.amp.GradScaler's `device` argument and disable only where that device is missing; with
device="cpu", all-reduce found_inf where it lives (gloo reduces CPU tensors) instead of through a CUDA
copy. --with-fix patches `__init__` and `unscale_` so. The least a fix must do is refuse loudly (raise)
instead of warning and training on without protection.

Related: fairscale issue #421 and PR #831 (CPU offload support, which added the CPU code paths);
pytorch#111559 (GradScaler on CPU: torch's scalers now take a device).
"""
import argparse
import math
import sys
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from fairscale.optim import grad_scaler as fs
from fairscale.optim.grad_scaler import ShardedGradScaler


def apply_fix():
    """The proposed fix, monkeypatched: a `device` argument (disabled only where that device is missing), and
    found_inf all-reduced in place on CPU when the scaler's device is the CPU."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True, process_group=None, device="cuda"):
        torch.amp.GradScaler.__init__(self, device, init_scale=init_scale, growth_factor=growth_factor,
                                      backoff_factor=backoff_factor, growth_interval=growth_interval,
                                      enabled=enabled)  # disables itself only for device "cuda" without CUDA
        if self._enabled:
            self._per_optimizer_states = defaultdict(fs._refresh_per_optimizer_state)
            self.group = process_group

    original_unscale_ = ShardedGradScaler.unscale_

    def unscale_(self, optimizer):
        if not self._enabled or self._device != "cpu":
            return original_unscale_(self, optimizer)
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not fs.OptState.READY:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.zeros(1, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["stage"] = fs.OptState.UNSCALED
        for v in state["found_inf_per_device"].values():
            dist.all_reduce(v, group=self.group)  # in place: gloo reduces CPU tensors

    ShardedGradScaler.__init__ = __init__
    ShardedGradScaler.unscale_ = unscale_


def step_on_an_overflow(with_fix, real_overflow):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = ShardedGradScaler(init_scale=256.0, **({"device": "cpu"} if with_fix else {}))
    warned = [str(w.message) for w in caught if "Disabling" in str(w.message)]
    if real_overflow:
        # fp16 autocast on CPU; a batch of large activations: the fp16 weight grad, 64 * 2048 = 131072,
        # overflows in the backward at any scale
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.full((64, 8), 2048.0))
        scaler.scale(out.float().sum()).backward()
    else:
        scaler.scale(model(torch.ones(2, 8)).sum()).backward()
        model.weight.grad[0, 0] = math.inf  # an overflow in the backward
    scaler.step(opt)
    scaler.update()
    return scaler.is_enabled(), warned, bool(torch.isfinite(model.weight).all()), scaler.get_scale()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    parser.add_argument("--real-overflow", action="store_true",
                        help="an fp16 (CPU autocast) backward that overflows by itself instead of an inf written in")
    args = parser.parse_args()
    if torch.cuda.is_available():
        print("skip: needs a machine without CUDA")
        return 77
    if args.with_fix:
        apply_fix()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the scaler's default group
    enabled, warned, finite, scale = step_on_an_overflow(args.with_fix, args.real_overflow)
    dist.destroy_process_group()
    what = "an fp16 backward that overflowed" if args.real_overflow else "an inf grad"
    said = f" (warned {warned[0]!r})" if warned else ""
    print(f"observed: {what}: is_enabled() {enabled}{said}; step() "
          f"{'applied it (weight now non-finite)' if not finite else 'skipped it'}; scale {scale}")
    print("expected: is_enabled() True; step() skipped it; scale 256.0 -> 128.0")
    return 1 if not (enabled and finite and scale == 128.0) else 0


if __name__ == "__main__":
    sys.exit(main())
