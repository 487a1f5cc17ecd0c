"""Small multi-rank cases shared by the benchmarks (module-level, so ranks can unpickle them)."""
import torch
import torch.distributed as dist


def fsdp_mlp_three_steps(seed: int = 0):
    """A tiny MLP under torch FSDP1 on CPU (gloo), 3 SGD+momentum steps with our scaler."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from scaler_impl import DeviceSplitGradScaler

    torch.manual_seed(seed)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                 device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = DeviceSplitGradScaler(device="cpu", init_scale=2.0**10)
    losses = []
    for _ in range(3):
        x = torch.randn(4, 8) + dist.get_rank()
        loss = model(x).square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    return torch.stack(losses)
