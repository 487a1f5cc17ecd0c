"""The FSDP implementations of the matrix, behind the interface a user's own wrapper plugs into.

    --fsdp package.module:factory        factory(module, settings) -> the wrapped module

`settings` (a `Settings`) is the cell in the implementation's terms. The factory wraps `module`
(fp32, on CPU; every `settings.block_cls` instance is a block) and returns it on
`settings.device`. If the wrapped module has a `clip_grad_norm_(max_norm)` method, clipping cells
call it; otherwise `torch.nn.utils.clip_grad_norm_` over its parameters (correct for FSDP2's
DTensors). A configuration the wrapper cannot build here: raise NotImplementedError("why"), and
the cell skips with that reason. Nothing else is asked of it: the loop, the scaler and the
comparison are the matrix's.

Everything the matrix knows of an implementation is its record (`record(spec)` -> `Implementation`):
the factory, and what the factory declares as optional attributes (`@declare(...)` sets them; a
plugged factory may set the same, a plain function gets the defaults):

    meshes: tuple                         the meshes it builds (axes.AXES["mesh"]; default ("1d",)): cells on
                                          any other mesh skip, naming the declaration
    needs(cell, n_gpus) -> str | None     why this machine cannot run the cell (it skips at collection)
    loss_on_param_device: bool            the loss is moved to the params' device before scaling, so
                                          the scale lives there (fairscale issue #421's path: CPU with offload)
    low_precision_grads(cell) -> bool     the scaler gets grads in the reduce dtype (not fp32) in this cell
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Callable

import torch

from fsdp_amp_suite.scalers import load_factory
from fsdp_amp_suite.versions import holds


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
    mesh: object = None       # None: shard over one flat group, the world. A 2D DeviceMesh over the world whose
                              # dims are named ("replicate", "shard"): hybrid sharding (HSDP); ("dp", "tp"):
                              # apply tp_plan on mesh["tp"], then shard over mesh["dp"]
    tp_plan: dict | None = None  # module name -> "colwise" | "rowwise" (torch's ColwiseParallel / RowwiseParallel)


def _needs_nothing(cell, n_gpus):
    return None


def _keeps_low_if_asked(cell):
    return cell.grads == "keeplow"


FLAT_ONLY = ("1d",)  # the meshes of a factory that declares none: it need not know Settings.mesh


def declare(needs=_needs_nothing, loss_on_param_device=False, low_precision_grads=_keeps_low_if_asked,
            meshes=FLAT_ONLY):
    """A factory's declarations, as its attributes (see the module docstring)."""
    def apply(factory):
        factory.needs, factory.loss_on_param_device = needs, loss_on_param_device
        factory.low_precision_grads, factory.meshes = low_precision_grads, tuple(meshes)
        return factory
    return apply


@dataclass(frozen=True)
class Implementation:
    spec: str
    wrap: Callable
    needs: Callable
    loss_on_param_device: bool
    low_precision_grads: Callable
    meshes: tuple = FLAT_ONLY


@functools.lru_cache(maxsize=None)
def record(spec: str) -> Implementation:
    """The implementation behind a --fsdp spec (a built-in name or package.module:factory)."""
    factory = resolve(spec)
    return Implementation(spec, factory, getattr(factory, "needs", _needs_nothing),
                          bool(getattr(factory, "loss_on_param_device", False)),
                          getattr(factory, "low_precision_grads", _keeps_low_if_asked),
                          tuple(getattr(factory, "meshes", FLAT_ONLY)))


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


def _fsdp1_needs(cell, n_gpus):
    if cell.offload == "offload" and n_gpus == 0:
        return ("FSDP1 CPUOffload needs an accelerator (pin_memory: 'Cannot access accelerator device when none is "
                "available')")
    return None


@declare(needs=_fsdp1_needs, meshes=("1d", "hsdp"))
def fsdp1(module, s: Settings):
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if s.tp_plan:
        raise NotImplementedError("the matrix's FSDP1 wrapper does not compose with tensor parallelism")
    if s.mesh is None:
        strategy = ShardingStrategy.FULL_SHARD if s.reshard else ShardingStrategy.SHARD_GRAD_OP
    else:  # a 2D (replicate, shard) mesh
        strategy = ShardingStrategy.HYBRID_SHARD if s.reshard else ShardingStrategy._HYBRID_SHARD_ZERO2
    hybrid = {} if s.mesh is None else dict(device_mesh=s.mesh)  # the keyword is newer than FSDP1
    return FSDP(module.to(s.device), device_id=s.device, use_orig_params=not s.flat_params, **hybrid,
                sharding_strategy=strategy,
                mixed_precision=MixedPrecision(param_dtype=s.dtype, reduce_dtype=s.dtype,
                                               keep_low_precision_grads=s.low_precision_grads) if s.dtype else None,
                cpu_offload=CPUOffload(offload_params=True) if s.offload else None,
                auto_wrap_policy=ModuleWrapPolicy({s.block_cls}) if s.nested else None)


def fsdp2_api():
    """FSDP2's names, where this torch has them: fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy."""
    try:
        from torch.distributed import fsdp as api  # torch >= 2.6
        api.fully_shard  # noqa: B018 - 2.4 / 2.5 have the package but not the name
    except (ImportError, AttributeError):
        from torch.distributed._composable import fsdp as api  # torch 2.4 / 2.5
    return types.SimpleNamespace(fully_shard=api.fully_shard, CPUOffloadPolicy=api.CPUOffloadPolicy,
                                 MixedPrecisionPolicy=api.MixedPrecisionPolicy)


