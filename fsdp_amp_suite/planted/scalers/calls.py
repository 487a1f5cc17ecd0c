"""Planted scalers that break the call protocol: the order of scale / unscale_ / step / update, misuse,
step()'s arguments and return value, several optimizers, fused optimizers.
"""

import torch
from torch.amp.grad_scaler import OptState

from scaler_impl.scaler import DeviceSplitGradScaler, found_inf_value
from fsdp_amp_suite.planted.registry import mutant
from fsdp_amp_suite.planted.scalers.common import recorded, KnowsWhenStepping, LeavesSkipToFusedKernel


@mutant("steps_on_inf", caught_by=["test_inf_or_nan_skips_step_and_backs_off",
                                   "test_training_in_a_framework_matches_torchs_scaler_through_an_overflow_and_a_resume"],
        matrix="small")
class StepsOnInf(DeviceSplitGradScaler):
    """Backs off on inf but calls optimizer.step() anyway."""

    def step(self, optimizer, *args, **kwargs):
        if not self._enabled:
            return super().step(optimizer, *args, **kwargs)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"].name == "READY":
            self.unscale_(optimizer)
        found, state["found_inf_per_device"] = state["found_inf_per_device"], recorded(0.0)
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            state["found_inf_per_device"] = found


@mutant("allows_step_twice", caught_by=["test_misuse_raises_like_torch"])
class AllowsStepTwice(DeviceSplitGradScaler):
    def step(self, optimizer, *args, **kwargs):
        if self._enabled:
            state = self._per_optimizer_states[id(optimizer)]
            if state["stage"].name == "STEPPED":
                state["stage"] = type(state["stage"]).UNSCALED
        return super().step(optimizer, *args, **kwargs)


@mutant("allows_unscale_twice", caught_by=["test_misuse_raises_like_torch"])
class AllowsUnscaleTwice(DeviceSplitGradScaler):
    def unscale_(self, optimizer):
        if self._enabled:
            state = self._per_optimizer_states[id(optimizer)]
            if state["stage"].name == "UNSCALED":
                return
        super().unscale_(optimizer)


@mutant("disabled_still_scales", caught_by=["test_disabled_scaler_is_a_pass_through"])
class DisabledStillScales(DeviceSplitGradScaler):
    """A disabled scaler still multiplies the loss (by 2), where it should hand it back untouched."""

    def scale(self, outputs):
        if not self._enabled and isinstance(outputs, torch.Tensor):
            return outputs * 2.0
        return super().scale(outputs)


@mutant("one_inf_skips_every_optimizer", caught_by=["test_two_optimizers_skip_independently_back_off_once"])
class OneInfSkipsEveryOptimizer(DeviceSplitGradScaler):
    def step(self, optimizer, *args, **kwargs):
        if self._enabled and any(found_inf_value(s) for s in self._per_optimizer_states.values()):
            if self._per_optimizer_states[id(optimizer)]["stage"].name == "READY":
                self.unscale_(optimizer)
            self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = recorded(1.0)
        return super().step(optimizer, *args, **kwargs)


@mutant("drops_step_return_value", caught_by=["test_step_forwards_arguments_and_return_value",
                                              "test_every_call_matches_torch_amp_grad_scaler"])
class DropsStepReturnValue(DeviceSplitGradScaler):
    def step(self, optimizer, *args, **kwargs):
        super().step(optimizer, *args, **kwargs)
        return None


@mutant("drops_step_arguments", caught_by=["test_step_forwards_arguments_and_return_value"])
class DropsStepArguments(DeviceSplitGradScaler):
    def step(self, optimizer, *args, **kwargs):
        return super().step(optimizer)


@mutant("no_init_check", caught_by=["test_misuse_raises_like_torch"])
class NoInitCheck(DeviceSplitGradScaler):
    def _check_initialized(self, funcname):
        if self._scale_device is None:
            self._scale_device = torch.device("cpu")


@mutant("empty_state_dict_accepted", caught_by=["test_misuse_raises_like_torch"])
class EmptyStateDictAccepted(DeviceSplitGradScaler):
    def load_state_dict(self, state_dict):
        if state_dict:
            super().load_state_dict(state_dict)


