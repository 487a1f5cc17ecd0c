"""GradScaler crashes on bf16 CUDA grads: _amp_foreach_non_finite_check_and_unscale_ has no CUDA bf16 kernel

torch._amp_foreach_non_finite_check_and_unscale_ has no CUDA kernel for bf16 (its CPU kernel handles bf16),
so every scaler that unscales bf16 CUDA grads with it crashes in step()/unscale_(): torch.amp.GradScaler,
torch's and fairscale's ShardedGradScaler. bf16 grads on the GPU come from a model trained in bf16 with a
scaler, fairscale FSDP with compute_dtype=torch.bfloat16 and no offload at world size 1, or FSDP1
MixedPrecision(keep_low_precision_grads=True) in bf16. Needs CUDA; seen on torch 2.11 with an H100/H200.

    python bf16-cuda-unscale-kernel.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: aten/src/ATen/native/cuda/AmpKernels.cu, `_amp_foreach_non_finite_check_and_unscale_cuda_`
(and its TensorIterator fallback `_amp_non_finite_check_and_unscale_cuda_`) dispatch with
AT_DISPATCH_FLOATING_TYPES_AND_HALF, which leaves out BFloat16; torch/amp/grad_scaler.py
`GradScaler._unscale_grads_` hands it the grads of each device and dtype as they are.

Fix: add kBFloat16 to both CUDA dispatches (the kernels already compute in float; pytorch PR #194947).
--with-fix applies an equivalent in Python: bf16 CUDA grads are unscaled through an fp32 copy and copied
back (exact: unscaling by a power of two, then rounding to bf16 as the kernel would).

Related: pytorch#127176 (open), pytorch PR #194947 (open).
"""
import argparse
import sys

import torch


def apply_fix():
    """The proposed fix, monkeypatched: torch._amp_foreach_non_finite_check_and_unscale_ (which
    torch/amp/grad_scaler.py looks up at each call) unscales bf16 CUDA grads through an fp32 copy."""
    kernel = torch._amp_foreach_non_finite_check_and_unscale_

    def unscale_bf16_through_fp32(grads, found_inf, inv_scale):
        bf16 = [g for g in grads if g.is_cuda and g.dtype == torch.bfloat16]
        rest = [g for g in grads if not (g.is_cuda and g.dtype == torch.bfloat16)]
        if rest:
            kernel(rest, found_inf, inv_scale)
        if bf16:
            fp32 = [g.float() for g in bf16]
            kernel(fp32, found_inf, inv_scale)
            for low, full in zip(bf16, fp32):
                low.copy_(full)

    torch._amp_foreach_non_finite_check_and_unscale_ = unscale_bf16_through_fp32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    if args.with_fix:
        apply_fix()
    # bf16 params (hence bf16 grads) on CUDA; loss = sum(p * c), so grad p == c exactly
    p = (torch.arange(-8, 8) / 8).to(device="cuda", dtype=torch.bfloat16).requires_grad_()
    c = (torch.arange(16) % 5 - 2) / 8
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = torch.amp.GradScaler("cuda", init_scale=256.0)
    scaler.scale((p.float() * c.cuda()).sum()).backward()
    before = p.detach().clone()
    try:
        scaler.step(opt)  # unscales the bf16 CUDA grad
        scaler.update()
    except (RuntimeError, NotImplementedError) as exc:
        if "BFloat16" not in str(exc):
            raise
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        observed, bug = f"raised {type(exc).__name__}: {last}", True
    else:
        stepped = not torch.equal(before, p.detach())
        exact = torch.equal(p.grad.float().cpu(), c)
        observed, bug = f"stepped {stepped}, grad exactly unscaled {exact}", not (stepped and exact)
    print(f"observed: torch.amp.GradScaler, one clean step with a bf16 grad on CUDA: {observed}")
    print("expected: the bf16 grad is unscaled exactly and the step applies (as for fp16 and fp32 grads)")
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
