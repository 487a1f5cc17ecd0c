import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
opt = torch.optim.SGD([w], lr=2.0**-4)
scaler = ShardedGradScaler("cpu", init_scale=2.0**127, growth_interval=1)  # the scale lives on CPU
scales = []
for _ in range(3):  # grad * 2**127 stays finite: every step is clean
    opt.zero_grad()
    scaler.scale((w * torch.tensor([0.25, 0.5, -1.0])).sum()).backward()
    scaler.step(opt)
    scaler.update()
    scales.append(scaler.get_scale())
print(f"observed: scale after each clean step {scales}")
print("expected: the scale stays finite (torch._amp_update_scale_ does not grow it past float32 max)")
raise SystemExit(0 if all(s != float("inf") for s in scales) else 1)
