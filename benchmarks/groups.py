"""How many process groups a pool rank holds after serving checks: a check that makes groups per task leaks them
into a rank that lives for the whole run (tests/meta/test_harness.py checks the convention statically).

    python -m benchmarks.groups [--device cpu|cuda-shared] [--tasks N]

Runs N tasks in one pool of 2 ranks, each making a 1-D full-world DeviceMesh the two ways: torch's init_device_mesh
(a fresh mesh per task) and the harness's cached_mesh (one per rank process). Last line: groups_per_task=<growth of
the rank's process groups per task with init_device_mesh> cached_groups_per_task=<the same with cached_mesh>.
"""
import argparse


def _count_after(maker: str, device_type: str) -> int:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_amp_suite.harness import cached_mesh

    if maker == "init_device_mesh":
        init_device_mesh(device_type, (dist.get_world_size(),))
    else:
        cached_mesh(device_type, (dist.get_world_size(),), ("dp",))
    return len(c10d._world.pg_names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda-shared"])
    ap.add_argument("--tasks", type=int, default=5)
    args = ap.parse_args()
    from fsdp_amp_suite.harness import Harness

    device_type = "cuda" if args.device == "cuda-shared" else "cpu"
    rates = {}
    with Harness() as harness:
        for maker in ("init_device_mesh", "cached_mesh"):
            counts = [harness.run(_count_after, maker, device_type, world_size=2, device=args.device)[0]
                      for _ in range(args.tasks + 1)]
            rates[maker] = (counts[-1] - counts[0]) / args.tasks
            print(f"{maker}: process groups in rank 0 after each task: {counts}")
    print(f"groups_per_task={rates['init_device_mesh']:g} cached_groups_per_task={rates['cached_mesh']:g}")


if __name__ == "__main__":
    main()
