"""The planted scalers: `ours` with a single clause of the contract broken, the kind of bug seen upstream.

Use one with `--scaler tests.planted.scalers:<name>`. Each is declared by `@mutant(name, caught_by=..., matrix=...)`
(tests/planted/registry.py): tests/meta/test_mutants.py checks that every test in its caught_by fails on it (and
`ours` passes them), tests/meta/test_teeth.py that the matrix roles fail matrix cells. The factory each name
stands for is bound in the table at the end.
"""
import contextlib
import math

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from scaler_impl.scaler import DTensor, DeviceSplitGradScaler, _f32, found_inf_value
from tests.harness import cached_group
from tests.known_bugs import FUSED, MESH, MESH_SEQUENCES, SEQUENCES
from tests.planted.registry import mutant

_check_and_unscale = DeviceSplitGradScaler._check_and_unscale  # the correct group check


def _found(value: float) -> dict:
    """An optimizer state's found_inf_per_device holding `value`, as the scaler records the agreed sum."""
    return {torch.device("cpu"): torch.tensor(float(value))}


def _unscale_args(scaler) -> tuple:
    """The rest of _unscale_grads_'s arguments as unscale_ passes them: inv_scale, found_inf, allow_fp16."""
    return torch.full((), _f32(1.0 / scaler._host_scale)), torch.zeros(()), True


@mutant("no_agreement", caught_by=["test_inf_on_some_ranks_makes_every_rank_skip_and_back_off",
                                   "test_ranks_keep_scale_in_lockstep",
                                   "test_unmatched_step_surfaces_as_a_hang_in_bounded_time"],
        matrix="small")  # ranks decide alone: the rank without the inf steps
class NoAgreement(DeviceSplitGradScaler):
    """found_inf is never all-reduced: ranks decide alone (torch.amp.GradScaler's behaviour)."""

    def _agree(self, found):
        return float(sum(t.item() for t in found.values()))


@mutant("world_group", caught_by=["test_agreement_uses_the_given_process_group"])
class WorldGroup(DeviceSplitGradScaler):
    """Agrees over WORLD, whatever process_group it was given."""

    def _agree(self, found):
        group, self.process_group = self.process_group, None
        try:
            return super()._agree(found)
        finally:
            self.process_group = group


@mutant("backoff_only_if_exactly_one", caught_by=["test_inf_on_some_ranks_makes_every_rank_skip_and_back_off"],
        matrix="small")  # both ranks see the fp16 overflow: found_inf sums to 2.0
class BackoffOnlyIfExactlyOne(DeviceSplitGradScaler):
    """fairscale's found_inf.item() == 1.0 (KNOWN_BUGS fairscale-backoff-only-if-exactly-one): a sum of 2.0 counts
    as clean."""

    def _agree(self, found):
        value = super()._agree(found)
        return value if value == 1.0 else 0.0


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


@mutant("unscales_twice", caught_by=["test_unscale_then_clip_then_step_unscales_once"],
        matrix="small")  # clip cells
class UnscalesTwice(DeviceSplitGradScaler):
    """step() unscales again after an explicit unscale_."""

    def step(self, optimizer, *args, **kwargs):
        state = self._per_optimizer_states[id(optimizer)] if self._enabled else None
        if state is not None and state["found_inf_per_device"]:
            self._unscale_grads_(optimizer, *_unscale_args(self))
        return super().step(optimizer, *args, **kwargs)


@mutant("misses_nan", caught_by=["test_inf_or_nan_skips_step_and_backs_off"],
        matrix="small")  # fp16 cells: the overflowing micro-batch makes NaN
class MissesNaN(DeviceSplitGradScaler):
    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        found_inf.add_(torch.stack([g.isinf().any() for g in grads]).any().float())
        torch._foreach_mul_(grads, inv_scale)


@mutant("misses_negative_inf", caught_by=["test_inf_or_nan_skips_step_and_backs_off"],
        matrix="small")  # the -inf injected at step 7 in fp32/bf16 cells
class MissesNegativeInf(DeviceSplitGradScaler):
    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        found_inf.add_(torch.stack([(g.isnan() | (g == math.inf)).any() for g in grads]).any().float())
        torch._foreach_mul_(grads, inv_scale)


def _checks_first(k):
    """A group check that checks only the first k grads of the group and unscales the rest unchecked."""
    def check(grads, found_inf, inv_scale):
        _check_and_unscale(grads[:k], found_inf, inv_scale)
        if len(grads) > k:
            torch._foreach_mul_(grads[k:], inv_scale)
    return staticmethod(check)


