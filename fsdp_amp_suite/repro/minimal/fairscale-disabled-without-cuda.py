import warnings

import torch
import torch.distributed as dist
from fairscale.optim.grad_scaler import ShardedGradScaler

if torch.cuda.is_available():
    print("skip: shows only on a machine without CUDA")
    raise SystemExit(77)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
warnings.simplefilter("ignore")  # fairscale warns that it disables itself, then steps anyway
model = torch.nn.Linear(8, 1, bias=False)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
scaler = ShardedGradScaler(init_scale=256.0)  # it has no device argument
scaler.scale(model(torch.ones(2, 8)).sum()).backward()
model.weight.grad[0, 0] = float("inf")  # an overflow in the backward
scaler.step(opt)
scaler.update()
finite = bool(torch.isfinite(model.weight).all())
print(f"observed: scaler enabled {scaler.is_enabled()}, weights finite after the step {finite}")
print("expected: the overflowing step is skipped, the weights stay finite")
raise SystemExit(0 if finite else 1)
