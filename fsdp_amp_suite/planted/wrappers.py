"""The planted broken FSDP wrappers: a built-in with one defect a user's wrapper could have.

Use one with `--fsdp fsdp_amp_suite.planted.wrappers:<name>`; tests/meta/test_teeth.py checks that each fails matrix
cells where the built-in wrappers, plugged the same way, pass.
"""
import dataclasses

import torch
import torch.distributed as dist

from fsdp_amp_suite.matrix import implementations
from fsdp_amp_suite.matrix.cell import predivide_factor
from fsdp_amp_suite.planted.registry import broken_wrapper


def _comm_hook(average=True, guard=None):
    """An FSDP1 comm hook: all-reduce (NO_SHARD strategies pass only grad) or reduce-scatter by SUM, with the
    1/world_size average split around the sum if `average` (as FSDP does: cell.predivide_factor, so an fp16 sum
    overflows exactly where FSDP's does), then `guard` the reduced grad in place if given."""
    def hook(state, grad, output=None):
        reduced = grad if output is None else output
        pre = predivide_factor(dist.get_world_size()) if average else 1
        grad.div_(pre)
        if output is None:
            dist.all_reduce(grad)
        else:
            dist.reduce_scatter_tensor(output, grad)
        if average:
            reduced.div_(dist.get_world_size() / pre)
        if guard is not None:
            guard(reduced)
    return hook


def _fsdp1_with_one_defect(wrapper):
    """Declared as FSDP1 is (what it needs of the machine, ...): only the planted defect differs."""
    fsdp1 = implementations.fsdp1
    return implementations.declare(needs=fsdp1.needs, loss_on_param_device=fsdp1.loss_on_param_device,
                                   low_precision_grads=fsdp1.low_precision_grads)(wrapper)


@broken_wrapper("fsdp1_sums_grads")  # reduces by SUM, no 1/world_size average
@_fsdp1_with_one_defect
def fsdp1_sums_grads(module, settings):
    """FSDP1 whose gradient reduction forgets the 1/world_size average (a custom comm hook)."""
    model = implementations.fsdp1(module, settings)
    model.register_comm_hook(dist.group.WORLD, _comm_hook(average=False))  # forgets the 1/world_size
    return model


@broken_wrapper("fsdp1_zeros_nan_grads")  # a real overflow's NaN, zeroed after the reduction, never reaches the scaler
@_fsdp1_with_one_defect
def fsdp1_zeros_nan_grads(module, settings):
    """FSDP1 whose comm hook zeros NaNs in the reduced grads (grad[grad.isnan()] = 0)."""
    model = implementations.fsdp1(module, settings)
    model.register_comm_hook(dist.group.WORLD, _comm_hook(guard=lambda g: g.masked_fill_(g.isnan(), 0.0)))
    return model


@broken_wrapper("fsdp1_nan_to_num_grads")  # NaN -> 0 and +-inf -> the dtype's largest finite value
@_fsdp1_with_one_defect
def fsdp1_nan_to_num_grads(module, settings):
    """FSDP1 whose comm hook applies torch.nan_to_num_ to the reduced grads (zeros NaNs, clamps infs)."""
    model = implementations.fsdp1(module, settings)
    model.register_comm_hook(dist.group.WORLD, _comm_hook(guard=torch.nan_to_num_))
    return model


def _clamp_to_finite(grad):
    limit = torch.finfo(grad.dtype).max
    grad.clamp_(-limit, limit)


@broken_wrapper("fsdp1_clamps_grads")  # +-inf clamped to the dtype's largest finite value; NaN stays: passes every
@_fsdp1_with_one_defect                # injected cell, fails where training makes the inf (climb, reduction)
def fsdp1_clamps_grads(module, settings):
    """FSDP1 whose comm hook clamps the reduced grads into their dtype's finite range (a guard some training stacks
    add): an overflow that reaches the grads as +-inf is stepped on instead of skipped."""
    model = implementations.fsdp1(module, settings)
    model.register_comm_hook(dist.group.WORLD, _comm_hook(guard=_clamp_to_finite))
    return model


@broken_wrapper("fsdp1_zeros_inf_grads")  # +-inf zeroed, NaN left: likewise only a natural overflow shows it
@_fsdp1_with_one_defect
def fsdp1_zeros_inf_grads(module, settings):
    """FSDP1 whose comm hook zeros infinite values in the reduced grads (grad[grad.isinf()] = 0)."""
    model = implementations.fsdp1(module, settings)
    model.register_comm_hook(dist.group.WORLD, _comm_hook(guard=lambda g: g.masked_fill_(g.isinf(), 0.0)))
    return model


def _fsdp2_with_one_defect(wrapper):
    """Declared as FSDP2 is (what it needs of the machine, its meshes): only the planted defect differs."""
    fsdp2 = implementations.fsdp2
    return implementations.declare(needs=fsdp2.needs, meshes=fsdp2.meshes)(wrapper)


@broken_wrapper("fsdp2_one_unit_unreplicated", matrix="mesh")  # on a (replicate, shard) mesh;
                                                               # elsewhere FSDP2 as built in
@_fsdp2_with_one_defect
def fsdp2_one_unit_unreplicated(module, settings):
    """FSDP2 whose first unit (the innermost block when nested, else the root) is sharded over the mesh's shard dim
    only: its grads are reduce-scattered within each replica and never reduced across replicas."""
    if settings.mesh is None or settings.tp_plan:
        return implementations.fsdp2(module, settings)
    first = []
    def unit_mesh(unit, mesh):
        first.append(unit)
        return mesh["shard"] if len(first) == 1 else mesh
    return implementations.shard_fsdp2(module, settings, unit_mesh)


# the matrix's TP model (fsdp_amp_suite/matrix/cell.py TP_PLAN): its first Colwise/Rowwise pair, and the modules
# after it
FIRST_PAIR = {"0.lin": "colwise", "1.lin": "rowwise"}
SPLIT_FROM, SPLIT_TO = "1.inner", "2"


@broken_wrapper("fsdp2_head_batch_split", matrix="mesh")  # on a (dp, tp) mesh; elsewhere FSDP2 as built in
@_fsdp2_with_one_defect
def fsdp2_head_batch_split(module, settings):
    """FSDP2 after a TP plan that keeps only the first Colwise/Rowwise pair and runs the modules after it (plain
    params, replicated over tp) on each tp rank's share of the batch, as sequence parallelism does, gathering the
    output back: the forward is exact, but those replicated params' grads stay partial, never all-reduced across tp."""
    if not settings.tp_plan:
        return implementations.fsdp2(module, settings)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    tp = settings.mesh["tp"]
    parallelize_module(module, tp, {SPLIT_FROM: PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(0),), use_local_output=True)})
    parallelize_module(module, tp, {SPLIT_TO: PrepareModuleOutput(
        output_layouts=(Shard(0),), desired_output_layouts=(Replicate(),), use_local_output=True)})
    return implementations.fsdp2(module, dataclasses.replace(settings, tp_plan=FIRST_PAIR))
