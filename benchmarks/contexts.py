"""GPU memory that one rank of a GPU pool holds between tasks: the number fsdp_amp_suite/harness/budget.py CONTEXT_GIB
is checked against.

    python -m benchmarks.contexts [--ranks 4]

Reads GPU 0's memory in use (nvidia-smi), starts a `cuda-shared` pool of N ranks on it, runs a task that uses
cuBLAS, autocast and a gloo all_reduce (benchmarks.cases), and reads the memory again: the ranks' CUDA
contexts plus what a task leaves behind once the pool has emptied the CUDA cache. Run it on an idle GPU: other
processes' memory counts too. Last line: context_gib=<(in use after - before) / N>.
"""
import argparse
import sys

from benchmarks.cases import cuda_matmul_all_reduce
from fsdp_amp_suite.harness import Harness
from fsdp_amp_suite.harness.budget import gpu_memory_mib


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks.contexts needs a GPU")
    before = gpu_memory_mib(0, "used")
    with Harness() as harness:
        harness.run(cuda_matmul_all_reduce, world_size=args.ranks, device="cuda-shared")
        after = gpu_memory_mib(0, "used")
    print(f"GPU 0 memory in use: {before:.0f} MiB before, {after:.0f} MiB with {args.ranks} ranks after a task")
    print(f"context_gib={(after - before) / args.ranks / 1024:.2f}")


if __name__ == "__main__":
    main()
