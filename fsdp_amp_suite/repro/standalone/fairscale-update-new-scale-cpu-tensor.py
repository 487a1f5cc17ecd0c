"""fairscale ShardedGradScaler.update(new_scale=<CPU tensor>) is refused even when the scale lives on CPU

fairscale's scaler supports a scale on CPU (it is created on the device of the first scaled loss: CPU for a
CPU model, or when the loss is moved to CPU-offloaded params as in fairscale issue #421), but update() still
asserts `isinstance(new_scale, torch.cuda.FloatTensor)`, so a 1-element CPU tensor, on the scale's own
device, raises AssertionError. torch's GradScaler and ShardedGradScaler accept a tensor on the scale's
device. Needs CUDA (without it the scaler disables itself and update() does nothing); seen with fairscale
0.4.13 on torch 2.11 with an H100.

    python fairscale-update-new-scale-cpu-tensor.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: fairscale/optim/grad_scaler.py, `ShardedGradScaler.update`: `assert isinstance(new_scale,
torch.cuda.FloatTensor), reason` for any new_scale that is not a Python float.

Fix: check a tensor new_scale as torch.amp.GradScaler.update does, `new_scale.device == self._scale.device`
(with numel() == 1 and requires_grad False), then `self._scale.copy_(new_scale)`. --with-fix wraps
`update` so for a tensor new_scale.

Related: none found.
"""
import argparse
import sys
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from fairscale.optim import grad_scaler as fs
from fairscale.optim.grad_scaler import ShardedGradScaler


def apply_fix():
    """The proposed fix, monkeypatched: update() accepts a 1-element tensor on the scale's device."""
    original = ShardedGradScaler.update

    def update(self, new_scale=None):
        if not (self._enabled and isinstance(new_scale, torch.Tensor)):
            return original(self, new_scale)
        reason = "new_scale should be a float or a 1-element tensor on the scale's device with requires_grad=False."
        assert new_scale.device == self._scale.device, reason  # was: isinstance(new_scale, torch.cuda.FloatTensor)
        assert new_scale.numel() == 1 and not new_scale.requires_grad, reason
        self._scale.copy_(new_scale)
        self._per_optimizer_states = defaultdict(fs._refresh_per_optimizer_state)

    ShardedGradScaler.update = update


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the proposed fix first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    warnings.filterwarnings("ignore")
    if args.with_fix:
        apply_fix()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the scaler all-reduces
    model = torch.nn.Linear(4, 2)  # a CPU model: the loss, hence the scale, on CPU
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = ShardedGradScaler(init_scale=256.0)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt)
    try:
        scaler.update(new_scale=torch.tensor(32.0))  # a CPU tensor, like the scale it replaces
        got = f"the scale is now {scaler.get_scale()}"
    except AssertionError as exc:
        got = f"raised AssertionError: {exc}"
    dist.destroy_process_group()
    print(f"observed: scale on CPU, update(new_scale=torch.tensor(32.0)): {got}")
    print("expected: the scale is now 32.0")
    return 1 if got != "the scale is now 32.0" else 0


if __name__ == "__main__":
    sys.exit(main())
