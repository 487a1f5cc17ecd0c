"""The scalers under test: the built-in factories, `--scaler SPEC` resolution, and building one.

The known upstream bugs of the built-ins are a table of their own: tests/known_bugs.py.

A factory takes keyword arguments (device, init_scale, growth_factor, backoff_factor,
growth_interval, enabled, process_group) and returns an object with the torch.amp.GradScaler API.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Callable


def _ours(**kw):
    from scaler_impl import DeviceSplitGradScaler

    return DeviceSplitGradScaler(**kw)


def _torch_amp(process_group=None, **kw):  # not shard aware: it has no process_group
    import torch

    return torch.amp.GradScaler(**kw)


def _torch_sharded(process_group=None, **kw):
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(process_group=process_group or dist.group.WORLD, **kw)


def _fairscale_sharded(device=None, process_group=None, **kw):  # fairscale's has no device argument
    import torch.distributed as dist
    from fairscale.optim.grad_scaler import ShardedGradScaler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ShardedGradScaler(process_group=process_group or dist.group.WORLD, **kw)


BUILTINS: dict[str, Callable] = {
    "ours": _ours,
    "torch_amp": _torch_amp,
    "torch_sharded": _torch_sharded,
    "fairscale_sharded": _fairscale_sharded,
}


def load_factory(option: str, spec: str, builtins: dict) -> Callable:
    """A built-in name or 'package.module:factory' -> the factory, for --scaler and --fsdp alike
    (clear errors naming the option for bad specs)."""
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise ValueError(f"{option} {spec!r}: not a built-in ({', '.join(builtins)}) "
                         f"and not of the form package.module:factory")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{option} {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{option} {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def spec_id(spec: str) -> str:
    """A --scaler or --fsdp spec as it appears in a test id: 'pkg.mod:factory' -> 'pkg.mod-factory' (':' would
    read as a path separator in -k expressions and --xfails-file entries)."""
    return spec.replace(":", "-")


def resolve(spec: str) -> Callable:
    """A --scaler spec -> its factory."""
    return load_factory("--scaler", spec, BUILTINS)


SCALER_API = ("scale", "unscale_", "step", "update", "get_scale", "is_enabled", "state_dict", "load_state_dict")


def make_scaler(spec: str, *, device: str, init_scale: float = 2.0**8, growth_factor: float = 2.0,
                backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                process_group=None):
    """Build the scaler under test; an enabled scaler that quietly disabled itself is a defect."""
    scaler = resolve(spec)(device=device, init_scale=init_scale, growth_factor=growth_factor,
                           backoff_factor=backoff_factor, growth_interval=growth_interval,
                           enabled=enabled, process_group=process_group)
    missing = [name for name in SCALER_API if not callable(getattr(scaler, name, None))]
    if missing:
        raise TypeError(f"scaler {spec!r}: its factory returned an object of type {type(scaler).__name__}, "
                        f"which lacks {', '.join(missing)} of the torch.amp.GradScaler API")
    if enabled and not scaler.is_enabled():
        raise AssertionError(f"scaler {spec!r} was built with enabled=True but reports is_enabled() == False: "
                             f"it disabled itself and would step on inf/NaN grads")
    return scaler
