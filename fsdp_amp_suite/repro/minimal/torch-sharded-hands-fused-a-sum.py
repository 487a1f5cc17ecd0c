import tempfile
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def rank_main(rank, store):
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
    opt = torch.optim.SGD([w], lr=0.5, fused=True)
    scaler = ShardedGradScaler(device="cpu", init_scale=256.0)
    scaler.scale(w.sum()).backward()
    w.grad[rank] = float("inf")  # both ranks overflow
    scaler.unscale_(opt)  # as gradient clipping does: found_inf is summed over the ranks
    scaler.step(opt)
    if rank == 0:
        print(f"observed: w after the step {w.detach().tolist()}")
        print("expected: [0.5, -0.25, 1.0] (both ranks overflowed: the step is skipped)")
    raise SystemExit(int(w.detach().tolist() != [0.5, -0.25, 1.0]))

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [mp.get_context("spawn").Process(target=rank_main, args=(r, f"{tmp}/store")) for r in range(2)]
        [p.start() for p in ranks], [p.join(120) for p in ranks]
    raise SystemExit(2 if ranks[0].exitcode is None else ranks[0].exitcode)
