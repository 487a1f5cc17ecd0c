"""Unscale + inf check throughput of the scalers, against the machine's in-place ceiling.

    python -m benchmarks.scaler [--numel 50000000] [--tensors 200] [--repeats 5]

CPU: ~50M fp32 grads in ~200 tensors, unscaled by `ours`, torch's ShardedGradScaler(device="cpu")
and fairscale's per-tensor CPU loop (its real method), against `torch._foreach_mul_(grads, 1.0)` on
the same tensors (read + write counted). CUDA (when present): the same against the device's
in-place ceiling, plus host syncs (torch.cuda sync debug mode) and collectives per step.
Last line: cpu_unscale_vs_inplace=<ours GB/s / in-place GB/s>. Targets: >= 0.8, and >= 5x the loop.
"""
import argparse
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.cases import count_syncs_and_collectives
from scaler_impl import DeviceSplitGradScaler
from fsdp_amp_suite.harness import run_on_ranks, shutdown_pools


def make_grads(numel, tensors, device):
    each = numel // tensors
    params = [torch.zeros(each, device=device, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(each, device=device)
    return params


def best_seconds(fns: dict, repeats, device) -> dict:
    """Best time of each fn, measured in interleaved rounds so that drift in the machine's
    bandwidth (2 shared cores) hits the baseline and the candidates alike."""
    for fn in fns.values():
        fn()  # warm-up
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def scaler_unscale(scaler, params):
    """One unscale_ per call; the scale alternates 2 <-> 0.5 so grads neither underflow nor grow."""
    opt = torch.optim.SGD(params, lr=0.0)
    state = {"scale": 2.0}

    def run():
        scaler.unscale_(opt)
        state["scale"] = 0.5 if state["scale"] == 2.0 else 2.0
        scaler.update(state["scale"])
    scaler.scale(torch.ones((), device=params[0].device))
    return run


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    store = tempfile.mktemp(prefix="bench-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    params = make_grads(args.numel, args.tensors, "cpu")
    grads = [p.grad for p in params]
    nbytes = 2 * sum(g.numel() * g.element_size() for g in grads)  # read + write
    print(f"CPU: {args.numel / 1e6:.0f}M fp32 grads in {args.tensors} tensors, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    ours = DeviceSplitGradScaler(device="cpu")
    fns = {"inplace": lambda: torch._foreach_mul_(grads, 1.0), "ours": scaler_unscale(ours, params),
           "torch_sharded": scaler_unscale(ShardedGradScaler(device="cpu"), params)}
    try:
        from fairscale.optim.grad_scaler import ShardedGradScaler as FairscaleScaler
        loop = FairscaleScaler._foreach_non_finite_check_and_unscale_cpu_
        fns["fairscale_loop"] = lambda: loop(None, grads, torch.zeros(1), torch.full((1,), 1.0))
    except ImportError:
        print("  fairscale not installed: per-tensor loop skipped")
    rate = {name: gbps(nbytes, t) for name, t in best_seconds(fns, args.repeats, "cpu").items()}
    ceiling, ours_gbps = rate["inplace"], rate["ours"]
    print(f"  in-place ceiling (_foreach_mul_ 1.0): {ceiling:6.1f} GB/s")
    print(f"  ours:                                 {ours_gbps:6.1f} GB/s  ({ours_gbps / ceiling:.2f} of ceiling)")
    print(f"  torch_sharded (device=cpu):           {rate['torch_sharded']:6.1f} GB/s  "
          f"({rate['torch_sharded'] / ceiling:.2f})")
    if "fairscale_loop" in rate:
        print(f"  fairscale per-tensor loop:            {rate['fairscale_loop']:6.1f} GB/s  "
              f"(ours is {ours_gbps / rate['fairscale_loop']:.1f}x)")
    syncs, colls = run_on_ranks(count_syncs_and_collectives, "cpu", world_size=2)[0]
    print(f"  ours, one step on 2 gloo ranks (CPU grads): {colls} collective(s), {syncs} host sync(s)")

    if torch.cuda.is_available():
        cparams = make_grads(args.numel, args.tensors, "cuda")
        cgrads = [p.grad for p in cparams]
        print(f"CUDA ({torch.cuda.get_device_name()}):")
        crate = {name: gbps(nbytes, t) for name, t in best_seconds(
            {"inplace": lambda: torch._foreach_mul_(cgrads, 1.0),
             "ours": scaler_unscale(DeviceSplitGradScaler(device="cuda"), cparams),
             "torch_sharded": scaler_unscale(ShardedGradScaler(device="cuda"), cparams)}, args.repeats, "cuda").items()}
        cceil = crate["inplace"]
        print(f"  in-place ceiling (_foreach_mul_ 1.0): {cceil:7.1f} GB/s")
        print(f"  ours:                                 {crate['ours']:7.1f} GB/s  "
              f"({crate['ours'] / cceil:.2f} of ceiling)")
        print(f"  torch_sharded:                        {crate['torch_sharded']:7.1f} GB/s  "
              f"({crate['torch_sharded'] / cceil:.2f})")
        for placement in ("cuda", "mixed"):
            syncs, colls = run_on_ranks(count_syncs_and_collectives, placement, world_size=2, device="cuda-shared")[0]
            print(f"  ours, one step on 2 gloo ranks sharing the GPU ({placement} grads): {syncs} host sync(s), "
                  f"{colls} collective(s)")
    else:
        print("CUDA: not available, skipped")
    dist.destroy_process_group()
    shutdown_pools()
    print(f"cpu_unscale_vs_inplace={ours_gbps / ceiling:.3f}")


if __name__ == "__main__":
    main()
