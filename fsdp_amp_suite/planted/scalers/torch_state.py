"""Planted scalers that break torch's state and protocols beyond the public API, which torch's own tests and
the integrations use (tests/conformance/test_torch_state.py): each still scales, checks and steps correctly.
"""
from torch.amp.grad_scaler import OptState

from scaler_impl.scaler import DeviceSplitGradScaler, found_inf_value
from fsdp_amp_suite.planted.registry import mutant


@mutant("ignores_writes_into_scale", caught_by=["test_private_scale_state_follows_the_scale"])
class IgnoresWritesIntoScale(DeviceSplitGradScaler):
    """A write into the `_scale` tensor in place (torch's own load_state_dict makes one) never reaches the
    host scale: scale() multiplies by the written value while unscale_ divides by the old one."""

    def _adopt_writes(self):
        pass


@mutant("unscale_grads_ignores_inv_scale", caught_by=["test_unscale_grads_keeps_torchs_signature"])
class UnscaleGradsIgnoresInvScale(DeviceSplitGradScaler):
    """`_unscale_grads_` takes torch's arguments but unscales by its own scale, not the inv_scale it is given."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        return super()._unscale_grads_(optimizer, self._inv_scale(), found_inf, allow_fp16)


@mutant("pickles_mid_iteration", caught_by=["test_a_scaler_pickles_between_iterations"])
class PicklesMidIteration(DeviceSplitGradScaler):
    """Pickles between step() and update() by dropping the optimizer states, where torch refuses: the copy has
    forgotten this iteration's found_inf."""

    def __getstate__(self):
        if self._enabled:
            self._per_optimizer_states.clear()
        return super().__getstate__()


@mutant("decides_for_protocol_optimizers", caught_by=["test_an_optimizer_that_handles_scaling_gets_torchs_protocol"])
class DecidesForProtocolOptimizers(DeviceSplitGradScaler):
    """Treats every optimizer with _step_supports_amp_scaling as torch's own fused ones: unscales, decides the
    skip and calls a plain step(), never handing over the scaler, grad_scale or found_inf."""

    def _protocol_step(self, optimizer, state, *args, **kwargs):
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        retval = None if found_inf_value(state) > 0 else optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval


@mutant("lazy_init_restarts_the_scale", caught_by=["test_lazy_init_after_load_then_step_continues_the_checkpoint"])
class LazyInitRestartsTheScale(DeviceSplitGradScaler):
    """_lazy_init_scale_growth_tracker builds the scale from the constructor's init_scale and a zero tracker,
    dropping a checkpoint loaded before it (accelerate's FSDP2 load_state calls it right after the load)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._constructed_scale = self._host_scale if self._enabled else None

    def _lazy_init_scale_growth_tracker(self, dev):
        super()._lazy_init_scale_growth_tracker(dev)
        self._set_scale(self._constructed_scale)
        self._host_growth_tracker = 0


# the factories, by the names the specs use (`--scaler fsdp_amp_suite.planted.scalers.torch_state:<name>`)
ignores_writes_into_scale = IgnoresWritesIntoScale.factory
unscale_grads_ignores_inv_scale = UnscaleGradsIgnoresInvScale.factory
pickles_mid_iteration = PicklesMidIteration.factory
decides_for_protocol_optimizers = DecidesForProtocolOptimizers.factory
lazy_init_restarts_the_scale = LazyInitRestartsTheScale.factory
