"""Planted scalers that break the agreement on found_inf: across ranks, process groups, mesh dims and
optimizers, on every path that decides a step.
"""

import torch
import torch.distributed as dist

from scaler_impl.scaler import DTensor, DeviceSplitGradScaler
from fsdp_amp_suite.harness import cached_group
from fsdp_amp_suite.planted.registry import mutant
from fsdp_amp_suite.planted.scalers.common import recorded, KnowsWhenStepping, unscale_args


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


@mutant("skips_collective_without_grads", caught_by=["test_rank_without_grads_takes_part"])
class SkipsCollectiveWithoutGrads(DeviceSplitGradScaler):
    """A rank with no grads records nothing and skips the all_reduce (pytorch#99174)."""

    def _agree(self, found):
        if not found:
            return 0.0
        return super()._agree(found)


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
            found = self._unscale_grads_(optimizer, *unscale_args(self))
            state["found_inf_per_device"] = recorded(DeviceSplitGradScaler._agree(self, found))
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


@mutant("explicit_unscale_agrees_over_world", caught_by=["test_every_sequence_of_calls_follows_the_contract"])
class ExplicitUnscaleAgreesOverWorld(KnowsWhenStepping, WorldGroup):
    """The clipping path's unscale_ agrees over WORLD (world_group's defect), not the given process_group; step()
    alone uses the group: under HSDP's shard groups one group's overflow skips the other group's step after a clip."""

    def _agree(self, found):
        return DeviceSplitGradScaler._agree(self, found) if self._stepping else super()._agree(found)


@mutant("trusts_dtensor_agreement", caught_by=["test_every_rank_of_the_mesh_takes_the_same_decision"])
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
        found, inv = torch.zeros(()), self._inv_scale()
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


# the inf on the last rank: ranks 0, 1 step
@mutant("agrees_along_one_mesh_dim", caught_by=["test_every_rank_of_the_mesh_takes_the_same_decision",
                                                "test_every_sequence_on_a_mesh_follows_the_contract"], matrix="mesh")
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


# the factories, by the names the specs use (`--scaler fsdp_amp_suite.planted.scalers.agreement:<name>`)
no_agreement = NoAgreement.factory
world_group = WorldGroup.factory
backoff_only_if_exactly_one = BackoffOnlyIfExactlyOne.factory
skips_collective_without_grads = SkipsCollectiveWithoutGrads.factory
agrees_only_in_step = AgreesOnlyInStep.factory
agrees_for_first_optimizer_only = AgreesForFirstOptimizerOnly.factory
explicit_unscale_agrees_over_world = ExplicitUnscaleAgreesOverWorld.factory
trusts_dtensor_agreement = TrustsDTensorAgreement.factory
agrees_along_one_mesh_dim = AgreesAlongOneMeshDim.factory
