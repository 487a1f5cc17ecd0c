"""Fused SGD with momentum: a first step skipped on found_inf leaves the momentum buffers uninitialised

torch.optim.SGD(momentum>0, fused=True) under torch.amp.GradScaler (or torch's ShardedGradScaler): the
scaler leaves the skip of an overflowing step to the fused kernel (it sets found_inf = 1.0 and calls
step()). If the FIRST step overflows, as fp16 training's first steps at the default init_scale 2**16
routinely do, the kernel returns early but the momentum buffers it was given (torch.empty_like) are
kept, and the next clean step applies their uninitialised memory to the params: garbage, or NaN under
torch.use_deterministic_algorithms(True) (used here so the run is deterministic). Seen on torch 2.13.0 CPU.

    python fused-sgd-skipped-first-step.py [--with-fix] [--real-overflow]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/optim/sgd.py, `_fused_sgd`: when every momentum buffer is None it makes them with
`torch.empty_like(g)` and calls `torch._fused_sgd_(..., is_first_step=True, found_inf=...)`, which
fills them (buf = grad) only if it does not return early on found_inf == 1. SGD.step then stores the
untouched buffers in state["momentum_buffer"], so the next step is no longer a first step and computes
buf = momentum * <uninitialised> + grad. The unfused SGD is never called on a skipped step.

Fix: in `_fused_sgd`, on a first step (no buffers yet) that GradScaler marked as skipped
(found_inf == 1, the kernel's own test), return before creating any buffer, so the next applied step
is still the first. This reads found_inf on the host once per optimizer (only while no buffer exists:
one sync at the first step). A sync-free alternative, `torch.zeros_like` instead of `torch.empty_like`,
gives the right result only for dampening == 0 (the default): after a skipped first step the next one
computes buf = (1 - dampening) * grad instead of buf = grad. --with-fix applies the first.

Related: LibreYOLO PR #771 "Never fuse SGD" (NaN a step after a skipped first step with fused SGD,
torch 2.11); no torch issue found.
"""
import argparse
import math
import sys
import warnings

import torch
import torch.optim.sgd as sgd_module

C = torch.tensor([0.25, 0.5, -1.0])  # the exact grad of w in loss = <w, C>


def apply_fix():
    """The proposed fix, monkeypatched: torch.optim.sgd._fused_sgd makes no buffer on a skipped first step."""
    original = sgd_module._fused_sgd

    def _fused_sgd(params, grads, momentum_buffer_list, grad_scale, found_inf, *, momentum, **kwargs):
        first_step = momentum != 0 and all(b is None for b in momentum_buffer_list)
        if first_step and found_inf is not None and found_inf.item() == 1.0:
            return  # skipped: leave the buffers None, the next applied step is the first
        original(params, grads, momentum_buffer_list, grad_scale, found_inf, momentum=momentum, **kwargs)

    sgd_module._fused_sgd = _fused_sgd


def written_inf():
    """One param, an inf written into the first step's grad, then a clean step."""
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
    opt = torch.optim.SGD([w], lr=0.5, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(2):
        opt.zero_grad()
        scaler.scale((w * C).sum()).backward()
        if step == 0:
            w.grad[1] = math.inf  # the first step overflows
        scaler.step(opt)
        scaler.update()
    want = torch.tensor([0.5, -0.25, 1.0]) - 0.5 * C  # one step from a buffer initialised to the grad
    return w.detach().tolist(), want.tolist(), torch.equal(w.detach(), want)


def real_overflow():
    """fp16 autocast at the default init_scale: the first scaled backward overflows by itself (d loss/d out
    = 2**16 is inf in fp16), the next two are clean; fused SGD compared with the unfused one."""
    def train(fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=fused)
        scaler = torch.amp.GradScaler("cpu")  # init_scale 2**16
        x = torch.full((1, 4), 0.25)
        skipped = []
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(out.float().sum()).backward()
            skipped.append(not all(p.grad.isfinite().all() for p in model.parameters()))
            scaler.step(opt)
            scaler.update()
        return model.weight.detach(), skipped
    got, skipped = train(fused=True)
    want, _ = train(fused=False)
    return (f"overflowed per step {skipped}; fused weight row 0 {got[0].tolist()}",
            want[0].tolist(), torch.allclose(got, want))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    parser.add_argument("--real-overflow", action="store_true",
                        help="an fp16 autocast model whose first scaled backward overflows by itself")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True, warn_only=True)  # torch.empty* is NaN-filled: no luck involved
    if args.with_fix:
        apply_fix()
    if args.real_overflow:
        got, want, ok = real_overflow()
        print(f"observed: {got}")
        print(f"expected: weight row 0 {want} (as unfused SGD: the overflowing first step skipped entirely)")
    else:
        got, want, ok = written_inf()
        print(f"observed: params after a skipped first step and a clean one: {got}")
        print(f"expected: {want} (the first step skipped entirely)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
