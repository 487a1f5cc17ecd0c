"""Meshes: DTensor grads of several placements in one optimizer, on a 1D and a 2D (dp x tp) device mesh.

The contract on a mesh: every rank of the job takes the same step or skip decision and holds the same
scale, whichever rank sees the inf or NaN, along whichever mesh dimension, in whichever param (sharded or
replicated along any dimension, on the whole mesh or a sub-mesh, or a plain tensor), and whichever param
comes first in the optimizer (trainers put the decay group first, or the no-decay group of norms and
biases, which tensor parallelism replicates).

No FSDP: each rank builds its local shards and their grads (c * scale, exact) itself and hands them to the
scaler through one SGD. Four gloo ranks, the grads on CPU (placement cpu) or on the one GPU they share
(cuda); the 2D mesh is [[0, 1], [2, 3]] with dims (dp, tp), so rank 1 differs from rank 0 along tp and
rank 2 along dp.
"""

import pytest
import torch
import torch.distributed as dist

from fsdp_amp_suite.conformance.meshes import R, on_mesh
from fsdp_amp_suite.conformance.problem import INF_VALUES, PLACEMENTS, device_of, local, placement_params, run_at
from fsdp_amp_suite.harness import cached_mesh
from fsdp_amp_suite.scalers import make_scaler
from fsdp_amp_suite.versions import DTENSOR_REASON, DTENSOR_TORCH, holds

pytestmark = [pytest.mark.conformance, pytest.mark.skipif(holds(torch=DTENSOR_TORCH), reason=DTENSOR_REASON),
              pytest.mark.report_column("meshes")]

WORLD_SIZE = 4
INIT_SCALE, BACKOFF, LR = 256.0, 0.5, 0.5
# mesh -> its shape and dim names, and the param kinds it holds: kind -> (mesh dims it lives on (None: a
# plain tensor), its placement along each of them, global shape). On 2D: a TP-sharded weight under FSDP, a
# TP-replicated norm under FSDP, an expert's weight on the tp sub-mesh only, a plain tensor of each rank's own.
MESHES = {
    "1d": dict(shape=(4,), names=("dp",), kinds={
        "sharded": (("dp",), (0,), (8,)),
        "replicated": (("dp",), (R,), (2,)),
        "plain": (None, (), (2,)),
    }),
    "2d": dict(shape=(2, 2), names=("dp", "tp"), kinds={
        "sharded": (("dp", "tp"), (0, 1), (4, 4)),
        "replicated": (("dp", "tp"), (0, R), (4,)),
        "expert": (("tp",), (0,), (4,)),
        "plain": (None, (), (2,)),
    }),
}
# the rank that sees the inf or NaN: along each mesh dimension from rank 0 in turn (on 1D: the far end)
INF_RANKS = {"1d": {"dp": 3}, "2d": {"tp": 1, "dp": 2}}


def _bad_value(order: tuple, kind: str) -> str:
    """inf in the kinds at even positions of the order, NaN at odd ones: the rotations put every kind at every
    position, so each kind gets both along each dim, at no extra cases."""
    return "nan" if order.index(kind) % 2 else "inf"


def _orders(mesh: str) -> list[tuple]:
    """The DTensor kinds, each first once (a rotation: the kind that comes first decides what some scalers
    reduce found_inf over); then every kind with the plain tensor first and last (some scalers refuse a
    mix of DTensor and plain grads, which would hide what the rotations show if every order had one)."""
    dtensors = [k for k, (dims, _, _) in MESHES[mesh]["kinds"].items() if dims is not None]
    rotations = [tuple(dtensors[i:] + dtensors[:i]) for i in range(len(dtensors))]
    return rotations + [("plain", *dtensors), (*dtensors, "plain")]


def _local_shape(shape, placements, mesh_sizes) -> tuple:
    out = list(shape)
    for dim, size in zip(placements, mesh_sizes):
        if dim is not R:
            out[dim] //= size
    return tuple(out)


