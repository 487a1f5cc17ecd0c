"""Planted scalers that break the unscale and the inf/NaN check: which grads, which values, which elements
reach the kernel, and what is unscaled.
"""
import math

import torch

from scaler_impl.scaler import DeviceSplitGradScaler
from fsdp_amp_suite.planted.registry import mutant
from fsdp_amp_suite.planted.scalers.common import correct_check, checks_first, hidden_grads, unscale_args


@mutant("unscales_twice", caught_by=["test_unscale_then_clip_then_step_unscales_once"],
        matrix="small")  # clip cells
class UnscalesTwice(DeviceSplitGradScaler):
    """step() unscales again after an explicit unscale_."""

    def step(self, optimizer, *args, **kwargs):
        state = self._per_optimizer_states[id(optimizer)] if self._enabled else None
        if state is not None and state["found_inf_per_device"]:
            self._unscale_grads_(optimizer, *unscale_args(self))
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


@mutant("checks_first_grad_only", caught_by=["test_inf_or_nan_skips_step_and_backs_off"],
        matrix="small")  # the +inf sits in the last grad of the shard
class ChecksFirstGradOnly(DeviceSplitGradScaler):
    """Only the first grad of each (device, dtype) group is checked (fairscale before PR 890)."""

    _check_and_unscale = checks_first(1)


@mutant("skips_low_precision_check", caught_by=["test_inf_or_nan_skips_step_and_backs_off"],
        matrix="small")  # keeplow cells: FSDP1 hands the scaler fp16/bf16 grads
class SkipsLowPrecisionCheck(DeviceSplitGradScaler):
    """fp16/bf16 grads are unscaled but never checked."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        if grads[0].dtype == torch.float32:
            correct_check(grads, found_inf, inv_scale)
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
            correct_check(grads, found_inf, inv_scale)


@mutant("ignores_sparse_grads", caught_by=["test_sparse_grads"])
class IgnoresSparseGrads(DeviceSplitGradScaler):
    def _unscale_grads_(self, optimizer, *args):
        with hidden_grads(optimizer, lambda grad: grad.is_sparse):
            return super()._unscale_grads_(optimizer, *args)


@mutant("ignores_d_tensor_grads", caught_by=["test_fsdp2_dtensor_grads_agree_across_ranks"],
        matrix="small")  # FSDP2 cells
class IgnoresDTensorGrads(DeviceSplitGradScaler):
    """FSDP2's DTensor grads are neither unscaled nor checked."""

    def _unscale_grads_(self, optimizer, *args):
        with hidden_grads(optimizer, lambda grad: type(grad).__name__ == "DTensor"):
            return super()._unscale_grads_(optimizer, *args)


@mutant("first_param_group_only", caught_by=["test_every_param_group_is_checked"],
        matrix="small")  # the +inf sits in the last grad, in the second param group
class FirstParamGroupOnly(DeviceSplitGradScaler):
    """Unscales and checks only optimizer.param_groups[0]."""

    def _unscale_grads_(self, optimizer, *args):
        class _FirstGroup:
            param_groups = optimizer.param_groups[:1]
        return super()._unscale_grads_(_FirstGroup, *args)


@mutant("checks_first_list_chunk_only", caught_by=["test_an_overflow_anywhere_in_a_model_sized_problem_is_seen"],
        matrix="wide")  # FSDP2 / use_orig_params: the +inf sits in grad 310 of the shard
class ChecksFirstListChunkOnly(DeviceSplitGradScaler):
    """Only the first 48 grads of each (device, dtype) group are checked, the rest unscaled unchecked (a
    multi-tensor launch over one list chunk): invisible to problems of a handful of params."""

    _check_and_unscale = checks_first(48)


@mutant("checks_first_block_of_each_grad", caught_by=["test_an_overflow_anywhere_in_a_model_sized_problem_is_seen"],
        matrix="wide")  # FSDP1 flat params: the +inf sits past element 65536 of the flat grad
class ChecksFirstBlockOfEachGrad(DeviceSplitGradScaler):
    """Each grad is checked in its first 65536 elements only (one CUDA chunk); all of it is unscaled:
    invisible to grads of a few hundred elements."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        correct_check([g.view(-1)[:65536] for g in grads], found_inf, inv_scale)
        tails = [g.view(-1)[65536:] for g in grads if g.numel() > 65536]
        if tails:
            torch._foreach_mul_(tails, inv_scale)


@mutant("found_inf_per_dtype_overwritten", caught_by=["test_every_sequence_of_calls_follows_the_contract"])
class FoundInfPerDtypeOverwritten(DeviceSplitGradScaler):
    """Each (device, dtype) group starts its device's found_inf afresh, so the last group's check is the one
    kept: with fp32 and fp16 grads in one optimizer, an inf in the first group is forgotten."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        found_inf.zero_()
        correct_check(grads, found_inf, inv_scale)


@mutant("grads_listed_at_first_unscale", caught_by=["test_every_sequence_of_calls_follows_the_contract"])
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


@mutant("unscales_contiguous_copies", caught_by=["test_every_sequence_of_calls_follows_the_contract"])
class UnscalesContiguousCopies(DeviceSplitGradScaler):
    """Hands the kernel grad.contiguous(): a strided grad (a channels_last or transposed param's) is unscaled in a
    copy that is thrown away, so its optimizer steps on the scaled grad."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        correct_check([g.contiguous() for g in grads], found_inf, inv_scale)


@mutant("checks_by_max_magnitude", caught_by=["test_every_sequence_of_calls_follows_the_contract"])
class ChecksByMaxMagnitude(DeviceSplitGradScaler):
    """Checks each grad through one reduction, grad.abs().max(), instead of the elementwise kernel: right for
    inf and NaN, but max() of a rank's empty shard raises."""

    @staticmethod
    def _check_and_unscale(grads, found_inf, inv_scale):
        peaks = torch.stack([g.abs().max() for g in grads])
        found_inf.add_(peaks.isfinite().logical_not().any().float())
        torch._foreach_mul_(grads, inv_scale)


# the factories, by the names the specs use (`--scaler fsdp_amp_suite.planted.scalers.checking:<name>`)
unscales_twice = UnscalesTwice.factory
misses_nan = MissesNaN.factory
misses_negative_inf = MissesNegativeInf.factory
checks_first_grad_only = ChecksFirstGradOnly.factory
skips_low_precision_check = SkipsLowPrecisionCheck.factory
leaves_half_grads_scaled = LeavesHalfGradsScaled.factory
ignores_sparse_grads = IgnoresSparseGrads.factory
ignores_d_tensor_grads = IgnoresDTensorGrads.factory
first_param_group_only = FirstParamGroupOnly.factory
checks_first_list_chunk_only = ChecksFirstListChunkOnly.factory
checks_first_block_of_each_grad = ChecksFirstBlockOfEachGrad.factory
found_inf_per_dtype_overwritten = FoundInfPerDtypeOverwritten.factory
grads_listed_at_first_unscale = GradsListedAtFirstUnscale.factory
unscales_contiguous_copies = UnscalesContiguousCopies.factory
checks_by_max_magnitude = ChecksByMaxMagnitude.factory
