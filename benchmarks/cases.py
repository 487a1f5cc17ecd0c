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


def count_syncs_and_collectives(placement: str):
    """One scaler step on this rank; returns (host syncs, collectives) it cost.

    placement: "cpu" (CPU grads), "cuda" (CUDA grads), "mixed" (grads on both, CUDA scale).
    Host syncs are counted by torch.cuda's sync debug mode (it warns on each one).
    """
    import warnings

    from scaler_impl import DeviceSplitGradScaler

    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "mixed": ["cpu", "cuda"]}[placement]
    params = [torch.randn(1000, device=devices[i % len(devices)], requires_grad=True) for i in range(4)]
    scaler = DeviceSplitGradScaler(device="cuda" if "cuda" in devices else "cpu")
    opt = torch.optim.SGD(params, lr=0.1)
    loss_device = "cuda" if "cuda" in devices else "cpu"
    scaler.scale(sum((p.to(loss_device) ** 2).sum() for p in params)).backward()
    calls = {"n": 0}
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)
    dist.all_reduce = counting
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.step(opt)
            scaler.update()
    finally:
        dist.all_reduce = real
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) and "prototype" not in str(w.message) for w in caught)
    return syncs, calls["n"]


def cuda_matmul_all_reduce():
    """What a typical GPU check leaves on a rank: a matmul (cuBLAS's handle and workspace), an fp16 autocast
    step and a gloo all_reduce of a CUDA tensor."""
    from fsdp_amp_suite.harness import rank_device

    x = torch.randn(256, 256, device=rank_device())
    with torch.autocast("cuda", dtype=torch.float16):
        y = (x @ x).float()
    dist.all_reduce(y)
    return float(y.abs().sum())