@mutant("scale_loses_structure", caught_by=["test_scale_multiplies_tensors_and_keeps_structure",
                                            "test_every_call_matches_torch_amp_grad_scaler"])
class ScaleLosesStructure(DeviceSplitGradScaler):
    def scale(self, outputs):
        if self._enabled and isinstance(outputs, tuple):
            return [self.scale(o) for o in outputs]
        return super().scale(outputs)


@mutant("scales_only_first_output", caught_by=["test_gradient_accumulation_over_several_backwards"])
class ScalesOnlyFirstOutput(DeviceSplitGradScaler):
    """A second scale() before step() (gradient accumulation) returns the output unscaled."""

    def scale(self, outputs):
        if self._enabled and getattr(self, "_scaled_this_step", False) and isinstance(outputs, torch.Tensor):
            return outputs
        self._scaled_this_step = True
        return super().scale(outputs)

    def update(self, new_scale=None):
        self._scaled_this_step = False
        super().update(new_scale)


# Caught by the sequence test (test_sequences.py) only: each needs calls in an order no fixed schedule has.
@mutant("unscale_marks_every_optimizer", caught_by=["test_every_sequence_of_calls_follows_the_contract"])
class UnscaleMarksEveryOptimizer(KnowsWhenStepping):
    """An explicit unscale_ (the clipping path) of one optimizer counts for all (one flag per scaler, not per
    optimizer): another optimizer's step() then applies its grads still scaled, trusting the first's found_inf."""

    _unscaled = None

    def unscale_(self, optimizer):
        super().unscale_(optimizer)
        if self._enabled and not self._stepping:  # step()'s own unscale_ is per optimizer, as it should be
            self._unscaled = self._per_optimizer_states[id(optimizer)]

    def step(self, optimizer, *args, **kwargs):
        if not self._enabled:
            return super().step(optimizer, *args, **kwargs)
        state = self._per_optimizer_states[id(optimizer)]
        if self._unscaled is not None and state["stage"] is OptState.READY:
            state.update(stage=OptState.UNSCALED, found_inf_per_device=self._unscaled["found_inf_per_device"])
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self._unscaled = None
        super().update(new_scale)


@mutant("hands_fused_the_sum", caught_by=["test_an_overflow_skips_a_fused_optimizer_exactly"])
class HandsFusedTheSum(LeavesSkipToFusedKernel):
    """Hands a fused optimizer the found_inf summed over ranks and devices (KNOWN_BUGS
    torch-sharded-hands-fused-a-sum): two overflowing ranks give 2.0, which the kernel steps on."""

    def handed(self, agreed):
        return agreed


@mutant("leaves_skip_to_fused_kernel", caught_by=["test_an_overflow_skips_a_fused_optimizer_exactly"])
class LeavesSkipToFusedKernel(LeavesSkipToFusedKernel):
    """Hands a fused optimizer exactly 0.0 or 1.0 but calls its step() on an overflow too: fused SGD's skipped
    first step leaves its momentum buffer uninitialised (KNOWN_BUGS fused-sgd-skipped-first-step)."""

    def handed(self, agreed):
        return float(agreed > 0)


# the factories, by the names the specs use (`--scaler fsdp_amp_suite.planted.scalers.calls:<name>`)
steps_on_inf = StepsOnInf.factory
allows_step_twice = AllowsStepTwice.factory
allows_unscale_twice = AllowsUnscaleTwice.factory
disabled_still_scales = DisabledStillScales.factory
one_inf_skips_every_optimizer = OneInfSkipsEveryOptimizer.factory
drops_step_return_value = DropsStepReturnValue.factory
drops_step_arguments = DropsStepArguments.factory
no_init_check = NoInitCheck.factory
empty_state_dict_accepted = EmptyStateDictAccepted.factory
scale_loses_structure = ScaleLosesStructure.factory
scales_only_first_output = ScalesOnlyFirstOutput.factory
unscale_marks_every_optimizer = UnscaleMarksEveryOptimizer.factory
hands_fused_the_sum = HandsFusedTheSum.factory
leaves_skip_to_fused_kernel = LeavesSkipToFusedKernel.factory