@mutant("checks_first_grad_only", caught_by=["test_inf_or_nan_skips_step_and_backs_off"],
        matrix="small")  # the +inf sits in the last grad of the shard
class ChecksFirstGradOnly(DeviceSplitGradScaler):
    """Only the first grad of each (device, dtype) group is checked (fairscale before PR 890)."""

    _check_and_unscale = _checks_first(1)


@mutant("skips_low_precision_check", caught_by=["test_inf_or_nan_skips_step_and_backs_off"],
        matrix="small")  # keeplow cells: FSDP1 hands the scaler fp16/bf16 grads
class SkipsLowPrecisionCheck(DeviceSplitGradScaler):
    """fp16/bf16 grads are unscaled but never checked."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        if grads[0].dtype == torch.float32:
            _check_and_unscale(grads, found_inf, inv_scale)
        else:
            torch._foreach_mul_(grads, inv_scale)


@mutant("leaves_half_grads_scaled", caught_by=["test_clean_step_unscales_exactly_and_steps"],
        matrix="small")
class LeavesHalfGradsScaled(DeviceSplitGradScaler):
    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        if grads[0].dtype == torch.float16:
            found_inf.add_(torch.stack([g.isfinite().all() for g in grads]).all().logical_not().float())
        else:
            _check_and_unscale(grads, found_inf, inv_scale)


@mutant("steps_on_inf", caught_by=["test_inf_or_nan_skips_step_and_backs_off"],
        matrix="small")
class StepsOnInf(DeviceSplitGradScaler):
    """Backs off on inf but calls optimizer.step() anyway."""

    def step(self, optimizer, *args, **kwargs):
        if not self._enabled:
            return super().step(optimizer, *args, **kwargs)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"].name == "READY":
            self.unscale_(optimizer)
        found, state["found_inf_per_device"] = state["found_inf_per_device"], _found(0.0)
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            state["found_inf_per_device"] = found


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


@contextlib.contextmanager
def _hidden_grads(optimizer, hide):
    """Set aside the grads for which hide(grad) is true, as if those params had none."""
    hidden = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None and hide(p.grad)]
    for p, _ in hidden:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in hidden:
            p.grad = grad


@mutant("ignores_sparse_grads", caught_by=["test_sparse_grads"])
class IgnoresSparseGrads(DeviceSplitGradScaler):
    def _unscale_grads_(self, optimizer, *args):
        with _hidden_grads(optimizer, lambda grad: grad.is_sparse):
            return super()._unscale_grads_(optimizer, *args)


@mutant("ignores_d_tensor_grads", caught_by=["test_fsdp2_dtensor_grads_agree_across_ranks"],
        matrix="small")  # FSDP2 cells
class IgnoresDTensorGrads(DeviceSplitGradScaler):
    """FSDP2's DTensor grads are neither unscaled nor checked."""

    def _unscale_grads_(self, optimizer, *args):
        with _hidden_grads(optimizer, lambda grad: type(grad).__name__ == "DTensor"):
            return super()._unscale_grads_(optimizer, *args)


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


@mutant("backs_off_per_optimizer", caught_by=["test_two_optimizers_skip_independently_back_off_once"])
class BacksOffPerOptimizer(DeviceSplitGradScaler):
    def update(self, new_scale=None):
        bad = sum(1 for s in self._per_optimizer_states.values() if found_inf_value(s)) if self._enabled else 0
        super().update(new_scale)
        for _ in range(max(0, bad - 1)):
            self._set_scale(self._host_scale * self._backoff_factor)


@mutant("one_inf_skips_every_optimizer", caught_by=["test_two_optimizers_skip_independently_back_off_once"])
class OneInfSkipsEveryOptimizer(DeviceSplitGradScaler):
    def step(self, optimizer, *args, **kwargs):
        if self._enabled and any(found_inf_value(s) for s in self._per_optimizer_states.values()):
            if self._per_optimizer_states[id(optimizer)]["stage"].name == "READY":
                self.unscale_(optimizer)
            self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = _found(1.0)
        return super().step(optimizer, *args, **kwargs)


@mutant("ignores_new_scale", caught_by=["test_update_with_new_scale"])
class IgnoresNewScale(DeviceSplitGradScaler):
    def update(self, new_scale=None):
        if new_scale is not None:
            self._per_optimizer_states.clear()
            return
        super().update(new_scale)


