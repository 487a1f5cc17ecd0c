"""GradScaler.update(new_scale=torch.tensor([x])) raises: a 1-element tensor is accepted, then not copied

torch.amp.GradScaler.update(new_scale) accepts a tensor it checks for one element ("new_scale should be a float
or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with requires_grad=False."), then copies it into the
0-dim scale with `self._scale.copy_(new_scale)`: a 1-element tensor of shape [1], as torch.tensor([x]) or a
found_inf-like buffer makes, raises RuntimeError: output with shape [] doesn't match the broadcast shape [1].
A 0-dim tensor works. torch's ShardedGradScaler (both its CUDA and its CPU path) and fairscale's
ShardedGradScaler copy the same way. Seen on torch 2.13.0 and 2.15.0 CPU.

    python amp-update-one-element-new-scale.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: torch/amp/grad_scaler.py, `GradScaler.update`: the checks ask `new_scale.numel() == 1`, the copy
needs `new_scale.shape == self._scale.shape` (0-dim). torch/distributed/fsdp/sharded_grad_scaler.py,
`ShardedGradScaler.update`, and fairscale/optim/grad_scaler.py, `ShardedGradScaler.update`, alike.

Fix: copy the value, not the shape: `self._scale.copy_(new_scale.reshape(()))` (or `.squeeze()`), which the
numel() check already guarantees is possible. --with-fix wraps each class's update() so.

Related: none found.
"""
import argparse
import datetime
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def apply_fix():
    """The proposed fix, monkeypatched: a 1-element new_scale reaches update() reshaped to the scale's 0 dims."""
    for cls in (torch.amp.GradScaler, ShardedGradScaler):
        original = cls.__dict__["update"]

        def update(self, new_scale=None, _original=original):
            if isinstance(new_scale, torch.Tensor) and new_scale.numel() == 1:
                new_scale = new_scale.reshape(())
            return _original(self, new_scale)

        cls.update = update


def set_scale(scaler) -> str:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt)
    try:
        scaler.update(new_scale=torch.tensor([32.0]))  # one element, as the check asks
        return f"the scale is now {scaler.get_scale()}"
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    # ShardedGradScaler all-reduces found_inf: a 1-rank group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    got = {name: set_scale(make()) for name, make in (("torch.amp.GradScaler", lambda: torch.amp.GradScaler("cpu")),
                                                      ("ShardedGradScaler", lambda: ShardedGradScaler(device="cpu")))}
    dist.destroy_process_group()
    want = "the scale is now 32.0"
    print("observed: update(new_scale=torch.tensor([32.0])): " + "; ".join(f"{k}: {v}" for k, v in got.items()))
    print(f"expected: {want} for both")
    return 0 if all(v == want for v in got.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
