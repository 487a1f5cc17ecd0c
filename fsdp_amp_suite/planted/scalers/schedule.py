"""Planted scalers that break the scale's schedule and its checkpoint: growth, backoff, the tracker, the
settings, state_dict and load_state_dict.
"""
import math

from torch.amp.grad_scaler import OptState

from scaler_impl.scaler import DeviceSplitGradScaler, _f32, found_inf_value
from fsdp_amp_suite.planted.registry import mutant
from fsdp_amp_suite.planted.scalers.common import recorded


@mutant("grows_one_step_late", caught_by=["test_growth_after_exactly_growth_interval_clean_steps",
                                          "test_scale_trajectory_matches_reference_model"],
        matrix="small")
class GrowsOneStepLate(DeviceSplitGradScaler):
    """Grows after growth_interval + 1 clean steps."""

    def update(self, new_scale=None):
        if self._enabled:
            self._growth_interval += 1
        try:
            super().update(new_scale)
        finally:
            if self._enabled:
                self._growth_interval -= 1


@mutant("tracker_not_reset_on_backoff", caught_by=["test_scale_trajectory_matches_reference_model"],
        matrix="small")
class TrackerNotResetOnBackoff(DeviceSplitGradScaler):
    """A backoff keeps the growth progress made before it."""

    def update(self, new_scale=None):
        if not self._enabled or new_scale is not None:
            return super().update(new_scale)
        tracker = self._host_growth_tracker
        bad = any(found_inf_value(s) for s in self._per_optimizer_states.values())
        super().update(new_scale)
        if bad:
            self._host_growth_tracker = tracker


@mutant("state_dict_forgets_tracker", caught_by=["test_state_dict_round_trip_resumes_identically"],
        matrix="small")  # the resume after step 8
class StateDictForgetsTracker(DeviceSplitGradScaler):
    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if self._enabled:
            self._host_growth_tracker = 0


@mutant("hardcoded_growth_factor", caught_by=["test_growth_after_exactly_growth_interval_clean_steps"],
        matrix="small")  # growth 4x
class HardcodedGrowthFactor(DeviceSplitGradScaler):
    def update(self, new_scale=None):
        if self._enabled:
            self._growth_factor = 2.0
        super().update(new_scale)


@mutant("backoff_is_inverse_growth", caught_by=["test_scale_trajectory_matches_reference_model"],
        matrix="small")  # backoff 0.5x, not 1/4
class BackoffIsInverseGrowth(DeviceSplitGradScaler):
    def update(self, new_scale=None):
        if self._enabled:
            self._backoff_factor = 1.0 / self._growth_factor
        super().update(new_scale)


@mutant("grows_to_inf", caught_by=["test_growth_never_overflows_to_inf"])
class GrowsToInf(DeviceSplitGradScaler):
    """Grows even when the grown scale is inf (no isfinite check)."""

    def update(self, new_scale=None):
        due = (self._enabled and new_scale is None and self._host_growth_tracker + 1 == self._growth_interval
               and not any(found_inf_value(s) for s in self._per_optimizer_states.values()))
        old = self._host_scale if self._enabled else None
        super().update(new_scale)
        if due and not math.isfinite(_f32(old * self._growth_factor)):
            self._set_scale(math.inf)


@mutant("stale_scale_after_backoff", caught_by=["test_inf_or_nan_skips_step_and_backs_off"],
        matrix="small")
class StaleScaleAfterBackoff(DeviceSplitGradScaler):
    """scale() keeps multiplying by the scale tensor cached before update() changed the scale."""

    def _set_scale(self, value):
        self._host_scale = _f32(value)  # the per-device tensor cache is not invalidated


@mutant("backs_off_per_optimizer", caught_by=["test_two_optimizers_skip_independently_back_off_once"])
class BacksOffPerOptimizer(DeviceSplitGradScaler):
    def update(self, new_scale=None):
        bad = sum(1 for s in self._per_optimizer_states.values() if found_inf_value(s)) if self._enabled else 0
        super().update(new_scale)
        for _ in range(max(0, bad - 1)):
            self._set_scale(self._host_scale * self._backoff_factor)


@mutant("ignores_new_scale", caught_by=["test_update_with_new_scale"])
class IgnoresNewScale(DeviceSplitGradScaler):
    def update(self, new_scale=None):
        if new_scale is not None:
            self._per_optimizer_states.clear()
            return
        super().update(new_scale)


@mutant("setters_ignored", caught_by=["test_setters_take_effect"])
class SettersIgnored(DeviceSplitGradScaler):
    def set_growth_interval(self, new_interval):
        pass

    def set_growth_factor(self, new_factor):
        pass


@mutant("init_scale_ignored", caught_by=["test_enabled_scaler_reports_its_settings"],
        matrix="small")
class InitScaleIgnored(DeviceSplitGradScaler):
    def __init__(self, **kwargs):
        kwargs["init_scale"] = 2.0 ** 16
        super().__init__(**kwargs)