@mutant("skips_collective_without_grads", caught_by=["test_rank_without_grads_takes_part"])
class SkipsCollectiveWithoutGrads(DeviceSplitGradScaler):
    """A rank with no grads records nothing and skips the all_reduce (pytorch#99174)."""

    def _agree(self, found):
        if not found:
            return 0.0
        return super()._agree(found)


@mutant("drops_step_return_value", caught_by=["test_step_forwards_arguments_and_return_value"])
class DropsStepReturnValue(DeviceSplitGradScaler):
    def step(self, optimizer, *args, **kwargs):
        super().step(optimizer, *args, **kwargs)
        return None


@mutant("drops_step_arguments", caught_by=["test_step_forwards_arguments_and_return_value"])
class DropsStepArguments(DeviceSplitGradScaler):
    def step(self, optimizer, *args, **kwargs):
        return super().step(optimizer)


@mutant("setters_ignored", caught_by=["test_setters_take_effect"])
class SettersIgnored(DeviceSplitGradScaler):
    def set_growth_interval(self, new_interval):
        pass

    def set_growth_factor(self, new_factor):
        pass


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


@mutant("scale_loses_structure", caught_by=["test_scale_multiplies_tensors_and_keeps_structure"])
class ScaleLosesStructure(DeviceSplitGradScaler):
    def scale(self, outputs):
        if self._enabled and isinstance(outputs, tuple):
            return [self.scale(o) for o in outputs]
        return super().scale(outputs)


@mutant("init_scale_ignored", caught_by=["test_enabled_scaler_reports_its_settings"],
        matrix="small")
class InitScaleIgnored(DeviceSplitGradScaler):
    def __init__(self, **kwargs):
        kwargs["init_scale"] = 2.0 ** 16
        super().__init__(**kwargs)


@mutant("first_param_group_only", caught_by=["test_every_param_group_is_checked"],
        matrix="small")  # the +inf sits in the last grad, in the second param group
class FirstParamGroupOnly(DeviceSplitGradScaler):
    """Unscales and checks only optimizer.param_groups[0]."""

    def _unscale_grads_(self, optimizer, *args):
        class _FirstGroup:
            param_groups = optimizer.param_groups[:1]
        return super()._unscale_grads_(_FirstGroup, *args)


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


@mutant("agrees_only_in_step", caught_by=["test_inf_on_some_ranks_makes_every_rank_skip_and_back_off"],
        matrix="small")  # the clipping path's unscale_ decides alone
class AgreesOnlyInStep(DeviceSplitGradScaler):
    """An explicit unscale_ (the clipping path) decides alone; only step()'s own unscale agrees."""

    def unscale_(self, optimizer):
        self._local_only = True
        try:
            super().unscale_(optimizer)
        finally:
            self._local_only = False

    def step(self, optimizer, *args, **kwargs):
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"].name == "READY":
            self._check_initialized("step")
            state = self._per_optimizer_states[id(optimizer)]
            found = self._unscale_grads_(optimizer, *_unscale_args(self))
            state["found_inf_per_device"] = _found(DeviceSplitGradScaler._agree(self, found))
            state["stage"] = type(state["stage"]).UNSCALED
        return super().step(optimizer, *args, **kwargs)

    def _agree(self, found):
        if getattr(self, "_local_only", False):
            return float(sum(t.item() for t in found.values()))
        return super()._agree(found)


@mutant("agrees_for_first_optimizer_only", caught_by=["test_each_optimizer_agrees_across_ranks"])
class AgreesForFirstOptimizerOnly(DeviceSplitGradScaler):
    def _agree(self, found):
        if len(self._per_optimizer_states) > 1:
            return float(sum(t.item() for t in found.values()))
        return super()._agree(found)


@mutant("checks_first_list_chunk_only", caught_by=["test_an_overflow_anywhere_in_a_model_sized_problem_is_seen"],
        matrix="wide")  # FSDP2 / use_orig_params: the +inf sits in grad 310 of the shard
class ChecksFirstListChunkOnly(DeviceSplitGradScaler):
    """Only the first 48 grads of each (device, dtype) group are checked, the rest unscaled unchecked (a
    multi-tensor launch over one list chunk): invisible to problems of a handful of params."""

    _check_and_unscale = _checks_first(48)


@mutant("checks_first_block_of_each_grad", caught_by=["test_an_overflow_anywhere_in_a_model_sized_problem_is_seen"],
        matrix="wide")  # FSDP1 flat params: the +inf sits past element 65536 of the flat grad
