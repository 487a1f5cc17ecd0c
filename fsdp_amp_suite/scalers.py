"""The scalers under test: the built-in factories, `--scaler SPEC` resolution, and building one.

The known upstream bugs of the built-ins are a table of their own: fsdp_amp_suite/known_bugs.py.

A factory takes keyword arguments (device, init_scale, growth_factor, backoff_factor,
growth_interval, enabled, process_group) and returns an object with the torch.amp.GradScaler API.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
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
    """A built-in name, 'package.module:factory' or 'path/to/file.py:factory' -> the factory, for --scaler and
    --fsdp alike (clear errors naming the option for bad specs)."""
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise ValueError(f"{option} {spec!r}: not a built-in ({', '.join(builtins)}) "
                         f"and not of the form package.module:factory or path/to/file.py:factory")
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py"):
        module = _load_file(option, spec, module_name)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{option} {spec!r}: cannot import module {module_name!r}: {exc}"
                             + _shadowed(module_name)) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{option} {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def _load_file(option: str, spec: str, path: str):
    """The module in a .py file, by its path (relative to the working directory, which the ranks share)."""
    file = os.path.abspath(path)
    if not os.path.isfile(file):
        raise ValueError(f"{option} {spec!r}: no file {file!r}")
    name = "_spec_file_" + hashlib.sha1(file.encode()).hexdigest()[:12]  # one module per file, in every process
    if name not in sys.modules:
        loader_spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception:
            del sys.modules[name]
            raise
    return sys.modules[name]


def _shadowed(module_name: str) -> str:
    """Why a module named tests.* may not import: the suite's own top-level package is `tests` (pytest.ini's
    pythonpath), which hides a package of the same name in the consumer's project."""
    if module_name.split(".")[0] != "tests":
        return ""
    return (f" (the suite's own package is named 'tests' and hides a package of yours with that name: name your "
            f"file instead, --scaler path/to/{module_name.replace('.', '/')}.py:<factory>)")


def spec_id(spec: str) -> str:
    """A --scaler or --fsdp spec as it appears in a test id: 'pkg.mod:factory' -> 'pkg.mod-factory' (':' and a
    file spec's '/' would read as path separators in -k expressions and --xfails-file entries)."""
    return spec.replace(":", "-").replace("/", "-")


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