# The sequence test catches this one, and a fixed check as well.
@mutant("load_keeps_own_settings", caught_by=["test_every_sequence_of_calls_follows_the_contract",
                                              "test_state_dict_round_trip_resumes_identically"])
class LoadKeepsOwnSettings(DeviceSplitGradScaler):
    """load_state_dict restores the scale and the tracker only; growth and backoff factors and the interval
    stay what the resuming scaler was built with (checkpoint code that trusts its own config)."""

    def load_state_dict(self, state_dict):
        if not self._enabled:
            return super().load_state_dict(state_dict)
        own = self._growth_factor, self._backoff_factor, self._growth_interval
        super().load_state_dict(state_dict)
        self._growth_factor, self._backoff_factor, self._growth_interval = own


# caught by the sequence test only
@mutant("update_counts_stepped_optimizers_only", caught_by=["test_every_sequence_of_calls_follows_the_contract"])
class UpdateCountsSteppedOptimizersOnly(DeviceSplitGradScaler):
    """update() reads found_inf only from optimizers that stepped: an optimizer that was unscaled and saw
    inf but was not stepped this iteration (frozen, or stepped every other iteration) never backs off."""

    def update(self, new_scale=None):
        if self._enabled:
            for state in self._per_optimizer_states.values():
                if state["stage"] is OptState.UNSCALED:
                    state["found_inf_per_device"] = recorded(0.0)
        super().update(new_scale)


# caught by the sequence test only
@mutant("tracker_counts_optimizer_steps", caught_by=["test_every_sequence_of_calls_follows_the_contract"])
class TrackerCountsOptimizerSteps(DeviceSplitGradScaler):
    """The growth tracker counts clean optimizer steps, not clean updates: with two optimizers it runs
    twice as fast, and can jump past growth_interval and never grow again."""

    def update(self, new_scale=None):
        if self._enabled and new_scale is None:
            states = [s for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
            if states and not any(found_inf_value(s) for s in states):
                self._host_growth_tracker += sum(s["stage"] is OptState.STEPPED for s in states) - 1
        super().update(new_scale)


# The sequence test catches this one, and a fixed check as well.
@mutant("clamps_scale_at_one", caught_by=["test_every_sequence_of_calls_follows_the_contract",
                                          "test_scale_trajectory_matches_reference_model"])
class ClampsScaleAtOne(DeviceSplitGradScaler):
    """update() never leaves the scale below 1.0 (a min_scale floor, as some trainers add): a backoff
    from 1 is refused and a scale that starts below 1 jumps up, so fp16 grads that need it overflow."""

    def update(self, new_scale=None):
        super().update(new_scale)
        if self._enabled and new_scale is None and self._host_scale < 1.0:
            self._set_scale(1.0)


@mutant("scale_not_rounded_to_float32", caught_by=["test_every_sequence_of_calls_follows_the_contract"])
class ScaleNotRoundedToFloat32(DeviceSplitGradScaler):
    """Keeps the host scale as a Python float without rounding it to float32: with factors or a new_scale that
    are not powers of two, get_scale() and state_dict() drift from the float32 scale torch keeps."""

    def _set_scale(self, value):
        self._host_scale = float(value)
        self._scale_tensors = {}


@mutant("state_dict_is_live", caught_by=["test_every_sequence_of_calls_follows_the_contract",
                                         "test_every_call_matches_torch_amp_grad_scaler"])
class StateDictIsLive(DeviceSplitGradScaler):
    """state_dict() returns one dict that the scaler keeps current (a cache, to avoid rebuilding it): a
    checkpoint kept in memory follows training instead of holding the state it was taken at."""

    def state_dict(self):
        live = self.__dict__.setdefault("_live", {})
        live.update(super().state_dict())
        return live

    def update(self, new_scale=None):
        super().update(new_scale)
        if "_live" in self.__dict__:
            self._live.update(super().state_dict())


# the factories, by the names the specs use (`--scaler fsdp_amp_suite.planted.scalers.schedule:<name>`)
grows_one_step_late = GrowsOneStepLate.factory
tracker_not_reset_on_backoff = TrackerNotResetOnBackoff.factory
state_dict_forgets_tracker = StateDictForgetsTracker.factory
hardcoded_growth_factor = HardcodedGrowthFactor.factory
backoff_is_inverse_growth = BackoffIsInverseGrowth.factory
grows_to_inf = GrowsToInf.factory
stale_scale_after_backoff = StaleScaleAfterBackoff.factory
backs_off_per_optimizer = BacksOffPerOptimizer.factory
ignores_new_scale = IgnoresNewScale.factory
setters_ignored = SettersIgnored.factory
init_scale_ignored = InitScaleIgnored.factory
load_keeps_own_settings = LoadKeepsOwnSettings.factory
update_counts_stepped_optimizers_only = UpdateCountsSteppedOptimizersOnly.factory
tracker_counts_optimizer_steps = TrackerCountsOptimizerSteps.factory
clamps_scale_at_one = ClampsScaleAtOne.factory
scale_not_rounded_to_float32 = ScaleNotRoundedToFloat32.factory
state_dict_is_live = StateDictIsLive.factory
