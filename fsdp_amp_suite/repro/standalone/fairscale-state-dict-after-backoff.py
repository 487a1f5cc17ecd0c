"""fairscale ShardedGradScaler with its scale on CPU: state_dict() raises AttributeError after a backoff

When the first scaled loss is on CPU (a CPU model, or the loss moved to CPU-offloaded params as in fairscale
issue #421; fairscale FSDP CPU-offload training does this) the scale lives on CPU and update() goes through
fairscale's _amp_update_scale_cpu_, which on a backoff (and on a growth) replaces the growth-tracker tensor
by the Python int 0. state_dict() then raises AttributeError: 'int' object has no attribute 'item', so no
checkpoint can be saved after the first overflow. Needs CUDA (without it the scaler disables itself); seen
with fairscale 0.4.13 on torch 2.11 with an H100.

    python fairscale-state-dict-after-backoff.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `ShardedGradScaler._amp_update_scale_cpu_`: `self._growth_tracker
= 0` where a tensor was; torch.amp.GradScaler.state_dict() reads it with `self._growth_tracker.item()`
(`_get_growth_tracker`).

Fix: reset the tracker in place, `self._growth_tracker.fill_(0)`, as torch's ShardedGradScaler does in its
copy of this function. --with-fix replaces `_amp_update_scale_cpu_` with that version.

Related: fairscale PR #831 (added the CPU update path, for fairscale issue #421); none found on this error.
"""
import argparse
import math
import sys
import warnings

import torch
import torch.distributed as dist
from fairscale.optim.grad_scaler import ShardedGradScaler


def apply_fix():
    """The proposed fix, monkeypatched: _amp_update_scale_cpu_ keeps _growth_tracker a tensor."""

    def _amp_update_scale_cpu_(self, found_inf):
        if found_inf.item() == 1.0:
            self._scale *= self._backoff_factor
            self._growth_tracker.fill_(0)  # was: self._growth_tracker = 0
        else:
            successful = self._growth_tracker + 1
            if successful == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker.fill_(0)  # was: self._growth_tracker = 0
            else:
                self._growth_tracker = successful

    ShardedGradScaler._amp_update_scale_cpu_ = _amp_update_scale_cpu_


def checkpoint_after_backoff(real_overflow):
    """A CPU model: the loss, hence the scale, on CPU. One overflowing step, then a checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    init = 2.0**16 if real_overflow else 256.0
    scaler = ShardedGradScaler(init_scale=init)
    if real_overflow:
        # fp16 autocast on CPU at fairscale's default init_scale 2**16: the fp16 output grad (65536) is inf
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.ones(2, 4))
        scaler.scale(out.float().sum()).backward()
    else:
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        model.weight.grad[0, 0] = math.inf  # an overflow
    scaler.step(opt)
    scaler.update()  # the step is skipped and the scale backs off
    try:
        state = scaler.state_dict()
    except AttributeError as exc:
        return init, f"raised AttributeError: {exc}"
    return init, f"returned scale {state['scale']}, _growth_tracker {state['_growth_tracker']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    parser.add_argument("--real-overflow", action="store_true",
                        help="a CPU model under fp16 autocast whose scaled backward overflows by itself")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the scaler all-reduces
    init, got = checkpoint_after_backoff(args.real_overflow)
    dist.destroy_process_group()
    want = f"returned scale {init / 2}, _growth_tracker 0"
    print(f"observed: scale on CPU, one overflow and backoff, then state_dict(): {got}")
    print(f"expected: state_dict() {want}")
    return 1 if got != want else 0


if __name__ == "__main__":
    sys.exit(main())
