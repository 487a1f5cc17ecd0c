"""The scalers under test: built-in factories, `--scaler SPEC` resolution, and the known upstream bugs.

A factory takes keyword arguments (device, init_scale, growth_factor, backoff_factor,
growth_interval, enabled, process_group) and returns an object with the torch.amp.GradScaler API.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, field
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


def resolve(spec: str) -> Callable:
    """A built-in name or 'package.module:factory' -> the factory (clear errors for bad specs)."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    if ":" not in spec:
        raise ValueError(f"--scaler {spec!r}: not a built-in ({', '.join(BUILTINS)}) "
                         f"and not of the form package.module:factory")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--scaler {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--scaler {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def make_scaler(spec: str, *, device: str, init_scale: float = 2.0**8, growth_factor: float = 2.0,
                backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                process_group=None):
    """Build the scaler under test; an enabled scaler that quietly disabled itself is a defect."""
    scaler = resolve(spec)(device=device, init_scale=init_scale, growth_factor=growth_factor,
                           backoff_factor=backoff_factor, growth_interval=growth_interval,
                           enabled=enabled, process_group=process_group)
    if enabled and not scaler.is_enabled():
        raise AssertionError(f"scaler {spec!r} was built with enabled=True but reports is_enabled() == False: "
                             f"it disabled itself and would step on inf/NaN grads")
    return scaler


# --------------------------------------------------------------------------- known upstream bugs
# Each entry turns the matching built-in test ids into xfail(strict=True), so the suite reports
# the day upstream fixes them. A plugged --scaler package.module:factory never gets these.

@dataclass(frozen=True)
class KnownBug:
    scalers: frozenset
    tests: frozenset | None  # test function names; None: every test that builds an enabled scaler
    reason: str
    when: Callable = field(default=lambda params, cuda: True)  # params: the item's callspec.params


def _bug(scalers, tests, reason, when=None):
    return KnownBug(frozenset(scalers), tests if tests is None else frozenset(tests), reason,
                    when or (lambda params, cuda: True))


EVERY_TEST = None  # KnownBug.tests: every test that builds an enabled scaler
ENABLED_FREE_TESTS = {"test_disabled_scaler_is_a_pass_through"}
NOT_SHARD_AWARE = {"test_inf_on_some_ranks_makes_every_rank_skip_and_back_off", "test_ranks_keep_scale_in_lockstep",
                   "test_rank_without_grads_takes_part", "test_unmatched_step_surfaces_as_a_hang_in_bounded_time"}


def _dtype_is(name):
    return lambda params, cuda: params.get("dtype") == name


KNOWN_BUGS = [
    _bug({"fairscale_sharded"}, EVERY_TEST,
         "fairscale ShardedGradScaler silently disables itself without CUDA (amp_definitely_not_available) "
         "and then steps on inf grads; it has no device argument",
         when=lambda params, cuda: not cuda),
    _bug({"torch_amp"}, {"test_clean_step_unscales_exactly_and_steps", "test_inf_or_nan_skips_step_and_backs_off"},
         "torch.amp.GradScaler refuses fp16 grads by design (ValueError: Attempting to unscale FP16 gradients.), "
         "which FSDP mixed precision without offload produces", when=_dtype_is("float16")),
    _bug({"torch_amp"}, NOT_SHARD_AWARE,
         "torch.amp.GradScaler does not agree on found_inf across ranks (it relies on DDP's all-reduced grads): "
         "with sharded grads an inf on one rank makes only that rank skip and back off",
         when=lambda params, cuda: params.get("bad_ranks") != (0, 1)),
    _bug({"torch_sharded"}, {"test_growth_never_overflows_to_inf"},
         "torch ShardedGradScaler._amp_update_scale_cpu_ (scale on CPU) grows the scale without the "
         "isfinite check of torch._amp_update_scale_: float32 max * growth_factor becomes inf, then every "
         "step overflows and backs off inf forever",
         when=lambda params, cuda: params.get("placement", "cpu") == "cpu"),
]


def known_bug(spec: str, test_name: str, params: dict, cuda: bool) -> str | None:
    if spec not in BUILTINS:
        return None
    for bug in KNOWN_BUGS:
        in_tests = test_name not in ENABLED_FREE_TESTS if bug.tests is None else test_name in bug.tests
        if spec in bug.scalers and in_tests and bug.when(params, cuda):
            return bug.reason
    return None
