"""fairscale ShardedGradScaler with DTensor grads (FSDP2, tensor parallelism), on a machine with CUDA.

(a) DTensor grads on CPU (a CPU mesh): fairscale checks each rank's local shard in a Python loop
    (_foreach_non_finite_check_and_unscale_cpu_) and all-reduces the CPU found_inf on a CUDA copy whose
    result it throws away (as in fairscale-cpu-found-inf-not-agreed):

        v_on_cuda = v.cuda()
        last_handle = dist.all_reduce(v_on_cuda, async_op=True, group=self.group)
        v_on_cuda.cpu()          # the reduced value is never written back into v

    An inf in rank 1's shard of a Shard(0) DTensor grad makes rank 1 alone skip and back off; rank 0 steps
    (KNOWN_BUGS fairscale-cpu-found-inf-not-agreed-dtensor).
(b) DTensor grads on CUDA: fairscale unscales them as torch's scalers do, one
    torch._amp_foreach_non_finite_check_and_unscale_ call per device and dtype, so one optimizer with a
    DTensor param and a plain tensor param raises "got mixed torch.Tensor and DTensor"
    (KNOWN_BUGS fairscale-dtensor-mixed-with-tensor-grads; torch's scalers: dtensor-mixed-with-tensor-grads).

Two gloo ranks, a 1D mesh of both; grads set directly (c * scale), no FSDP. Needs one GPU: without CUDA
fairscale disables itself (fairscale-disabled-without-cuda).

    python -m fsdp_amp_suite.repro fairscale_dtensor_grads
"""
import math

import torch
import torch.distributed as dist

from fsdp_amp_suite.harness import cached_mesh, run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler


def _inf_in_rank1s_cpu_shard(scaler):
    from torch.distributed.tensor import DTensor, Shard

    rank = dist.get_rank()
    mesh = cached_mesh("cpu", (2,), ("dp",))
    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False))
    s = make_scaler(scaler, device="cpu", init_scale=256.0)
    s.scale(torch.ones(()))
    local = torch.full((2,), 256.0)
    if rank == 1:
        local[0] = math.inf  # only rank 1's shard overflowed
    weight.grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    s.step(torch.optim.SGD([weight], lr=0.5, foreach=False))
    s.update()
    return dict(stepped=not torch.equal(weight.to_local(), torch.ones(2)), scale=float(s.get_scale()))


@case("1D CPU mesh (as FSDP2 on CPU builds it): an inf in rank 1's shard of a DTensor grad (2 gloo ranks)",
      bugs=["fairscale-cpu-found-inf-not-agreed-dtensor"], needs="cuda")
def test_inf_in_one_ranks_shard_of_a_cpu_dtensor_grad(scaler):
    out = run_on_ranks(_inf_in_rank1s_cpu_shard, scaler, world_size=2)
    want = [dict(stepped=False, scale=128.0)] * 2
    return Outcome(out != want, f"per rank: {out}", f"every rank skips and backs off once: {want}")


def _dtensor_and_plain_on_cuda(scaler):
    from torch.distributed.tensor import DTensor, Shard

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = cached_mesh("cuda", (2,), ("dp",))
    sharded = torch.nn.Parameter(DTensor.from_local(torch.ones(2, device=device), mesh, [Shard(0)], run_check=False))
    plain = torch.nn.Parameter(torch.ones(2, device=device))
    s = make_scaler(scaler, device="cuda", init_scale=256.0)
    s.scale(torch.ones((), device=device))
    sharded.grad = DTensor.from_local(torch.full((2,), 256.0, device=device), mesh, [Shard(0)], run_check=False)
    plain.grad = torch.full((2,), 256.0, device=device)
    s.step(torch.optim.SGD([sharded, plain], lr=0.5, foreach=False))
    s.update()
    return plain.detach().cpu().tolist()


@case("1D CUDA mesh: one optimizer with a DTensor param and a plain tensor param, a clean step (2 gloo ranks "
      "sharing one GPU)", bugs=["fairscale-dtensor-mixed-with-tensor-grads", "dtensor-mixed-with-tensor-grads"],
      needs="cuda")
def test_dtensor_and_plain_cuda_grads_in_one_optimizer(scaler):
    got = run_on_ranks(_dtensor_and_plain_on_cuda, scaler, world_size=2, device="cuda-shared")
    return Outcome(got != [[0.5, 0.5]] * 2, f"plain param after the step per rank: {got}", "[[0.5, 0.5], [0.5, 0.5]]")