class ChecksFirstBlockOfEachGrad(DeviceSplitGradScaler):
    """Each grad is checked in its first 65536 elements only (one CUDA chunk); all of it is unscaled:
    invisible to grads of a few hundred elements."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        _check_and_unscale([g.view(-1)[:65536] for g in grads], found_inf, inv_scale)
        tails = [g.view(-1)[65536:] for g in grads if g.numel() > 65536]
        if tails:
            torch._foreach_mul_(tails, inv_scale)


class _KnowsWhenStepping(DeviceSplitGradScaler):
    """`_stepping` is True inside step(): tells step()'s own unscale_ from the clipping path's explicit one."""

    _stepping = False

    def step(self, optimizer, *args, **kwargs):
        self._stepping = True
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            self._stepping = False


# Caught by the sequence test (test_sequences.py) only: each needs calls in an order no fixed schedule has.
@mutant("unscale_marks_every_optimizer", caught_by=[SEQUENCES])
class UnscaleMarksEveryOptimizer(_KnowsWhenStepping):
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


# The sequence test catches this one, and a fixed check as well.
@mutant("load_keeps_own_settings", caught_by=[SEQUENCES, "test_state_dict_round_trip_resumes_identically"])
class LoadKeepsOwnSettings(DeviceSplitGradScaler):
    """load_state_dict restores the scale and the tracker only; growth and backoff factors and the interval
    stay what the resuming scaler was built with (checkpoint code that trusts its own config)."""

    def load_state_dict(self, state_dict):
        if not self._enabled:
            return super().load_state_dict(state_dict)
        own = self._growth_factor, self._backoff_factor, self._growth_interval
        super().load_state_dict(state_dict)
        self._growth_factor, self._backoff_factor, self._growth_interval = own


@mutant("update_counts_stepped_optimizers_only", caught_by=[SEQUENCES])  # the sequence test only
class UpdateCountsSteppedOptimizersOnly(DeviceSplitGradScaler):
    """update() reads found_inf only from optimizers that stepped: an optimizer that was unscaled and saw
    inf but was not stepped this iteration (frozen, or stepped every other iteration) never backs off."""

    def update(self, new_scale=None):
        if self._enabled:
            for state in self._per_optimizer_states.values():
                if state["stage"] is OptState.UNSCALED:
                    state["found_inf_per_device"] = _found(0.0)
        super().update(new_scale)


@mutant("tracker_counts_optimizer_steps", caught_by=[SEQUENCES])  # the sequence test only
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
@mutant("clamps_scale_at_one", caught_by=[SEQUENCES, "test_scale_trajectory_matches_reference_model"])
class ClampsScaleAtOne(DeviceSplitGradScaler):
    """update() never leaves the scale below 1.0 (a min_scale floor, as some trainers add): a backoff
    from 1 is refused and a scale that starts below 1 jumps up, so fp16 grads that need it overflow."""

    def update(self, new_scale=None):
        super().update(new_scale)
        if self._enabled and new_scale is None and self._host_scale < 1.0:
            self._set_scale(1.0)



class _LeavesSkipToFusedKernel(DeviceSplitGradScaler):
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


@mutant("hands_fused_the_sum", caught_by=[FUSED])
class HandsFusedTheSum(_LeavesSkipToFusedKernel):
    """Hands a fused optimizer the found_inf summed over ranks and devices (KNOWN_BUGS
    torch-sharded-hands-fused-a-sum): two overflowing ranks give 2.0, which the kernel steps on."""

    def handed(self, agreed):
        return agreed


@mutant("leaves_skip_to_fused_kernel", caught_by=[FUSED])
class LeavesSkipToFusedKernel(_LeavesSkipToFusedKernel):
    """Hands a fused optimizer exactly 0.0 or 1.0 but calls its step() on an overflow too: fused SGD's skipped
    first step leaves its momentum buffer uninitialised (KNOWN_BUGS fused-sgd-skipped-first-step)."""

    def handed(self, agreed):
        return float(agreed > 0)


# ---- along the drawn problem (tests/conformance/calls.py): caught by the sequences' new draws

@mutant("found_inf_per_dtype_overwritten", caught_by=[SEQUENCES])
class FoundInfPerDtypeOverwritten(DeviceSplitGradScaler):
    """Each (device, dtype) group starts its device's found_inf afresh, so the last group's check is the one
    kept: with fp32 and fp16 grads in one optimizer, an inf in the first group is forgotten."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        found_inf.zero_()
        _check_and_unscale(grads, found_inf, inv_scale)


