"""DTensor grads: two gloo ranks train an MLP under FSDP2 (fully_shard on a CPU DeviceMesh).

Each rank holds a shard of every grad as a DTensor; an inf in rank 1's shard must make every
rank skip and back off, and a clean step must apply everywhere.
"""
import math

import pytest
import torch
import torch.distributed as dist

from fsdp_amp_suite.scalers import make_scaler
from fsdp_amp_suite.harness import cached_mesh, run_on_ranks
from fsdp_amp_suite.matrix.implementations import FSDP2_CPU_REASON, FSDP2_CPU_TORCH, fsdp2_api
from fsdp_amp_suite.versions import holds

pytestmark = [pytest.mark.conformance,
              pytest.mark.skipif(not torch.cuda.is_available() and holds(torch=FSDP2_CPU_TORCH),
                                 reason=FSDP2_CPU_REASON),
              pytest.mark.report_column("FSDP2")]


def _fsdp2_step(spec, bad):
    rank = dist.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    fsdp2_api().fully_shard(model, mesh=cached_mesh("cpu", (dist.get_world_size(),), ("dp",)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    s = make_scaler(spec, device="cpu", init_scale=256.0)
    s.scale(model(torch.randn(4, 8) + rank).square().mean()).backward()
    first = next(model.parameters())
    if bad and rank == 1:
        with torch.no_grad():
            first.grad.to_local().view(-1)[0] = math.inf
    before = [p.to_local().detach().clone() for p in model.parameters()]
    s.step(opt)
    s.update()
    after = [p.to_local().detach().clone() for p in model.parameters()]
    return dict(grad_type=type(first.grad).__name__, scale=s.get_scale(),
                stepped=all(not torch.equal(a, b) for a, b in zip(before, after)),
                untouched=all(torch.equal(a, b) for a, b in zip(before, after)))


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "inf_on_rank1"])
def test_fsdp2_dtensor_grads_agree_across_ranks(scaler, bad):
    out = run_on_ranks(_fsdp2_step, scaler, bad, world_size=2, timeout=60)
    assert [o["grad_type"] for o in out] == ["DTensor", "DTensor"], "FSDP2 should leave DTensor grads"
    if bad:
        assert all(o["untouched"] for o in out) and [o["scale"] for o in out] == [128.0, 128.0]
    else:
        assert all(o["stepped"] for o in out) and [o["scale"] for o in out] == [256.0, 256.0]
