"""The FSDP implementations of the matrix, behind the interface a user's own wrapper plugs into.

    --fsdp package.module:factory        factory(module, settings) -> the wrapped module

`settings` (a `Settings`) is the cell in the implementation's terms. The factory wraps `module`
(fp32, on CPU; every `settings.block_cls` instance is a block) and returns it on
`settings.device`. If the wrapped module has a `clip_grad_norm_(max_norm)` method, clipping cells
call it; otherwise `torch.nn.utils.clip_grad_norm_` over its parameters (correct for FSDP2's
DTensors). A configuration the wrapper cannot build here: raise NotImplementedError("why"), and
the cell skips with that reason. Nothing else is asked of it: the loop, the scaler and the
comparison are the matrix's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tests.scalers import load_factory


@dataclass(frozen=True)
class Settings:
    device: torch.device      # the compute device of this rank (cpu, or its cuda:k)
    dtype: torch.dtype | None  # param + reduce dtype; None: full precision (fp32)
    offload: bool             # params and grads on CPU between steps
    nested: bool              # wrap every block_cls instance (innermost first), then the root
    block_cls: type           # the block class of the model
    flat_params: bool         # one flat parameter per wrapped unit (else the original parameters)
    reshard: bool             # free the full params after forward (re-gather in backward)
    low_precision_grads: bool = False  # leave the grads in dtype for the scaler and optimizer
                                       # (FSDP1 keep_low_precision_grads); else upcast to fp32


def _blocks_innermost_first(module, block_cls):
    found = [m for m in module.modules() if isinstance(m, block_cls)]
    depth = {id(m): len(name.split(".")) for name, m in module.named_modules() if isinstance(m, block_cls)}
    return sorted(found, key=lambda m: -depth[id(m)])


def _wrap_children(module, block_cls, wrap):
    """Replace every block (innermost first) by wrap(block), in place."""
    for child_name, child in list(module.named_children()):
        _wrap_children(child, block_cls, wrap)
        if isinstance(child, block_cls):
            setattr(module, child_name, wrap(child))


def fsdp1(module, s: Settings):
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if s.offload and s.device.type != "cuda":
        raise NotImplementedError("FSDP1 CPUOffload needs an accelerator (pin_memory)")
    return FSDP(module.to(s.device), device_id=s.device, use_orig_params=not s.flat_params,
                sharding_strategy=ShardingStrategy.FULL_SHARD if s.reshard else ShardingStrategy.SHARD_GRAD_OP,
                mixed_precision=MixedPrecision(param_dtype=s.dtype, reduce_dtype=s.dtype,
                                               keep_low_precision_grads=s.low_precision_grads) if s.dtype else None,
                cpu_offload=CPUOffload(offload_params=True) if s.offload else None,
                auto_wrap_policy=ModuleWrapPolicy({s.block_cls}) if s.nested else None)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4 / 2.5
    return fully_shard


def fsdp2(module, s: Settings):
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    except ImportError:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if s.low_precision_grads:
        raise NotImplementedError("FSDP2 always gives the optimizer grads in the params' dtype")
    mesh = init_device_mesh(s.device.type, (dist.get_world_size(),))
    kw = dict(mesh=mesh, reshard_after_forward=s.reshard)
    if s.dtype:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=s.dtype, reduce_dtype=s.dtype)
    if s.offload:  # pinned memory needs an accelerator; on CPU the offload is a plain CPU copy
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=s.device.type == "cuda")
    module = module.to(s.device)
    if s.nested:
        for block in _blocks_innermost_first(module, s.block_cls):
            _fully_shard()(block, **kw)
    _fully_shard()(module, **kw)
    return module


def fairscale(module, s: Settings):
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FS

    if s.low_precision_grads:
        raise NotImplementedError("fairscale FSDP has no option to keep low-precision grads")
    kw = dict(reshard_after_forward=s.reshard, flatten_parameters=s.flat_params,
              mixed_precision=s.dtype is not None, compute_dtype=s.dtype, cpu_offload=s.offload,
              move_grads_to_cpu=s.offload, compute_device=s.device)
    module = module.to("cpu" if s.offload else s.device)
    if s.nested:
        _wrap_children(module, s.block_cls, lambda block: FS(block, **kw))
    return FS(module, **kw)


BUILTINS: dict[str, Callable] = {"fairscale": fairscale, "fsdp1": fsdp1, "fsdp2": fsdp2}


def resolve(spec: str) -> Callable:
    """A --fsdp spec (a built-in name or package.module:factory) -> its factory."""
    return load_factory("--fsdp", spec, BUILTINS)


# ------------------------------------------------------------------ broken wrappers (for the teeth test)
# Each is a built-in with one defect a user's wrapper could have; test_teeth.py checks they fail.

def _sum_hook(state, grad, output=None):
    """An FSDP1 comm hook that reduces by SUM and never divides by the world size."""
    import torch.distributed as dist

    if output is None:  # NO_SHARD strategies pass only grad
        dist.all_reduce(grad)
    else:
        dist.reduce_scatter_tensor(output, grad)


def fsdp1_sums_grads(module, s: Settings):
    """FSDP1 whose gradient reduction forgets the 1/world_size average (a custom comm hook)."""
    import torch.distributed as dist

    model = fsdp1(module, s)
    model.register_comm_hook(dist.group.WORLD, _sum_hook)
    return model
