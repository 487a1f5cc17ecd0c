"""DTensor grads under torch's scalers: who agrees on found_inf, over which ranks.

(a) torch.amp.GradScaler relies on DTensor to agree on found_inf. DTensor's handler for
    torch._amp_foreach_non_finite_check_and_unscale_ (found_inf_reduce_handler in
    torch/distributed/tensor/_dispatch.py) reduces found_inf along the mesh dims where the FIRST grad
    of the list is sharded, over that grad's mesh only. Put a TP-replicated norm first in the optimizer
    (the no-decay group first, as many trainers build it) and an inf in one TP rank's shard of a
    TP-sharded weight: the ranks of the other TP column never hear of it and step.
    The same handler under HSDP (FSDP2 on a (replicate, shard) mesh): every grad is (Replicate(), Shard(0)),
    so found_inf is reduced within each replica only, and an inf in one replica's grads (rank 3's) makes
    that replica alone skip and back off.
(b) One optimizer with a DTensor param and a plain tensor param on the same device and dtype: torch's
    scalers unscale them in one kernel call, which DTensor dispatch refuses ("got mixed torch.Tensor and
    DTensor").
Four gloo ranks on CPU, mesh [[0, 1], [2, 3]] with dims (dp, tp); grads set directly (c * scale), no FSDP.

    python -m fsdp_amp_suite.repro dtensor_found_inf
"""
import math

import torch
import torch.distributed as dist

from fsdp_amp_suite.harness import cached_mesh, run_on_ranks
from fsdp_amp_suite.repro.runner import Outcome, case
from fsdp_amp_suite.scalers import make_scaler


def _replicated_norm_first(scaler):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank = dist.get_rank()
    mesh = cached_mesh("cpu", (2, 2), ("dp", "tp"))
    norm = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Shard(0), Replicate()], run_check=False))
    weight = torch.nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0), Shard(1)], run_check=False))
    s = make_scaler(scaler, device="cpu", init_scale=256.0)
    s.scale(torch.ones(()))
    norm.grad = DTensor.from_local(torch.full((2,), 256.0), mesh, [Shard(0), Replicate()], run_check=False)
    local = torch.full((2, 2), 256.0)
    if rank == 1:
        local[0, 0] = math.inf  # one TP rank's shard of the sharded weight overflows
    weight.grad = DTensor.from_local(local, mesh, [Shard(0), Shard(1)], run_check=False)
    opt = torch.optim.SGD([norm, weight], lr=0.5, foreach=False)  # the norm (no-decay) first
    s.step(opt)
    s.update()
    return not torch.equal(weight.to_local(), torch.ones(2, 2))


@case("2D mesh (dp x tp): a TP-replicated norm first in the optimizer, an inf in rank 1's shard of a TP-sharded weight",
      bugs=["dtensor-found-inf-first-grad-placements", "fairscale-disabled-without-cuda"], needs="dtensor")
def test_replicated_norm_first_then_inf_in_a_sharded_weight(scaler):
    stepped = run_on_ranks(_replicated_norm_first, scaler, world_size=4)
    return Outcome(any(stepped), f"stepped per rank: {stepped}", "every rank skips: [False, False, False, False]")


def _one_replica_overflows(scaler):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank = dist.get_rank()
    mesh = cached_mesh("cpu", (2, 2), ("replicate", "shard"))
    hsdp = [Replicate(), Shard(0)]  # how FSDP2 places every param and grad on a 2D mesh
    params = [torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, hsdp, run_check=False)) for _ in range(2)]
    s = make_scaler(scaler, device="cpu", init_scale=256.0)
    s.scale(torch.ones(()))
    for i, p in enumerate(params):
        local = torch.full((2,), 256.0)
        if rank == 3 and i == 1:
            local[0] = math.inf  # replica 1's shard 1 overflows
        p.grad = DTensor.from_local(local, mesh, hsdp, run_check=False)
    s.step(torch.optim.SGD(params, lr=0.5, foreach=False))
    s.update()
    return not torch.equal(params[0].to_local(), torch.ones(2))


@case("HSDP (replicate x shard, as FSDP2 places every grad): an inf in one replica's shard (rank 3)",
      bugs=["dtensor-found-inf-hsdp-one-replica", "fairscale-disabled-without-cuda"], needs="dtensor")
def test_an_inf_in_one_hsdp_replica(scaler):
    stepped = run_on_ranks(_one_replica_overflows, scaler, world_size=4)
    return Outcome(any(stepped), f"stepped per rank: {stepped}", "every rank skips: [False, False, False, False]")


def _dtensor_and_plain(scaler):
    from torch.distributed.tensor import DTensor, Shard

    mesh = cached_mesh("cpu", (2,), ("dp",))
    sharded = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False))
    plain = torch.nn.Parameter(torch.ones(2))
    s = make_scaler(scaler, device="cpu", init_scale=256.0)
    s.scale(torch.ones(()))
    sharded.grad = DTensor.from_local(torch.full((2,), 256.0), mesh, [Shard(0)], run_check=False)
    plain.grad = torch.full((2,), 256.0)
    s.step(torch.optim.SGD([sharded, plain], lr=0.5, foreach=False))
    s.update()
    return plain.detach().tolist()


# fairscale_sharded: no entry of the case's own. Without CUDA it disables itself (KNOWN_BUGS
# fairscale-disabled-without-cuda claims every check there); with CUDA it passes this case (seen on torch 2.11)
@case("1D mesh: one optimizer with a DTensor param and a plain tensor param, a clean step",
      bugs=["dtensor-mixed-with-tensor-grads"], needs="dtensor")
def test_dtensor_and_plain_grads_in_one_optimizer(scaler):
    got = run_on_ranks(_dtensor_and_plain, scaler, world_size=2)
    return Outcome(got != [[0.5, 0.5]] * 2, f"plain param after the step per rank: {got}", "[[0.5, 0.5], [0.5, 0.5]]")