@mutant("grads_listed_at_first_unscale", caught_by=[SEQUENCES])
class GradsListedAtFirstUnscale(DeviceSplitGradScaler):
    """Lists an optimizer's params with grads once, at its first unscale_, and reuses the list (to save the walk
    over param_groups): a param whose grad appears later (an unfrozen layer, an expert first routed to) is
    never unscaled or checked."""

    def _unscale_grads_(self, optimizer, *args):
        listed = self.__dict__.setdefault("_listed", {})
        if id(optimizer) not in listed:
            listed[id(optimizer)] = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        keep = {id(p) for p in listed[id(optimizer)]}
        hidden = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if id(p) not in keep]
        for p, _ in hidden:
            p.grad = None
        try:
            return super()._unscale_grads_(optimizer, *args)
        finally:
            for p, grad in hidden:
                p.grad = grad


@mutant("scale_not_rounded_to_float32", caught_by=[SEQUENCES])
class ScaleNotRoundedToFloat32(DeviceSplitGradScaler):
    """Keeps the host scale as a Python float without rounding it to float32: with factors or a new_scale that
    are not powers of two, get_scale() and state_dict() drift from the float32 scale torch keeps."""

    def _set_scale(self, value):
        self._host_scale = float(value)
        self._scale_tensors = {}


@mutant("state_dict_is_live", caught_by=[SEQUENCES])
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


@mutant("explicit_unscale_agrees_over_world", caught_by=[SEQUENCES])
class ExplicitUnscaleAgreesOverWorld(_KnowsWhenStepping, WorldGroup):
    """The clipping path's unscale_ agrees over WORLD (world_group's defect), not the given process_group; step()
    alone uses the group: under HSDP's shard groups one group's overflow skips the other group's step after a clip."""

    def _agree(self, found):
        return DeviceSplitGradScaler._agree(self, found) if self._stepping else super()._agree(found)


@mutant("unscales_contiguous_copies", caught_by=[SEQUENCES])
class UnscalesContiguousCopies(DeviceSplitGradScaler):
    """Hands the kernel grad.contiguous(): a strided grad (a channels_last or transposed param's) is unscaled in a
    copy that is thrown away, so its optimizer steps on the scaled grad."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        _check_and_unscale([g.contiguous() for g in grads], found_inf, inv_scale)


@mutant("checks_by_max_magnitude", caught_by=[SEQUENCES])
class ChecksByMaxMagnitude(DeviceSplitGradScaler):
    """Checks each grad through one reduction, grad.abs().max(), instead of the elementwise kernel: right for
    inf and NaN, but max() of a rank's empty shard raises."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        peaks = torch.stack([g.abs().max() for g in grads])
        found_inf.add_(peaks.isfinite().logical_not().any().float())
        torch._foreach_mul_(grads, inv_scale)


@mutant("trusts_dtensor_agreement", caught_by=[MESH])
class TrustsDTensorAgreement(DeviceSplitGradScaler):
    """With DTensor grads, leaves the agreement to DTensor, as torch.amp.GradScaler (and accelerate with FSDP2)
    does: the unscale kernel is called on the DTensors, whose handler reduces found_inf over the mesh, and the
    scaler's own all-reduce is skipped. CPU grads only (a planted defect, not a scaler)."""

    _trusting = False

    def _unscale_grads_(self, optimizer, *args):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        dtensors = [g for g in grads if isinstance(g, DTensor)]
        self._trusting = bool(dtensors)
        if not dtensors:
            return super()._unscale_grads_(optimizer, *args)
        plain = [g for g in grads if not isinstance(g, DTensor)]
        found, inv = torch.zeros(()), torch.full((), _f32(1.0 / self._host_scale))
        with torch.no_grad():
            for group in (dtensors, plain):
                if group:
                    mine = torch.zeros(())
                    torch._amp_foreach_non_finite_check_and_unscale_(group, mine, inv)
                    found += mine
        return {torch.device("cpu"): found}

    def _agree(self, found):
        if self._trusting:
            return float(sum(t.item() for t in found.values()))
        return super()._agree(found)

