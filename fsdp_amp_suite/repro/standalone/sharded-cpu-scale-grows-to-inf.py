"""ShardedGradScaler with its scale on CPU grows the scale to inf, then skips every step forever

With device="cpu" (or a CPU loss under FSDP CPU offload) ShardedGradScaler.update() goes through
_amp_update_scale_cpu_, a Python copy of torch._amp_update_scale_ that lacks the kernel's isfinite check
on the grown scale: float32 max * growth_factor becomes inf. From then on every scaled loss is inf, every
step is skipped and every backoff is inf * 0.5 = inf: training stops for good, silently. A run whose
backward never overflows (bf16 or fp32 compute with a scaler kept from an fp16 config) gets there; with the
defaults (init_scale 2**16, growth_interval 2000) after 224,000 clean steps. torch.amp.GradScaler("cpu")
calls the kernel and keeps the scale. Seen on torch 2.13.0 CPU (1-rank gloo group).

    python sharded-cpu-scale-grows-to-inf.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/distributed/fsdp/sharded_grad_scaler.py, `ShardedGradScaler._amp_update_scale_cpu_`:
on growth it does `self._scale *= self._growth_factor` unconditionally, whereas the kernels
(aten/src/ATen/native/cuda/AmpKernels.cu, aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp) store the
grown scale only if it is finite. fairscale's ShardedGradScaler (fairscale/optim/grad_scaler.py,
`_amp_update_scale_cpu_`) has the same code.

Fix: grow only to a finite scale, as the kernels do (`new_scale = self._scale * self._growth_factor;
if torch.isfinite(new_scale): self._scale.copy_(new_scale)`); or call torch._amp_update_scale_, which has
a CPU kernel, for a CPU scale too. No host sync is added (found_inf.item() is already there).

Related: none found.
"""
import argparse
import datetime
import math
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def apply_fix():
    """The proposed fix, monkeypatched: ShardedGradScaler._amp_update_scale_cpu_ with the isfinite check."""
    def _amp_update_scale_cpu_(self, found_inf):
        if found_inf.item() >= 1.0:
            self._scale *= self._backoff_factor
            self._growth_tracker.fill_(0)
        else:
            successful = self._growth_tracker + 1
            if successful == self._growth_interval:
                new_scale = self._scale * self._growth_factor
                if torch.isfinite(new_scale).all():  # the fix: never grow past float32 max to inf
                    self._scale.copy_(new_scale)
                self._growth_tracker.fill_(0)
            else:
                self._growth_tracker = successful

    ShardedGradScaler._amp_update_scale_cpu_ = _amp_update_scale_cpu_


def pow2(x):
    return f"2**{math.log2(x):g}" if math.isfinite(x) and x > 0 and math.log2(x).is_integer() else str(x)


def clean_steps_at_the_top(steps=3):
    """grad of w is c exactly; c * 2**127 is finite, so every step is clean."""
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
    c = torch.tensor([0.25, 0.5, -1.0])
    opt = torch.optim.SGD([w], lr=2.0**-4)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**127, growth_interval=1)
    scales, stepped = [], []
    for _ in range(steps):
        opt.zero_grad()
        before = w.detach().clone()
        scaler.scale((w * c).sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        stepped.append(not torch.equal(before, w.detach()))
    return scales, stepped


def fsdp1_bf16_training(steps=8):
    """FSDP1 with bf16 mixed precision (no fp16 overflow ever), an MSE regression whose loss and grads stay
    below 1, a scaler kept from an fp16 config: init_scale 2**124, growth_interval 1."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    model = FSDP(torch.nn.Linear(8, 1), device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**124, growth_interval=1)
    x = torch.rand(16, 8) - 0.5
    y = x.sum(1, keepdim=True) * 0.25
    scales, stepped = [], []
    for _ in range(steps):
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        stepped.append(any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters())))
    return scales, stepped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    parser.add_argument("--real-overflow", action="store_true",
                        help="FSDP1 bf16 training whose scale grows to inf (no value written into a grad)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    # ShardedGradScaler all-reduces found_inf: a 1-rank group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    if args.real_overflow:
        scales, stepped = fsdp1_bf16_training()
        expected = f"growth stops at 2**127 and all {len(stepped)} clean steps apply"
        bug = not all(stepped) or not all(math.isfinite(s) for s in scales)
    else:
        scales, stepped = clean_steps_at_the_top()
        expected = "growth skipped: scale stays [2**127, 2**127, 2**127], steps applied [True, True, True]"
        bug = any(s != 2.0**127 for s in scales) or not all(stepped)
    dist.destroy_process_group()
    print(f"observed: scale after each step [{', '.join(map(pow2, scales))}], steps applied {stepped}")
    print(f"expected: {expected}")
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
