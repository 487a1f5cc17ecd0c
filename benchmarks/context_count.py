"""How many processes can hold a CUDA context on GPU 0 at once: fsdp_amp_suite/harness/budget.py CONTEXT_LIMIT,
under which the rank pools' context budget stays.

    python -m benchmarks.context_count [--limit 200] [--streams 0]

Starts processes one at a time, each making GPU 0's primary context through the driver API (no torch import, so
each starts in tens of ms), allocating 1 MiB and, with --streams N, queueing a memset on each of N new streams;
every process holds its context until the end. Stops at the third process whose context fails, or at --limit.
Run it on an idle GPU: other processes' contexts count against the limit. Last line:
max_contexts=<processes that held a context at once> (with the first failure's error and GPU memory in use).
"""
import argparse
import subprocess
import sys

from fsdp_amp_suite.harness.budget import gpu_memory_mib, visible_gpus

CHILD = r'''
import ctypes, sys
streams = int(sys.argv[1])
cuda = ctypes.CDLL("libcuda.so.1")
def check(status, call):
    if status != 0:
        print(f"{call} returned CUresult {status}", flush=True)
        sys.stdin.read()
        sys.exit(0)
check(cuda.cuInit(0), "cuInit")
dev, ctx, buf = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
check(cuda.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(1 << 20)), "cuMemAlloc")
for _ in range(streams):
    stream = ctypes.c_void_p()
    check(cuda.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    check(cuda.cuMemsetD8Async(buf, ctypes.c_ubyte(1), ctypes.c_size_t(1 << 20), stream), "cuMemsetD8Async")
check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
print("ok", flush=True)
sys.stdin.read()
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=200, help="stop after this many processes")
    ap.add_argument("--streams", type=int, default=0, help="streams each process makes and uses")
    args = ap.parse_args()
    if not visible_gpus():
        sys.exit("benchmarks.context_count needs a GPU (nvidia-smi)")
    procs, held, failed = [], 0, []
    try:
        while len(procs) < args.limit and len(failed) < 3:
            p = subprocess.Popen([sys.executable, "-c", CHILD, str(args.streams)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            answer = p.stdout.readline().strip()
            if answer == "ok" and not failed:
                held += 1
            elif answer != "ok":
                failed.append((len(procs), answer or "no answer", gpu_memory_mib(0, "used")))
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait()
    first = (f"; process {failed[0][0]} failed: {failed[0][1]}, with {failed[0][2]:.0f} MiB of GPU memory in use"
             if failed else f"; none failed up to --limit {args.limit}")
    print(f"max_contexts={held}{first}")


if __name__ == "__main__":
    main()
