"""Does FSDP2 (fully_shard) train on CPU on this torch? Two gloo ranks, no GPU needed.

    python -m fsdp_amp_suite.matrix.probe_fsdp2_cpu
    # from the repo root: a line per configuration, then fsdp2_cpu=ok|broken

Measures the floor behind FSDP2_CPU_TORCH in fsdp_amp_suite/matrix/implementations.py: every configuration the matrix
and tests/conformance/test_fsdp2.py run on CPU (offload on/off, fp32/fp16/bf16, root/nested), three
steps of forward, backward, unscale-free clip, SGD, then full_tensor() of every parameter.
"""
from __future__ import annotations

import itertools
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_amp_suite.matrix.implementations import fsdp2_api

CONFIGS = list(itertools.product((False, True), (None, torch.float16, torch.bfloat16), (False, True)))


def _train(offload, dtype, nested):
    from torch.distributed.device_mesh import init_device_mesh

    api = fsdp2_api()
    fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy = (api.fully_shard, api.CPUOffloadPolicy,
                                                           api.MixedPrecisionPolicy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    kw = dict(mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    if dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if nested:
        fully_shard(model[0], **kw)
    fully_shard(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        model(torch.randn(4, 8) + dist.get_rank()).float().square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().sum().item() for p in model.parameters()]


def _rank(rank, world, store_dir, results):
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    out = []
    for offload, dtype, nested in CONFIGS:
        name = f"offload={offload!s:5} dtype={str(dtype).replace('torch.', ''):8} nested={nested!s:5}"
        try:
            _train(offload, dtype, nested)
            out.append(f"{name} ok")
        except Exception as exc:  # noqa: BLE001 -- the probe reports whatever breaks
            where = traceback.extract_tb(exc.__traceback__)[-1]
            out.append(f"{name} FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:90]} "
                       f"({os.path.basename(where.filename)}:{where.lineno} {where.name})")
    results[rank] = out
    dist.destroy_process_group()


def main() -> int:
    print(f"torch {torch.__version__} (cuda build {torch.version.cuda}, cuda available {torch.cuda.is_available()}), "
          f"python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as store_dir, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(2, store_dir, results), nprocs=2, join=True)
        lines = results[0]
    print("\n".join(lines))
    ok = all(line.endswith(" ok") for line in lines)
    print(f"fsdp2_cpu={'ok' if ok else 'broken'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
