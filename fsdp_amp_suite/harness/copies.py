"""Race-free runs: every copy a body asks to be non_blocking is made blocking.

The async-copy race (KNOWN_BUGS async-copy-race-busy-gpu) lives in non_blocking CUDA -> CPU copies of inv_scale and
found_inf that the CPU reads before they land; a built-in's outcome there depends on the GPU's load. Under
blocking_copies() the window is closed, in this process and in every task the harness runs meanwhile
(Harness.run wraps the body), so the rest of the contract on those placements is judged for that scaler
(fsdp_amp_suite/expectations.py rule 2) while tests/conformance/test_busy_gpu.py checks the race itself.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

_REQUESTED = contextvars.ContextVar("blocking_copies", default=False)


@contextlib.contextmanager
def blocking_copies():
    """For its duration, copies are blocking here and in the tasks the harness runs."""
    token = _REQUESTED.set(True)
    try:
        with _mode()():
            yield
    finally:
        _REQUESTED.reset(token)


def requested() -> bool:
    """Is blocking_copies() in force (Harness.run then wraps the body in call_with_blocking_copies)?"""
    return _REQUESTED.get()


def call_with_blocking_copies(fn, args, kwargs):
    """Inside a rank: fn(*args, **kwargs) with every non_blocking copy made blocking."""
    with _mode()():
        return fn(*args, **kwargs)


@functools.cache
def _mode():
    """The torch function mode, built on first use: the harness imports torch only where it runs tasks."""
    from torch.overrides import TorchFunctionMode

    class BlockingCopies(TorchFunctionMode):
        """non_blocking=True becomes False in every call that takes it (Tensor.to, copy_, cuda, ...): a blocking
        CUDA -> CPU copy returns after the data landed."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if kwargs.get("non_blocking"):
                kwargs = {**kwargs, "non_blocking": False}
            return func(*args, **kwargs)

    return BlockingCopies
