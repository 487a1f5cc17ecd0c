import tempfile
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def rank_main(rank, store):
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    w = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    scaler = ShardedGradScaler(device="cpu", init_scale=256.0)
    scaler.scale(w.sum()).backward()
    if rank == 1:
        w.grad[0] = float("inf")  # an overflow in rank 1's shard only
    scaler.step(opt)  # no explicit unscale_: the fused path
    stepped = [None, None]
    dist.all_gather_object(stepped, w.detach().tolist() != [0.5, -0.25, 1.0])
    if rank == 0:
        print(f"observed: stepped per rank {stepped}")
        print("expected: [False, False] (every rank skips the step an overflow on one rank makes)")
    raise SystemExit(int(stepped != [False, False]))

if __name__ == "__main__":
    if torch.__version__ < "2.6":  # before it the fused step raises first, on found_inf's shape [1]
        raise SystemExit(print("skip: needs torch >= 2.6") or 77)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [mp.get_context("spawn").Process(target=rank_main, args=(r, f"{tmp}/store")) for r in range(2)]
        [p.start() for p in ranks], [p.join(120) for p in ranks]
    raise SystemExit(2 if ranks[0].exitcode is None else ranks[0].exitcode)
