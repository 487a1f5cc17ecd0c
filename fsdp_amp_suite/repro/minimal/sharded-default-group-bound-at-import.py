import pickle

import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
scaler = ShardedGradScaler("cpu", process_group=dist.group.WORLD)
try:
    pickle.dumps(scaler)  # as torch.amp.GradScaler pickles between iterations
    print("observed: the scaler pickles")
    bug = False
except TypeError as exc:
    print(f"observed: TypeError: {exc}")
    bug = True
print("expected: the scaler pickles, as torch.amp.GradScaler does")
raise SystemExit(int(bug))