# FSDP2 on a machine without CUDA: torch < 2.7 touches CUDA in fully_shard's lazy init (first forward), so it
# cannot run there. Measured with fsdp_amp_suite/matrix/probe_fsdp2_cpu.py (2 gloo ranks, offload on/off,
# fp32/fp16/bf16): 2.4.1
# creates a torch.cuda.Stream (CUDA wheel without a GPU: "CUDA driver version is insufficient for CUDA runtime
# version"), 2.5.1 raises "FSDP requires CUDA for streams", 2.6.0 "'Stream' object has no attribute
# 'record_event'" (the CPU stream's record_event/wait_event came in pytorch/pytorch#145935); 2.7.0 trains.
FSDP2_CPU_TORCH = "<2.7"
FSDP2_CPU_REASON = (f"FSDP2 on CPU needs torch >= 2.7: on torch{FSDP2_CPU_TORCH} fully_shard's lazy init uses CUDA "
                    f"streams (2.4, 2.5) or CPU stream methods 2.6 lacks (record_event: pytorch/pytorch#145935)")

# FSDP2 with CUDA params over gloo ranks sharing one GPU segfaults in DTensor's functional collectives, in a native
# thread, in fresh ranks too (KNOWN_BUGS dtensor-gloo-cuda-all-gather-segfault; python -m benchmarks.shared_gpu trains
# these cells anyway). Claimed for every version until a GPU run shows one that works.
FSDP2_SHARED_GPU_TORCH = ""


def _fsdp2_needs(cell, n_gpus):
    ws = cell.world_size
    if n_gpus == 0 and holds(torch=FSDP2_CPU_TORCH):
        return FSDP2_CPU_REASON
    if cell.offload == "nooffload" and 0 < n_gpus < ws and holds(torch=FSDP2_SHARED_GPU_TORCH):
        return (f"FSDP2 with CUDA params at world size {ws} needs NCCL with one GPU per rank: over gloo ranks sharing "
                f"a GPU, DTensor's functional collectives (full_tensor, clip_grad_norm_) segfault (KNOWN_BUGS "
                f"dtensor-gloo-cuda-all-gather-segfault; torch {FSDP2_SHARED_GPU_TORCH or 'of any version'} until a "
                f"GPU run shows otherwise); {n_gpus} GPU(s) visible")
    if cell.mesh == "tp" and 0 < n_gpus < ws and holds(torch=FSDP2_SHARED_GPU_TORCH):
        return (f"tensor parallelism on CUDA at world size {ws} needs NCCL with one GPU per rank: its activations are "
                f"CUDA DTensors, and over gloo ranks sharing a GPU the functional collectives segfault (KNOWN_BUGS "
                f"dtensor-gloo-cuda-all-gather-segfault: SIGSEGV in full_tensor's wait_tensor on torch 2.11); "
                f"{n_gpus} GPU(s) visible")
    return None


def apply_tp_plan(module, mesh, plan: dict) -> None:
    """Settings.tp_plan on the mesh's "tp" dim, with torch's parallel styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(module, mesh["tp"], {name: styles[style]() for name, style in plan.items()})


@declare(needs=_fsdp2_needs, meshes=("1d", "hsdp", "tp"))
def fsdp2(module, s: Settings):
    return shard_fsdp2(module, s)


def shard_fsdp2(module, s: Settings, unit_mesh=None):
    """FSDP2 as the matrix builds it; unit_mesh(unit, mesh) -> the mesh to shard that unit over (default: mesh),
    for a planted wrapper that gets one unit wrong."""
    api = fsdp2_api()
    import torch.distributed as dist

    from fsdp_amp_suite.harness import cached_mesh

    if s.low_precision_grads:
        raise NotImplementedError("FSDP2 always gives the optimizer grads in the params' dtype")
    module = module.to(s.device)
    if s.mesh is None:  # kept for the rank's life: where CUDA is there, a gloo job's every new mesh is a new group
        mesh = cached_mesh(s.device.type, (dist.get_world_size(),), ("dp",))
    elif s.tp_plan:
        apply_tp_plan(module, s.mesh, s.tp_plan)
        mesh = s.mesh["dp"]
    else:
        mesh = s.mesh  # 2D: fully_shard replicates over dim 0 and shards over dim 1 (HSDP)
    kw = dict(reshard_after_forward=s.reshard)
    if s.dtype:
        kw["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=s.dtype, reduce_dtype=s.dtype)
    if s.offload:  # pinned memory needs an accelerator; on CPU the offload is a plain CPU copy
        kw["offload_policy"] = api.CPUOffloadPolicy(pin_memory=s.device.type == "cuda")
    units = (_blocks_innermost_first(module, s.block_cls) if s.nested else []) + [module]
    for unit in units:
        api.fully_shard(unit, mesh=unit_mesh(unit, mesh) if unit_mesh else mesh, **kw)
    return module


def _fairscale_needs(cell, n_gpus):
    ws = cell.world_size
    if n_gpus == 0:
        return "fairscale FSDP needs CUDA (hard-coded CUDA streams: KeyError 'all_gather' on CPU)"
    if ws > n_gpus:
        return (f"fairscale FSDP at world size {ws} needs NCCL with one GPU per rank (under gloo it fails a "
                f"reduce_scatter shape check); {n_gpus} GPU(s) visible")
    return None


def _fairscale_low_precision_grads(cell):
    # it casts grads to the param dtype only after a reduction, so without offload at world size 1 (nothing
    # to reduce) they stay in the compute dtype (where bf16 hits KNOWN_BUGS bf16-cuda-unscale-kernel)
    return cell.offload == "nooffload" and cell.world_size == 1


@declare(needs=_fairscale_needs, loss_on_param_device=True, low_precision_grads=_fairscale_low_precision_grads)
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
