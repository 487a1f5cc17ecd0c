"""What deciding the skip ourselves costs a fused optimizer, against handing it grad_scale / found_inf.

    python -m benchmarks.fused_handoff [--numel 20000000] [--tensors 100] [--repeats 10]

torch's scalers hand a fused optimizer (Adam(fused=True)) `grad_scale` and `found_inf` and let the kernel
unscale and skip: one pass over the grads. `ours` unscales and checks in its own pass, agrees on found_inf,
then calls the plain fused step (scaler_impl/scaler.py, difference 3): two passes, and a correct skip on
every rank (KNOWN_BUGS torch-sharded-hands-fused-a-sum, fused-sgd-skipped-first-step). Both run
scaler.step(opt); scaler.update() on the same params and grads, scale 1.0 so nothing drifts.
Last line: fused_step_ours_vs_handoff=<ours s per step / torch.amp.GradScaler s per step> (CPU).
"""
import argparse

import torch

from benchmarks.scaler import best_seconds
from scaler_impl import DeviceSplitGradScaler


def stepper(scaler, params):
    opt = torch.optim.Adam(params, lr=1e-6, fused=True)
    scaler.scale(torch.ones((), device=params[0].device))

    def run():
        scaler.step(opt)
        scaler.update()
    return run


def params_with_grads(numel, tensors, device):
    each = numel // tensors
    params = [torch.zeros(each, device=device, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(each, device=device) * 1e-3
    return params


def compare(device, args) -> float:
    params = params_with_grads(args.numel, args.tensors, device)
    fns = {"handoff": stepper(torch.amp.GradScaler(device, init_scale=1.0, growth_interval=10**9), params),
           "ours": stepper(DeviceSplitGradScaler(device, init_scale=1.0, growth_interval=10**9), params)}
    best = best_seconds(fns, args.repeats, device)
    print(f"  torch.amp.GradScaler, fused Adam handed grad_scale/found_inf: {best['handoff'] * 1e3:8.2f} ms/step")
    print(f"  ours, own unscale + agreement, plain fused step:             {best['ours'] * 1e3:8.2f} ms/step  "
          f"({best['ours'] / best['handoff']:.2f}x)")
    return best["ours"] / best["handoff"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=20_000_000)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    print(f"CPU: {args.numel / 1e6:.0f}M fp32 params in {args.tensors} tensors, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    ratio = compare("cpu", args)
    if torch.cuda.is_available():
        print(f"CUDA ({torch.cuda.get_device_name()}):")
        print(f"fused_step_ours_vs_handoff_cuda={compare('cuda', args):.3f}")
    else:
        print("CUDA: not available, skipped")
    print(f"fused_step_ours_vs_handoff={ratio:.3f}")


if __name__ == "__main__":
    main()
