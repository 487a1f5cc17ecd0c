"""What the planted scalers share: the correct group check, found_inf as the scaler records it, and
bases that hide grads, tell step()'s own unscale_ from an explicit one, or hand a fused optimizer the skip.
"""
import contextlib

import torch
from torch.amp.grad_scaler import OptState

from scaler_impl.scaler import DeviceSplitGradScaler, found_inf_value


correct_check = DeviceSplitGradScaler._check_and_unscale  # the correct group check


def recorded(value: float) -> dict:
    """An optimizer state's found_inf_per_device holding `value`, as the scaler records the agreed sum."""
    return {torch.device("cpu"): torch.tensor(float(value))}


def unscale_args(scaler) -> tuple:
    """The rest of _unscale_grads_'s arguments as unscale_ passes them: inv_scale, found_inf, allow_fp16."""
    return scaler._inv_scale(), torch.zeros(()), True


def checks_first(k):
    """A group check that checks only the first k grads of the group and unscales the rest unchecked."""
    def check(grads, found_inf, inv_scale):
        correct_check(grads[:k], found_inf, inv_scale)
        if len(grads) > k:
            torch._foreach_mul_(grads[k:], inv_scale)
    return staticmethod(check)


@contextlib.contextmanager
def hidden_grads(optimizer, hide):
    """Set aside the grads for which hide(grad) is true, as if those params had none."""
    hidden = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None and hide(p.grad)]
    for p, _ in hidden:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in hidden:
            p.grad = grad


class KnowsWhenStepping(DeviceSplitGradScaler):
    """`_stepping` is True inside step(): tells step()'s own unscale_ from the clipping path's explicit one."""

    _stepping = False

    def step(self, optimizer, *args, **kwargs):
        self._stepping = True
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            self._stepping = False


class LeavesSkipToFusedKernel(DeviceSplitGradScaler):
    """A fused optimizer (_step_supports_amp_scaling) is handed the agreed found_inf and always called: the
    kernel is left to skip, as torch's scalers do. `handed` says what value it gets."""

    def handed(self, agreed: float) -> float:
        raise NotImplementedError

    def step(self, optimizer, *args, **kwargs):
        if not self._enabled or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return super().step(optimizer, *args, **kwargs)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        optimizer.grad_scale, optimizer.found_inf = None, torch.tensor(self.handed(found_inf_value(state)))
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
            state["stage"] = OptState.STEPPED
