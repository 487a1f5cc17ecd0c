"""fairscale ShardedGradScaler.step passes grad_scaler=self to fused optimizers: TypeError on every step

fairscale.optim.grad_scaler.ShardedGradScaler with any torch optimizer built with fused=True (Adam,
AdamW, SGD, Adagrad): step() calls optimizer.step(grad_scaler=self), a contract torch dropped; the fused
optimizers' step() takes only a closure and raises TypeError: ... got an unexpected keyword argument
'grad_scaler'. Every step raises, the first clean one included, so fairscale FSDP cannot train with a
fused optimizer at all. Needs CUDA (without it fairscale's scaler disables itself); seen with fairscale
0.4.13 on torch 2.11 with an H100.

    python fairscale-fused-optimizer-kwarg.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `ShardedGradScaler.step`: for an optimizer with
`_step_supports_amp_scaling` it returns `optimizer.step(*args, **dict(kwargs, grad_scaler=self))`,
copied from an old torch.cuda.amp.GradScaler.step. torch's fused optimizers set
`_step_supports_amp_scaling = True` but expect `grad_scale` / `found_inf` attributes (set by torch's
GradScaler.step, which passes grad_scaler only when the optimizer's step() signature has it).

Fix: take that branch only when "grad_scaler" is in `inspect.signature(optimizer.step).parameters`;
otherwise treat the optimizer like any other: fairscale's unscale_ (with its found_inf all_reduce across
ranks) and a step skipped on the host when found_inf is set (the one host sync that the unfused path
has anyway). --with-fix wraps step() so that such an optimizer goes down that path.

Related: none found (fairscale 0.4.13, its last release, predates torch's fused optimizers).
"""
import argparse
import datetime
import inspect
import sys
import warnings

import torch
import torch.distributed as dist


def apply_fix():
    """The proposed fix, monkeypatched: ShardedGradScaler.step sends grad_scaler only to a step() that takes it."""
    from fairscale.optim.grad_scaler import ShardedGradScaler
    original = ShardedGradScaler.step

    def step(self, optimizer, *args, **kwargs):
        if (getattr(optimizer, "_step_supports_amp_scaling", False)
                and "grad_scaler" not in inspect.signature(optimizer.step).parameters):
            optimizer._step_supports_amp_scaling = False  # the unfused path: unscale_, all_reduce, skip on host
            try:
                return original(self, optimizer, *args, **kwargs)
            finally:
                optimizer._step_supports_amp_scaling = True
        return original(self, optimizer, *args, **kwargs)

    ShardedGradScaler.step = step


def clean_step():
    from fairscale.optim.grad_scaler import ShardedGradScaler
    c = torch.tensor([0.25, 0.5, -1.0], device="cuda")  # the exact grad of w in loss = <w, c>
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0], device="cuda"))
    opt = torch.optim.AdamW([w], lr=0.01, fused=True)
    scaler = ShardedGradScaler(init_scale=256.0)
    scaler.scale((w * c).sum()).backward()
    before = w.detach().clone()
    try:
        scaler.step(opt)
    except TypeError as e:
        return f"raised TypeError: {str(e).strip().splitlines()[-1]}", False
    scaler.update()
    stepped = not torch.equal(before, w.detach())
    return f"stepped: {stepped}", stepped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))  # fairscale's unscale_ all-reduces
    if args.with_fix:
        apply_fix()
    got, ok = clean_step()
    dist.destroy_process_group()
    print(f"observed: a clean scaled step with AdamW(fused=True) on CUDA: {got}")
    print("expected: stepped: True")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
