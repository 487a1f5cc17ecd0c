"""DTensors as the conformance checks on meshes build them (test_meshes.py, and the stateful test's mesh draw):
each rank's own tensor as its local shard, with no check that the shards agree (run_check=False), so a
replicated grad may hold an inf on one rank only, as a bug upstream of the scaler would leave it."""
import torch

R = None  # Replicate() along that mesh dim; an int d: Shard(d)


def on_mesh(local: torch.Tensor, mesh, dims: tuple, placements: tuple):
    """`local` as this rank's shard of a DTensor on `dims` of `mesh` (all of its dims, or one dim's sub-mesh),
    with placements (R or a shard dim) along each."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sub = mesh if tuple(dims) == tuple(mesh.mesh_dim_names) else mesh[dims[0]]
    return DTensor.from_local(local, sub, [Replicate() if d is R else Shard(d) for d in placements], run_check=False)
