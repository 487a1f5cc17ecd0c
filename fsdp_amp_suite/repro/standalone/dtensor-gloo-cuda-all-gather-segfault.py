"""DTensor.full_tensor() over gloo ranks that share one GPU: both ranks die with SIGSEGV, no error raised

Two gloo ranks on one GPU (a 1-D "cuda" device mesh over a gloo process group, as a test harness or a
single-GPU machine runs a world of 2) gather a Shard(0) DTensor with full_tensor(). Its all-gather goes
through torch.distributed._functional_collectives (all_gather_tensor on torch 2.11); both ranks are killed
by SIGSEGV at the first call, in a native thread (the faulthandler stack ends in wait_tensor), instead of
gathering or raising. FSDP2 without CPU offload on such ranks dies the same way in its parameter all-gather, and so does
clip_grad_norm_ over DTensor grads. The same collective over CPU tensors, or over NCCL with one GPU per
rank, works. Needs CUDA; seen on torch 2.11.0+cu130 with an H100, 4 runs of 4.

    python dtensor-gloo-cuda-all-gather-segfault.py [--with-fix]

Exit status: 1 while the bug is present, 0 once fixed, 77 where this machine cannot run it.

Root cause: not located. The functional all_gather_tensor on CUDA tensors over ProcessGroupGloo crashes the
process (torch/distributed/_functional_collectives.py, all_gather_tensor, then wait_tensor), where gloo
should either gather CUDA tensors or raise that it cannot.

Fix: the workaround --with-fix applies, not a fix of the native code: all_gather_tensor over a gloo group
gathers CPU copies of CUDA tensors and moves the result back. A real fix belongs in ProcessGroupGloo's
all-gather of CUDA tensors, or in a clear error there.

Related: none found for this crash.
"""
import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:  # torch < 2.5 keeps DTensor private (torch.distributed._tensor)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
except ImportError as exc:
    print(f"skip: needs torch >= 2.5 (the public DTensor API): {exc}")
    sys.exit(77)

LIMIT_S = 120  # a rank that neither dies nor finishes by then is killed and reported as hanging


def apply_fix():
    """The workaround, monkeypatched: the functional all-gather (all_gather_single from torch 2.12, all_gather_tensor
    before) over gloo gathers CPU copies of CUDA tensors and moves the result back."""
    import torch.distributed._functional_collectives as funcol

    def on_cpu(gather):
        def gather_via_cpu(self, gather_dim, group, *args, **kwargs):
            if self.is_cuda and dist.get_backend() == "gloo":
                return gather(self.cpu(), gather_dim, group, *args, **kwargs).to(self.device)
            return gather(self, gather_dim, group, *args, **kwargs)
        return gather_via_cpu

    for name in ("all_gather_single", "all_gather_tensor"):
        if hasattr(funcol, name):
            setattr(funcol, name, on_cpu(getattr(funcol, name)))


def _rank(rank, world, store_path, out, with_fix):
    if with_fix:
        apply_fix()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (world,))
    full = torch.arange(8 * 4, dtype=torch.float32, device="cuda").reshape(8, 4)
    # each rank's shard made locally: the all-gather of full_tensor() is the only collective
    gathered = DTensor.from_local(full.chunk(world)[rank], mesh, [Shard(0)]).full_tensor()
    torch.cuda.synchronize()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(dict(equal=bool(torch.equal(gathered.cpu(), full.cpu()))), f)
    dist.destroy_process_group()
    os._exit(0)


def run_ranks(world, with_fix):
    ctx = mp.get_context("spawn")  # CUDA in the ranks
    with tempfile.TemporaryDirectory() as out:
        # the ranks meet through a file, not a port that another process could take before they bind it
        store_path = os.path.join(out, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store_path, out, with_fix)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + LIMIT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        told = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                told.append(f"rank {r} still running after {LIMIT_S} s (killed)")
            elif p.exitcode is not None and p.exitcode < 0:
                told.append(f"rank {r} killed by {signal.Signals(-p.exitcode).name}")
            elif os.path.exists(os.path.join(out, f"{r}.json")):
                equal = json.load(open(os.path.join(out, f"{r}.json")))["equal"]
                told.append(f"rank {r} gathered {'the full tensor' if equal else 'a wrong tensor'}")
            else:
                raise RuntimeError(f"rank {r} failed (exit code {p.exitcode}); its traceback is above")
        return told


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-fix", action="store_true", help="apply the workaround first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip: needs CUDA")
        return 77
    told = run_ranks(2, args.with_fix)
    print(f"observed: {'; '.join(told)}")
    print("expected: rank 0 gathered the full tensor; rank 1 gathered the full tensor")
    return 0 if all(t.endswith("gathered the full tensor") for t in told) else 1


if __name__ == "__main__":
    sys.exit(main())