def device_mesh(name: str, device_type: str = "cpu"):
    """The named mesh (made once per rank process: harness.cached_mesh)."""
    return cached_mesh(device_type, MESHES[name]["shape"], MESHES[name]["names"])


def _mesh_step(spec: str, placement: str, mesh_name: str, order: tuple, bad: tuple | None) -> dict:
    """Runs on a rank: one scaled step of params of `order`'s kinds; bad = (kind, rank, a key of INF_VALUES)."""
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    table = MESHES[mesh_name]
    device = device_of(PLACEMENTS[placement]["params"][0])
    mesh = device_mesh(mesh_name, device.type)
    g = torch.Generator().manual_seed(100 + rank)
    params, targets = [], []
    for kind in order:
        dims, placements, shape = table["kinds"][kind]
        sizes = [] if dims is None else [mesh.size(mesh.mesh_dim_names.index(d)) for d in dims]
        shard_shape = _local_shape(shape, placements, sizes)
        p = (torch.randint(-8, 8, shard_shape, generator=g).float() / 8).to(device)
        c = (torch.randint(-4, 4, shard_shape, generator=g).float() / 8).to(device)
        if dims is not None:
            p = on_mesh(p, mesh, dims, placements)
        params.append(torch.nn.Parameter(p))
        targets.append(c)
    s = make_scaler(spec, device=PLACEMENTS[placement]["scaler"], init_scale=INIT_SCALE, backoff_factor=BACKOFF)
    # the scale's device: the loss's (here no loss: the grads are set directly)
    s.scale(torch.ones((), device=device_of(PLACEMENTS[placement]["loss"])))
    for kind, p, c in zip(order, params, targets):
        grad = c * INIT_SCALE  # the scaled grad, exact
        if bad and kind == bad[0] and rank == bad[1]:
            grad.view(-1)[0] = INF_VALUES[bad[2]]
        p.grad = grad if not isinstance(p.data, DTensor) else DTensor.from_local(
            grad, p.device_mesh, p.placements, run_check=False)
    opt = torch.optim.SGD(params, lr=LR, foreach=False)  # one loop: DTensors and plain tensors in one list
    before = [local(p).detach().clone() for p in params]
    s.step(opt)
    s.update()
    after = [local(p).detach() for p in params]
    moved_exactly = all(torch.equal(a, b - LR * c) for a, b, c in zip(after, before, targets))
    untouched = all(torch.equal(a, b) for a, b in zip(after, before))
    return dict(stepped="exactly" if moved_exactly else "not at all" if untouched else "wrongly",
                scale=float(s.get_scale()))


def _cases():
    for mesh in MESHES:
        for order in _orders(mesh):
            oid = "-".join(order)
            yield pytest.param(mesh, order, None, id=f"{mesh}-{oid}-clean")
            for kind in order:
                value = _bad_value(order, kind)
                for along, rank in INF_RANKS[mesh].items():
                    yield pytest.param(mesh, order, (kind, rank, value),
                                       id=f"{mesh}-{oid}-{value}_in_{kind}_on_rank{rank}_{along}")


@pytest.mark.parametrize("placement", placement_params(["cpu", "cuda"]))
@pytest.mark.parametrize("mesh, order, bad", list(_cases()))
def test_every_rank_of_the_mesh_takes_the_same_decision(scaler, placement, mesh, order, bad):
    out = run_at(placement, _mesh_step, scaler, placement, mesh, order, bad, world_size=WORLD_SIZE)
    want = (dict(stepped="not at all", scale=INIT_SCALE * BACKOFF) if bad else
            dict(stepped="exactly", scale=INIT_SCALE))
    assert out == [want] * WORLD_SIZE, (
        f"params in the order {list(order)} on the {mesh} mesh, "
        f"{'%s in %s on rank %d' % (bad[2], bad[0], bad[1]) if bad else 'clean'}: every rank must "
        f"{'skip and back off' if bad else 'step exactly and keep its scale'}; per rank: {out}")
