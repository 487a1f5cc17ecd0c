"""python -m fsdp_amp_suite.conformance.checkpoints: the installed torch's checkpoints (see __init__)."""
import math
import os
import tempfile

import torch
import torch.distributed as dist

from scaler_impl import DeviceSplitGradScaler
from fsdp_amp_suite.conformance.checkpoints import HERE, PATTERN, SETTINGS, SPLIT


def saved(make) -> dict:
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = make()
    for bad in PATTERN[:SPLIT]:
        opt.zero_grad()
        scaler.scale(w.sum()).backward()
        if bad:
            w.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
    return scaler.state_dict()


def main():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            makers = {"torch_amp": lambda: torch.amp.GradScaler("cpu", **SETTINGS),
                      "torch_sharded": lambda: ShardedGradScaler(device="cpu", **SETTINGS),
                      "ours": lambda: DeviceSplitGradScaler("cpu", **SETTINGS)}
            version = torch.__version__.split("+")[0]
            for name, make in makers.items():
                path = HERE / f"{name}-torch-{version}.pt"
                torch.save(saved(make), path)
                print(f"{path.name}: {torch.load(path, weights_only=True)}")
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