@mutant("agrees_along_one_mesh_dim", caught_by=[MESH, MESH_SEQUENCES], matrix="mesh")  # the inf on the last rank: ranks 0, 1 step
class AgreesAlongOneMeshDim(DeviceSplitGradScaler):
    """At world size 4 with no process group given, agrees on found_inf along the last dim of the 2x2 mesh only
    (HSDP's shard dim, or tp): over its own half of the world, as a scaler handed one mesh dim's group instead of
    the whole job's would. Elsewhere it is correct."""

    def _agree(self, found):
        if self.process_group is not None or not dist.is_initialized() or dist.get_world_size() != 4:
            return super()._agree(found)
        rows = [cached_group(ranks) for ranks in ([0, 1], [2, 3])]  # every rank makes both, in this order
        self.process_group = rows[dist.get_rank() // 2]
        try:
            return super()._agree(found)
        finally:
            self.process_group = None


# The factories, by the names the specs use (`--scaler tests.planted.scalers:<name>`): each is its class's
# @mutant name (tests/meta/test_planted.py checks that every name resolves to the factory registered under it).
no_agreement = NoAgreement.factory
world_group = WorldGroup.factory
backoff_only_if_exactly_one = BackoffOnlyIfExactlyOne.factory
grows_one_step_late = GrowsOneStepLate.factory
tracker_not_reset_on_backoff = TrackerNotResetOnBackoff.factory
state_dict_forgets_tracker = StateDictForgetsTracker.factory
unscales_twice = UnscalesTwice.factory
misses_nan = MissesNaN.factory
misses_negative_inf = MissesNegativeInf.factory
checks_first_grad_only = ChecksFirstGradOnly.factory
skips_low_precision_check = SkipsLowPrecisionCheck.factory
leaves_half_grads_scaled = LeavesHalfGradsScaled.factory
steps_on_inf = StepsOnInf.factory
hardcoded_growth_factor = HardcodedGrowthFactor.factory
backoff_is_inverse_growth = BackoffIsInverseGrowth.factory
grows_to_inf = GrowsToInf.factory
stale_scale_after_backoff = StaleScaleAfterBackoff.factory
ignores_sparse_grads = IgnoresSparseGrads.factory
ignores_d_tensor_grads = IgnoresDTensorGrads.factory
allows_step_twice = AllowsStepTwice.factory
allows_unscale_twice = AllowsUnscaleTwice.factory
disabled_still_scales = DisabledStillScales.factory
backs_off_per_optimizer = BacksOffPerOptimizer.factory
one_inf_skips_every_optimizer = OneInfSkipsEveryOptimizer.factory
ignores_new_scale = IgnoresNewScale.factory
skips_collective_without_grads = SkipsCollectiveWithoutGrads.factory
drops_step_return_value = DropsStepReturnValue.factory
drops_step_arguments = DropsStepArguments.factory
setters_ignored = SettersIgnored.factory
no_init_check = NoInitCheck.factory
empty_state_dict_accepted = EmptyStateDictAccepted.factory
scale_loses_structure = ScaleLosesStructure.factory
init_scale_ignored = InitScaleIgnored.factory
first_param_group_only = FirstParamGroupOnly.factory
scales_only_first_output = ScalesOnlyFirstOutput.factory
agrees_only_in_step = AgreesOnlyInStep.factory
agrees_for_first_optimizer_only = AgreesForFirstOptimizerOnly.factory
checks_first_list_chunk_only = ChecksFirstListChunkOnly.factory
checks_first_block_of_each_grad = ChecksFirstBlockOfEachGrad.factory
unscale_marks_every_optimizer = UnscaleMarksEveryOptimizer.factory
load_keeps_own_settings = LoadKeepsOwnSettings.factory
update_counts_stepped_optimizers_only = UpdateCountsSteppedOptimizersOnly.factory
tracker_counts_optimizer_steps = TrackerCountsOptimizerSteps.factory
clamps_scale_at_one = ClampsScaleAtOne.factory
hands_fused_the_sum = HandsFusedTheSum.factory
leaves_skip_to_fused_kernel = LeavesSkipToFusedKernel.factory
found_inf_per_dtype_overwritten = FoundInfPerDtypeOverwritten.factory
grads_listed_at_first_unscale = GradsListedAtFirstUnscale.factory
scale_not_rounded_to_float32 = ScaleNotRoundedToFloat32.factory
state_dict_is_live = StateDictIsLive.factory
explicit_unscale_agrees_over_world = ExplicitUnscaleAgreesOverWorld.factory
unscales_contiguous_copies = UnscalesContiguousCopies.factory
checks_by_max_magnitude = ChecksByMaxMagnitude.factory
trusts_dtensor_agreement = TrustsDTensorAgreement.factory
agrees_along_one_mesh_dim = AgreesAlongOneMeshDim.factory
