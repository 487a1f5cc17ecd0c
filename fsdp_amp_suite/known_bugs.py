"""The known upstream bugs of the built-in scalers and FSDP implementations, and what they decide.

Each KNOWN_BUGS entry turns the matching built-in checks into xfail(strict=True), so the suite reports
the day upstream fixes them; a plugged --scaler package.module:factory gets only the FSDP implementations'
entries. fsdp_amp_suite/expectations.py applies the table to every check; docs/bugs.md writes each bug up.

An entry names the checks it hits as data: `checks`, each a `Check` of test function names (or fnmatch patterns)
and conditions on the check's params, in one dialect (`Check.matches`). The table imports no suite: a matrix
cell answers for itself (fsdp_amp_suite/matrix/axes.py Cell.check_param), and placements come from
fsdp_amp_suite/placements.py.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet

from fsdp_amp_suite import versions
from fsdp_amp_suite.placements import (CPU_GRADS, CPU_GRADS_CUDA_SCALE, GRADS_OFF_SCALE_DEVICE, ONLY_CPU_GRADS,
                                       SCALE_ON_CPU)
from fsdp_amp_suite.scalers import BUILTINS


class Every:
    """'Every X' in a table cell, named, so that a reader never guesses what a None means: contains anything
    but the given exceptions."""

    def __init__(self, what: str, but=frozenset()):
        self.what, self.but = what, frozenset(but)

    def __contains__(self, item) -> bool:
        return item not in self.but

    def __repr__(self) -> str:
        return self.what


EVERY_SCALER = Every("every scaler, plugged ones included (a bug of the FSDP implementation)")
EVERY_OTHER_BUG = Every("every other entry")


class Pred:
    """A condition on one param's value that is not a plain value or set of values, named for the reader."""

    def __init__(self, what: str, holds):
        self.what, self.holds = what, holds

    def __call__(self, value) -> bool:
        return bool(self.holds(value))

    def __repr__(self) -> str:
        return self.what


def allows(allowed, value) -> bool:
    """The one dialect of a condition: a Pred, a tuple/list/set of values, or one value. A tuple-valued param
    (bad_ranks, bad_opts) is therefore given as a list of tuples."""
    if isinstance(allowed, Pred):
        return allowed(value)
    return value in allowed if isinstance(allowed, (tuple, list, set, frozenset)) else value == allowed


def at_least(n) -> Pred:
    return Pred(f">= {n}", lambda v: v is not None and v >= n)


def other_than(*values) -> Pred:
    return Pred(f"not {' or '.join(map(repr, values))}", lambda v: v not in values)


def holding(item) -> Pred:
    return Pred(f"holding {item!r}", lambda v: item in (v or ()))


def lacking(item) -> Pred:
    return Pred(f"lacking {item!r}", lambda v: item not in (v or ()))


def first_in(values) -> Pred:
    return Pred(f"first in {values!r}", lambda v: bool(v) and v[0] in values)


def all_of(*conditions) -> Pred:
    return Pred(" and ".join(map(repr, conditions)), lambda v: all(allows(c, v) for c in conditions))


SET = Pred("set (not None, False or empty)", bool)
UNSET = Pred("unset (None, False or empty)", lambda v: not v)

# fused optimizers whose state has a shape-[] step counter
STEP_COUNTER_FUSED = ("Adam", "AdamW", "Adagrad")
# fused optimizers by the torch versions on which torch's scalers hand them found_inf (GradScaler's fused path):
# fused Adagrad joined it in torch 2.12; on 2.11 the scalers treat it as any other optimizer (seen on the GPU
# machine: its checks pass there for torch_sharded and fairscale_sharded; on CPU, 2.12.0 and 2.13.0 fail them)
SCALER_FUSED_PATH_TORCH = {"Adam": "", "AdamW": "", "SGD": "", "Adagrad": ">=2.12"}
ON_FUSED_PATH = Pred("an optimizer that takes GradScaler's fused path on the installed torch",
                     lambda fused: fused is not None and versions.holds(torch=SCALER_FUSED_PATH_TORCH[fused]))


def check_param(params: dict, name: str, cuda: bool):
    """What a condition on `name` reads: "cuda", whether the machine has CUDA; else the test's callspec param
    (None where it has none); for a matrix cell, what the cell answers (Cell.check_param: an axis, its
    placement or its grads' dtype)."""
    if name == "cuda":
        return cuda
    if name in params or "cell" not in params:
        return params.get(name)
    return params["cell"].check_param(name, cuda)


class Check:
    """The checks of some test functions that a bug hits: those named by `tests` (names or fnmatch patterns),
    less those in `but`, whose params meet every condition of `where` (param -> allowed, in `allows`' dialect)."""

    def __init__(self, tests, but=(), **where):
        self.tests = (tests,) if isinstance(tests, str) else tuple(tests)
        self.but, self.where = frozenset(but), where

    def names(self, test_name: str) -> bool:
        return test_name not in self.but and any(fnmatch.fnmatchcase(test_name, t) for t in self.tests)

    def matches(self, test_name: str, params: dict, cuda: bool) -> bool:
        return self.names(test_name) and all(allows(allowed, check_param(params, name, cuda))
                                             for name, allowed in self.where.items())

    def __repr__(self) -> str:
        said = ", ".join(self.tests) + (f" but {', '.join(sorted(self.but))}" if self.but else "")
        return said + "".join(f"; {name}: {allowed!r}" for name, allowed in self.where.items())


NEEDED = "overflow needed"  # a step whose scaled grads overflow, through the real reductions (fp16 has them)
NOT_NEEDED = "no overflow needed"  # clean steps of the setup (or the call) hit it
INJECTION_ONLY = "injection only"  # only a value written into a grad after backward or a reduction gets there


@dataclass(frozen=True)
class Reach:
    """Whether real training reaches a bug, in two fields that do not overstate. `overflow`: NEEDED, NOT_NEEDED
    or INJECTION_ONLY. `setups`: the setups that reach it and how common they are (a timing-dependent bug says
    so; for INJECTION_ONLY, why training does not get there and what a job would have to do to). `run`: the
    standalone file's flag that shows it in real training ("" if none)."""
    overflow: str
    setups: str
    run: str = ""


@dataclass(frozen=True)
class KnownBug:
    id: str  # short and stable: the report and the version table name the bug by it
    scalers: frozenset | Every  # built-in scaler names, or EVERY_SCALER
    checks: tuple  # the Checks it hits: a check is claimed where any of them matches
    reason: str  # user-facing (the report's xfail reason): a self-contained sentence or two
    title: str  # a one-line summary: the README's bug table (python -m fsdp_amp_suite.bugtable) and docs/bugs.md
    beats_race: bool = False  # deterministic even where the built-in's results are timing-dependent
    torch: str = ""  # PEP 440 specifiers of the versions the bug holds on ("": every supported one);
    fairscale: str = ""  # on a version outside them the check is expected to pass (fixed there)
    reach: Reach | None = None  # can real training hit it? (every entry has one: tests/meta/test_standalone_files.py)
    standalone: str = ""  # its standalone repro, fsdp_amp_suite/repro/standalone/<standalone>.py ("": its id's)
    needs: str = ""  # what that file needs to run (a fsdp_amp_suite/expectations.py NEEDS key), on the file's own entry
    by_design: bool = False  # torch's behaviour by design: no fix to propose, no upstream report
    comment_on: str = ""  # an open upstream thread it adds evidence to: its draft, docs/upstream/comments/<this>.md,
                          # stands in place of a new report
    precedes: frozenset | Every = frozenset()  # ids of the entries it wins over where both claim a check: the
                                               # one a check shows first (test_tables.py: every overlap declared)

    def wins_over(self, other: "KnownBug") -> bool:
        return other.id != self.id and other.id in self.precedes

    @property
    def standalone_file(self) -> str:
        """The stem of its standalone repro's file: several entries of one defect share one."""
        return self.standalone or self.id

    @property
    def in_force(self) -> bool:
        """Does the bug hold on the installed torch and fairscale?"""
        return self.holds_on(None)

    def holds_on(self, on) -> bool:
        """Does the bug hold on these versions ({package: Version}, versions.here(); None: the installed ones)?"""
        return versions.holds(torch=self.torch, fairscale=self.fairscale, on=on)

    def hits(self, spec: str) -> bool:
        """Does this entry name this scaler? A plugged one only for an FSDP implementation's bug."""
        return self.scalers is EVERY_SCALER or (spec in BUILTINS and spec in self.scalers)

    def matches(self, test_name: str, params: dict, cuda: bool) -> bool:
        """Does this entry name this check (test and params), whatever the scaler and versions?"""
        return any(check.matches(test_name, params, cuda) for check in self.checks)


# Where a bug holds, as version specifiers (fsdp_amp_suite/versions.py). Upstream bugs still open are claimed for
# every supported torch (their code is unchanged from the first to the last of versions.CHECKED_TORCH); fairscale's
# own bugs for its last release, the one this suite pins and ran: a new release must be re-checked, not assumed.
ANY_TORCH = ""
FAIRSCALE_0_4_13 = "==0.4.13"


def _bug(bug_id, scalers, *, checks, reason, title, reach, beats_race=False, torch=ANY_TORCH, fairscale="",
         standalone="", needs="", by_design=False, comment_on="", precedes=()):
    return KnownBug(bug_id, scalers if isinstance(scalers, Every) else frozenset(scalers), tuple(checks), reason,
                    title, beats_race, str(SpecifierSet(torch)), str(SpecifierSet(fairscale)), reach, standalone,
                    needs, by_design, comment_on, precedes if isinstance(precedes, Every) else frozenset(precedes))


KNOWN_BUGS = [
    _bug("fairscale-disabled-without-cuda", {"fairscale_sharded"},
         checks=[Check("test_*", but=("test_disabled_scaler_is_a_pass_through",), cuda=False)],
         reason=("fairscale ShardedGradScaler silently disables itself without CUDA (amp_definitely_not_available) "
                 "and then steps on inf grads; it has no device argument"),
         title="silently disabled without CUDA, then steps on inf grads",
         reach=Reach(NOT_NEEDED, "Any job that builds fairscale's scaler on a machine without CUDA: it never scales, "
                                 "and an inf or NaN that the fp16 forward makes is applied. Uncommon: fp16 loss "
                                 "scaling is mostly a GPU practice, but CPU fp16 runs and CI without GPUs meet it"),
         fairscale=FAIRSCALE_0_4_13, needs="no-cuda",
         precedes=EVERY_OTHER_BUG),  # a disabled scaler shows nothing else
    _bug("torch-amp-refuses-fp16-grads", {"torch_amp"},
         checks=[Check(("test_clean_step_unscales_exactly_and_steps", "test_inf_or_nan_skips_step_and_backs_off",
                        "test_an_overflow_past_2_31_elements_is_seen", "test_fsdp_matches_ddp"),
                       dtype="float16")],
         reason=("torch.amp.GradScaler refuses fp16 grads by design (ValueError: Attempting to unscale FP16 "
                 "gradients.), which FSDP mixed precision without offload produces (fairscale; FSDP1 "
                 "keep_low_precision_grads)"),
         title="fp16 grads refused by design (\"Attempting to unscale FP16 gradients\")",
         reach=Reach(NOT_NEEDED, "A job whose grads reach the scaler in fp16: FSDP1 keep_low_precision_grads, "
                                 "fairscale mixed precision without offload at world size 1. Uncommon: the default "
                                 "FSDP mixed precision gives fp32 grads; by design, the error says what is wrong"),
         by_design=True,
         precedes={"fairscale-fsdp-mixed-precision-grads", "fsdp1-keeplow-offload-grad-dtype",
                   "torch-amp-not-shard-aware"}),  # the first unscale raises
    _bug("bf16-cuda-unscale-kernel", {"fairscale_sharded", "torch_amp", "torch_sharded"},
         checks=[Check(("test_clean_step_unscales_exactly_and_steps", "test_inf_or_nan_skips_step_and_backs_off",
                        "test_an_overflow_past_2_31_elements_is_seen", "test_fsdp_matches_ddp"),
                       dtype="bfloat16", placement=("cuda", "mixed"))],
         reason=("torch._amp_foreach_non_finite_check_and_unscale_ has no CUDA kernel for bf16 "
                 "(NotImplementedError ... not implemented for 'BFloat16'), so bf16 grads on CUDA crash the scaler "
                 "(fairscale FSDP with compute_dtype bf16 and no offload at world size 1; FSDP1 "
                 "keep_low_precision_grads)"),
         title="bf16 grads on CUDA crash the unscale kernel",
         reach=Reach(NOT_NEEDED, "A job that loss-scales bf16 grads on CUDA (FSDP1 keep_low_precision_grads in bf16; "
                                 "fairscale compute_dtype bf16 without offload). Uncommon: bf16 training rarely uses "
                                 "a scaler, but configurations that switch fp16 to bf16 keep it"),
         needs="cuda", comment_on="pytorch-127176",
         # precedes: the unscale raises before anything else can show
         precedes={"fairscale-fsdp-mixed-precision-grads", "fairscale-fused-optimizer-kwarg",
                   "torch-amp-not-shard-aware", "torch-sharded-fused-adamw-after-unscale"}),
    _bug("torch-amp-not-shard-aware", {"torch_amp"},
         checks=[Check(("test_inf_on_some_ranks_makes_every_rank_skip_and_back_off",
                        "test_ranks_keep_scale_in_lockstep", "test_each_optimizer_agrees_across_ranks",
                        "test_inf_on_some_ranks_over_nccl", "test_rank_without_grads_takes_part",
                        "test_unmatched_step_surfaces_as_a_hang_in_bounded_time",
                        "test_every_sequence_of_calls_follows_the_contract"),
                       bad_ranks=other_than((0, 1))),
                 Check("test_busy_gpu_cpu_grads_are_unscaled_and_checked", world_size=2, bad=True, placement="cuda"),
                 # FSDP2 hides it: DTensor's handler for _amp_foreach_non_finite_check_and_unscale_ all-reduces
                 # found_inf over the mesh
                 Check("test_fsdp_matches_ddp", world_size=at_least(2), impl=("fsdp1", "fairscale"))],
         reason=("torch.amp.GradScaler does not agree on found_inf across ranks (it relies on DDP's all-reduced "
                 "grads): with sharded grads (FSDP1, fairscale FSDP) an inf on one rank makes only that rank skip "
                 "and back off"),
         title="no agreement on found_inf across ranks: an inf on one rank skips only there",
         reach=Reach(NEEDED, "Torch.amp.GradScaler with sharded grads at 2 or more ranks: FSDP1 or fairscale FSDP "
                             "fp16, an overflow in one rank's shard only (shown: FSDP1 fp16 on 2 gloo ranks, the "
                             "overflow in one output unit's weight row). Common where FSDP users keep the DDP "
                             "scaler; by design, ShardedGradScaler exists for it", run="--real-overflow"),
         by_design=True,
         precedes={"fsdp1-keeplow-offload-grad-dtype"}),
    _bug("fairscale-cpu-scale-sequences", {"fairscale_sharded"},
         checks=[Check(("test_every_sequence_of_calls_follows_the_contract",
                        "test_every_sequence_on_a_mesh_follows_the_contract",
                        "test_every_call_matches_torch_amp_grad_scaler"), placement=SCALE_ON_CPU)],
         reason=("fairscale ShardedGradScaler with its scale on CPU breaks the contract in several ways that a "
                 "sequence reaches, whichever comes first: a CPU found_inf never agreed across ranks "
                 "(fairscale-cpu-found-inf-not-agreed), a backoff only if found_inf == 1.0 "
                 "(fairscale-backoff-only-if-exactly-one), state_dict() raising after a backoff "
                 "(fairscale-state-dict-after-backoff), growth to inf (sharded-cpu-scale-grows-to-inf)"),
         title="scale on CPU: call sequences reach several of its bugs, whichever comes first",
         reach=Reach(NEEDED, "As its parts (fairscale-cpu-found-inf-not-agreed shows a real overflow): fairscale's "
                             "scaler with its scale on CPU, which fairscale's own CPU-offload path (the loss moved "
                             "to the CPU params, fairscale #421) makes. Uncommon: that path only",
                             run="--real-overflow"),
         fairscale=FAIRSCALE_0_4_13, standalone="fairscale-cpu-found-inf-not-agreed",
         # precedes: fairscale with its scale on CPU has more than that bug for a sequence to reach
         precedes={"sharded-cpu-scale-grows-to-inf"}),
    _bug("amp-update-one-element-new-scale", {"fairscale_sharded", "torch_amp", "torch_sharded"},
         checks=[Check("test_update_with_new_scale", form="one_element")],
         reason=("GradScaler.update(new_scale=t) accepts a 1-element tensor (its own AssertionError asks for 'a "
                 "1-element torch.cuda.FloatTensor or torch.FloatTensor'), then copies it with "
                 "self._scale.copy_(new_scale) into the 0-dim scale: a tensor of shape [1] raises RuntimeError: "
                 "output with shape [] doesn't match the broadcast shape [1] (torch.amp.GradScaler, torch's and "
                 "fairscale's ShardedGradScaler alike)"),
         title="update(new_scale=torch.tensor([x])) raises: a shape-[1] tensor passes the check, then fails the "
               "copy",
         reach=Reach(NOT_NEEDED, "A call update(new_scale=t) with t of shape [1], e.g. torch.tensor([x]) restored "
                                 "from a log or a custom schedule. Rare: most callers pass a float")),
    _bug("torch-sharded-scale-keeps-loss-dtype", {"torch_sharded"},
         checks=[Check("test_every_call_matches_torch_amp_grad_scaler")],
         reason=("torch ShardedGradScaler.scale() casts the scaled output back to its dtype (on purpose, for FSDP "
                 "mixed precision): a 0-dim fp16 loss times a scale above 65504 / loss comes back inf, where "
                 "torch.amp.GradScaler returns the float32 product; the grads are the same, but a guard or a log "
                 "that reads the scaled loss sees an overflow that did not happen"),
         title="scale() casts a 0-dim fp16 loss back to fp16: the scaled loss is inf where torch's is finite",
         reach=Reach(NOT_NEEDED, "Scale() of a 0-dim fp16 loss above 65504 / scale, without autocast (FSDP fp16 "
                                 "mixed precision computes the loss in fp16: loss 2.0 at a scale of 2**15). The "
                                 "grads are right; only code that reads the scaled loss (a guard, a log) is misled. "
                                 "Uncommon"),
         by_design=True),
    _bug("sharded-default-group-bound-at-import", {"fairscale_sharded", "torch_sharded"},
         checks=[Check("test_a_scaler_pickles_between_iterations")],
         reason=("ShardedGradScaler keeps its process group on the instance and GradScaler.__getstate__ pickles "
                 "it: a scaler given process_group=dist.group.WORLD, or built with the default when its module was "
                 "imported after init_process_group (the default is evaluated at import), makes pickle.dumps / "
                 "copy.deepcopy / torch.save(scaler) raise TypeError: cannot pickle 'ProcessGroup' object, where "
                 "torch.amp.GradScaler pickles between iterations (torch and fairscale alike)"),
         title="does not pickle once it holds a process group (the default does, if imported after init)",
         reach=Reach(NOT_NEEDED, "Pickle, deepcopy or torch.save of the scaler object itself when it holds a process "
                                 "group (given one, or its module imported after init_process_group). Rare: "
                                 "checkpoints save scaler.state_dict(), which pickles; maintainers will say so")),
    _bug("sharded-cpu-scale-grows-to-inf", {"fairscale_sharded", "torch_sharded"},
         checks=[Check(("test_growth_never_overflows_to_inf", "test_every_sequence_of_calls_follows_the_contract",
                  "test_every_sequence_on_a_mesh_follows_the_contract"), placement=SCALE_ON_CPU)],
         reason=("ShardedGradScaler._amp_update_scale_cpu_ (scale on CPU) grows the scale without the isfinite "
                 "check of torch._amp_update_scale_: float32 max * growth_factor becomes inf, then every step "
                 "overflows and backs off from inf forever (torch and fairscale alike)"),
         title="scale on CPU grows to inf (no isfinite check), then every step is skipped",
         reach=Reach(NOT_NEEDED, "A scale on CPU (FSDP CPU offload with the loss on CPU) that keeps growing: in bf16 "
                                 "or fp32 compute the loss and grads stay finite at 2**127 (in fp16 the backward "
                                 "overflows first). Rare: with the defaults that takes 224,000 overflow-free steps; "
                                 "the file's real run starts from 2**124 with growth_interval 1",
                                 run="--real-overflow")),
    _bug("fairscale-cpu-found-inf-not-agreed", {"fairscale_sharded"},
         # the matrix and the sequences show it where they run race-free (a GPU machine: expectations rule 2); the
         # matrix's cells: CPU-offloaded grads of 2 or more ranks, an inf injected on one
         checks=[Check("test_inf_on_some_ranks_makes_every_rank_skip_and_back_off", placement=ONLY_CPU_GRADS,
                       bad_ranks=other_than((0, 1))),
                 Check("test_fsdp_matches_ddp", cuda=True, offload="offload", world_size=at_least(2)),
                 Check("test_every_sequence_of_calls_follows_the_contract", cuda=True, placement=CPU_GRADS_CUDA_SCALE),
                 Check("test_each_optimizer_agrees_across_ranks", placement=ONLY_CPU_GRADS),
                 Check("test_ranks_keep_scale_in_lockstep", placement=CPU_GRADS)],
         reason=("fairscale ShardedGradScaler all-reduces a CPU found_inf on a CUDA copy and throws the result "
                 "away (v_on_cuda.cpu()): with CPU grads an inf on one rank makes only that rank skip (each "
                 "optimizer on its own), and the ranks' scales diverge"),
         title="CPU found_inf all-reduced on a copy that is thrown away",
         reach=Reach(NEEDED, "Fairscale's scaler with CPU grads (FSDP CPU offload) at 2 or more ranks, an overflow "
                             "in one rank's shard only (shown: torch FSDP1 CPUOffload fp16 on 2 gloo ranks, the loss "
                             "moved to the CPU params as in fairscale #421). Common in fairscale CPU-offload "
                             "training, whose first steps overflow routinely", run="--real-overflow"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda"),
    _bug("fairscale-backoff-only-if-exactly-one", {"fairscale_sharded"},
         checks=[Check("test_two_optimizers_skip_independently_back_off_once", placement=SCALE_ON_CPU,
                       bad_opts=[(0, 1)]),
                 Check("test_inf_on_two_devices_backs_off_once", placement="mixed_cpu_scale")],
         reason=("fairscale _amp_update_scale_cpu_ (scale on CPU) backs off only if found_inf == 1.0; two "
                 "optimizers that both saw inf, or an inf on two devices, sum to 2.0 and the scale grows instead"),
         title="backs off only if found_inf == 1.0: two optimizers' (or devices') 2.0 grows the scale",
         reach=Reach(NEEDED, "Fairscale's scaler with its scale on CPU and two optimizers (or two grad devices) that "
                             "overflow in one step (shown: a CPU model on a CUDA machine, one optimizer per layer, "
                             "fp16 autocast at init_scale 2**16). Uncommon: the scale is on CPU only on fairscale's "
                             "CPU-offload path", run="--real-overflow"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda"),
    _bug("fairscale-rank-without-grads", {"fairscale_sharded"},
         checks=[Check("test_rank_without_grads_takes_part")],
         reason=("fairscale ShardedGradScaler records no found_inf on a rank without grads: that rank raises 'No "
                 "inf checks were recorded for this optimizer' while the others wait in all_reduce (fixed in torch "
                 "by pytorch#99174, never in fairscale)"),
         title="a rank without grads raises while the others wait",
         reach=Reach(NOT_NEEDED, "A step on which one rank's optimizer holds no grad: frozen params sharded so that "
                                 "one rank holds only frozen ones (pytorch#99174), an unused branch. Uncommon: "
                                 "fine-tuning with frozen layers is where it shows"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda"),
    _bug("fairscale-state-dict-after-backoff", {"fairscale_sharded"},
         # the matrix's: fairscale FSDP with CPU offload and the loss moved to the CPU params (as in fairscale
         # issue #421) keeps the scale on CPU, and the checkpoint after step 8 raises
         checks=[Check(("test_state_dict_round_trip_resumes_identically",
                        "test_a_checkpoint_crosses_between_scalers_and_resumes_identically",
                        "test_a_checkpoint_saved_by_another_torch_loads_and_resumes",
                        "test_private_scale_state_follows_the_scale"),
                       placement=SCALE_ON_CPU),
                 Check("test_fsdp_matches_ddp", impl="fairscale", placement=SCALE_ON_CPU, world_size=1)],
         reason=("fairscale sets _growth_tracker to a Python int on backoff when the scale is on CPU; state_dict() "
                 "(and _get_growth_tracker()) then raises AttributeError: 'int' object has no attribute 'item' "
                 "(fairscale FSDP CPU-offload training with the loss on the CPU params too)"),
         title="state_dict() raises after a backoff, scale on CPU",
         reach=Reach(NEEDED, "Fairscale's scaler with its scale on CPU, after its first backoff (shown: a CPU model "
                             "on a CUDA machine, fp16 autocast at the default init_scale; and fairscale FSDP CPU "
                             "offload with the loss on the CPU params). Common on that path: the first checkpoint "
                             "after the first overflow raises", run="--real-overflow"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda",
         precedes={"fairscale-fsdp-mixed-precision-grads"}),
    _bug("fairscale-update-new-scale-cpu-tensor", {"fairscale_sharded"},
         checks=[Check("test_update_with_new_scale", placement="cpu", form=("tensor", "one_element"))],
         reason=("fairscale ShardedGradScaler.update(new_scale=tensor) asserts a torch.cuda.FloatTensor, so a CPU "
                 "tensor for a scale that lives on CPU is refused"),
         title="update(new_scale=CPU tensor) refused",
         reach=Reach(NOT_NEEDED, "A call update(new_scale=<a CPU tensor>) on a scaler whose scale lives on CPU. "
                                 "Rare: most callers pass a float"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda",
         precedes={"amp-update-one-element-new-scale"}),  # its assertion refuses the tensor before the copy
    _bug("torch-sharded-collective-per-device", {"torch_sharded"},
         checks=[Check("test_rank_without_grads_takes_part", placement="mixed")],
         reason=("torch ShardedGradScaler issues one all_reduce per device holding grads: a rank with grads on CPU "
                 "and CUDA makes two collectives, a rank without grads one, and the group hangs"),
         title="one collective per grad device: CPU+CUDA grads vs a rank without grads hang",
         reach=Reach(NOT_NEEDED, "A step on which the ranks' sets of grad devices differ: one rank with grads on CPU "
                                 "and CUDA (partial offload), another with none. Rare: partial offload with a rank "
                                 "that has no grads that step"),
         beats_race=True, needs="cuda"),
    _bug("async-copy-race-busy-gpu", {"torch_amp", "torch_sharded"},
         checks=[Check("test_busy_gpu_cpu_grads_are_unscaled_and_checked", placement=CPU_GRADS_CUDA_SCALE)],
         reason=("torch.amp.GradScaler and torch's ShardedGradScaler copy inv_scale/found_inf to CPU with "
                 "non_blocking=True and use the copies before they land while the GPU is busy: CPU grads are "
                 "zeroed or an inf is missed. Bites real loops that queue GPU work between backward and "
                 "unscale_/step"),
         title="non_blocking CPU copies of inv_scale/found_inf read before they land (busy GPU)",
         reach=Reach(NOT_NEEDED, "A CPU-offload loop with the scale on CUDA that queues GPU work between backward "
                                 "and unscale_/step. Timing-dependent: a real FSDP1 CPUOffload fp16 loop with one "
                                 "queued matmul lost 3 to 7 of 20 clean steps; with an idle GPU the copy usually "
                                 "lands first"),
         needs="cuda", comment_on="pytorch-pr-176429"),
    # ---- meshes (test_meshes.py, and the sequences on a mesh)
    _bug("torch-amp-mesh-sequences", {"torch_amp"},
         checks=[Check("test_every_sequence_on_a_mesh_follows_the_contract")],
         reason=("torch.amp.GradScaler with DTensor grads on a mesh breaks the contract in two ways that a "
                 "sequence reaches, whichever comes first: fp16 grads refused by design "
                 "(torch-amp-refuses-fp16-grads), found_inf reduced along the first grad's sharded mesh dims only, "
                 "so part of the mesh skips while the rest steps (dtensor-found-inf-first-grad-placements)"),
         title="DTensor grads on a mesh: call sequences reach fp16 refusal or a part-mesh skip, whichever comes "
               "first",
         reach=Reach(NEEDED, "As its parts: dtensor-found-inf-first-grad-placements shows a real overflow; "
                             "torch-amp-refuses-fp16-grads needs none. Uncommon: torch.amp.GradScaler with DTensor "
                             "grads on a 2-D mesh", run="--real-overflow"),
         standalone="dtensor-found-inf-first-grad-placements"),
    _bug("dtensor-mixed-with-tensor-grads", {"torch_amp", "torch_sharded"},
         checks=[Check("test_every_rank_of_the_mesh_takes_the_same_decision", order=holding("plain"))],
         reason=("an optimizer holding DTensor params and plain tensor params on the same device and dtype (a "
                 "model only partly under FSDP2 or tensor parallelism) crashes torch's scalers: they unscale the "
                 "grads of one device and dtype in one torch._amp_foreach_non_finite_check_and_unscale_ call, "
                 "which DTensor dispatch refuses: RuntimeError: ... got mixed torch.Tensor and DTensor, need to "
                 "convert all torch.Tensor to DTensor"),
         title="DTensor and plain tensor grads in one optimizer: the unscale kernel call raises",
         reach=Reach(NOT_NEEDED, "A model only partly under fully_shard or tensor parallelism, its plain and DTensor "
                                 "params in one optimizer (the file's run: fully_shard on the body only). Uncommon, "
                                 "and arguably unsupported: wrapping scaler.step in implicit_replication() avoids it"),
         needs="dtensor"),
    _bug("dtensor-found-inf-first-grad-placements", {"torch_amp"},
         checks=[Check("test_every_rank_of_the_mesh_takes_the_same_decision", bad=other_than(None),
               order=all_of(lacking("plain"), first_in(("replicated", "expert"))))],
         reason=("torch.amp.GradScaler relies on DTensor to agree on found_inf, and DTensor's handler for "
                 "torch._amp_foreach_non_finite_check_and_unscale_ (found_inf_reduce_handler) reduces found_inf "
                 "only along the mesh dims where the FIRST grad of the list is sharded, over that grad's mesh: "
                 "with a TP-replicated param (a norm or bias: the no-decay group put first) or an expert's param "
                 "on a sub-mesh first in the optimizer, an inf anywhere else is seen by part of the mesh only, "
                 "which skips while the rest steps"),
         title="DTensor grads: found_inf reduced along the first grad's sharded mesh dims only",
         reach=Reach(NEEDED, "FSDP2 over dp on top of tensor parallelism, torch.amp.GradScaler, a TP-replicated "
                             "param (a norm or bias) first in the optimizer, an overflow in one tp rank's shard only "
                             "(shown: fp16, the overflow in one tp rank's colwise rows). Uncommon: 2-D parallelism "
                             "with a no-decay group put first", run="--real-overflow"),
         needs="dtensor"),
    # the same handler under FSDP2 HSDP: a verdict of its own, since only an injection gets there
    _bug("dtensor-found-inf-hsdp-one-replica", {"torch_amp"},
         checks=[Check("test_fsdp_matches_ddp", impl="fsdp2", mesh="hsdp", overflow="injected")],
         reason=("torch.amp.GradScaler under FSDP2 HSDP: DTensor's found_inf handler reduces along the first "
                 "grad's sharded mesh dims only (dtensor-found-inf-first-grad-placements), and every FSDP2 grad on "
                 "a (replicate, shard) mesh is replicated along the replicate dim, so an inf written into one "
                 "replica's grads after the reduction makes that replica alone skip and back off. An overflow that "
                 "training makes does not get there: FSDP2 all-reduces grads across replicas, so every replica "
                 "sees it"),
         title="FSDP2 HSDP: an inf in one replica's reduced grads skips that replica only (injection only)",
         reach=Reach(INJECTION_ONLY, "FSDP2 all-reduces grads across the replicate dim after the reduce-scatter, so "
                                     "an overflow born in one replica reaches every replica and every rank skips (a "
                                     "real run confirms it). A job gets here only if its grads differ across "
                                     "replicas after the reduction: a hook that writes grads after it, "
                                     "set_requires_all_reduce(False), a fault in one replica"),
         standalone="dtensor-found-inf-first-grad-placements"),
    _bug("fairscale-cpu-found-inf-not-agreed-dtensor", {"fairscale_sharded"},
         # placement None: the check has no placement param, its mesh is on CPU
         checks=[Check(("test_every_rank_of_the_mesh_takes_the_same_decision",
                        "test_fsdp2_dtensor_grads_agree_across_ranks"), cuda=True, bad=SET, placement=(None, "cpu"))],
         reason=("fairscale ShardedGradScaler predates DTensor: with DTensor grads on CPU (FSDP2 or tensor "
                 "parallelism on a CPU mesh) it checks each rank's local shard in a Python loop and all-reduces "
                 "the CPU found_inf on a CUDA copy whose result it throws away "
                 "(fairscale-cpu-found-inf-not-agreed), so only the rank whose shard holds the inf or NaN skips "
                 "and backs off, whatever the mesh dim, the placement or the param order (seen on torch 2.11, one "
                 "GPU)"),
         title="DTensor grads on CPU: found_inf never agreed; only the rank whose shard overflowed skips",
         reach=Reach(NEEDED, "Fairscale's scaler with DTensor grads on CPU (FSDP2 on a CPU mesh) on a CUDA machine, "
                             "an overflow in one rank's shard only (shown: FSDP2 on a 1D CPU mesh of 2 ranks, fp16 "
                             "autocast). Rare, and unsupported: fairscale predates DTensor", run="--real-overflow"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda"),
    _bug("fairscale-dtensor-mixed-with-tensor-grads", {"fairscale_sharded"},
         checks=[Check("test_every_rank_of_the_mesh_takes_the_same_decision", placement="cuda",
                       order=holding("plain"))],
         reason=("fairscale ShardedGradScaler unscales CUDA grads as torch's scalers do, one "
                 "torch._amp_foreach_non_finite_check_and_unscale_ call per device and dtype "
                 "(dtensor-mixed-with-tensor-grads): one optimizer holding DTensor and plain tensor params on CUDA "
                 "raises RuntimeError: ... got mixed torch.Tensor and DTensor (its CPU grads go through a "
                 "per-tensor Python loop, which does not; seen on torch 2.11, one GPU)"),
         title="DTensor and plain tensor grads on CUDA in one optimizer: the unscale kernel call raises",
         reach=Reach(NOT_NEEDED, "Fairscale's scaler with a model only partly under fully_shard on CUDA, its plain "
                                 "and DTensor params in one optimizer. Rare, and unsupported: fairscale predates "
                                 "DTensor"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda"),
    # ---- the FSDP-vs-DDP matrix (tests/matrix)
    _bug("torch-sharded-fused-adamw-after-unscale", {"torch_sharded"},
         checks=[Check("test_an_overflow_skips_a_fused_optimizer_exactly",
                       fused=all_of(ON_FUSED_PATH, STEP_COUNTER_FUSED), explicit_unscale=True),
                 Check("test_fsdp_matches_ddp", optimizer="adamw", clip="clip")],
         reason=("torch ShardedGradScaler + a fused optimizer with a step counter (Adam, AdamW, Adagrad "
                 "fused=True) after an explicit unscale_ (the clipping path): its found_inf has shape [1] and the "
                 "fused kernel's _foreach_sub_ into the shape-[] step counter raises RuntimeError: output with "
                 "shape [] doesn't match the broadcast shape [1]"),
         title="fused AdamW after unscale_ (clipping): found_inf of shape [1] crashes the step",
         reach=Reach(NOT_NEEDED, "ShardedGradScaler with fused Adam, AdamW or Adagrad and an explicit unscale_ "
                                 "(gradient clipping): every step raises, the first, clean one included. Common: "
                                 "clipping with fused AdamW under FSDP"),
         comment_on="pytorch-140514",
         precedes={"amp-hands-fused-a-device-sum", "fairscale-fsdp-mixed-precision-grads",
                   "torch-sharded-cpu-unscale-found-inf-shape"}),  # the first step raises
    _bug("torch-sharded-hands-fused-a-sum", {"torch_sharded"},
         checks=[Check("test_an_overflow_skips_a_fused_optimizer_exactly", fused="SGD", explicit_unscale=True)],
         reason=("torch ShardedGradScaler.unscale_ all-reduces found_inf with SUM over the ranks and step() hands "
                 "that sum to a fused optimizer; the fused kernels skip only on found_inf == 1.0, so when two "
                 "ranks overflow the optimizer gets 2.0 and applies the inf/NaN update (fused SGD after an "
                 "explicit unscale_; Adam, AdamW and Adagrad crash before, on the sum's shape: "
                 "torch-sharded-fused-adamw-after-unscale)"),
         title="explicit unscale_: found_inf summed over ranks (2.0) makes a fused optimizer step on NaN",
         reach=Reach(NEEDED, "ShardedGradScaler with fused SGD and an explicit unscale_, an overflow on 2 or more "
                             "ranks in one step (shown: FSDP1 fp16 on 2 gloo ranks at the default scale). Uncommon: "
                             "fused SGD with clipping", run="--real-overflow"),
         precedes={"fused-sgd-skipped-first-step"}),  # the check sees the sum first
    _bug("amp-hands-fused-a-device-sum", {"torch_amp", "torch_sharded"},
         checks=[Check("test_an_overflow_skips_a_fused_optimizer_exactly",
                       fused=all_of(ON_FUSED_PATH, STEP_COUNTER_FUSED), placement=("mixed", "mixed_cpu_scale"))],
         reason=("GradScaler.step hands an optimizer that takes its fused path (fused Adam, AdamW; Adagrad from "
                 "torch 2.12) found_inf = the sum of found_inf_per_device; the fused kernels skip only on "
                 "found_inf == 1.0, so when the grads on two devices (CPU and CUDA) both overflow, the optimizer "
                 "gets 2.0 and applies the inf/NaN update (found by the race-free runs of the mixed placement, "
                 "torch 2.11 on one GPU; torch ShardedGradScaler inherits the step)"),
         title="grads on two devices that both overflow: found_inf summed to 2.0, a fused optimizer steps on NaN",
         reach=Reach(INJECTION_ONLY, "Shown with an inf written into a grad on each device; real training gets there "
                                     "only where one optimizer holds grads on CPU and on CUDA (some params "
                                     "offloaded, some not) and both overflow in one step, which no run here has "
                                     "shown yet"),
         standalone="torch-sharded-hands-fused-a-sum"),
    _bug("fused-sgd-skipped-first-step", {"torch_amp", "torch_sharded"},
         checks=[Check("test_an_overflow_skips_a_fused_optimizer_exactly", fused="SGD")],
         reason=("fused SGD with momentum allocates its momentum buffers with torch.empty_like on its first step "
                 "and fills them inside the kernel; when GradScaler hands it found_inf = 1.0 (the first step "
                 "overflowed, as fp16 training's first steps routinely do) the kernel returns early and the "
                 "buffers keep uninitialised memory, which the next step applies to the params (NaN under "
                 "deterministic mode, garbage otherwise). torch.amp.GradScaler and torch's ShardedGradScaler leave "
                 "the skip to the kernel"),
         title="fused SGD: a skipped first step leaves the momentum buffer uninitialised; the next step applies it",
         reach=Reach(NEEDED, "Fused SGD with momentum whose first step overflows, as fp16 training at the default "
                             "init_scale 65536 does routinely: the next step applies uninitialised momentum (shown: "
                             "the first scaled backward overflows by itself, fused SGD ends all NaN). Common for "
                             "fused SGD in fp16", run="--real-overflow")),
    _bug("torch-sharded-cpu-unscale-found-inf-shape", {"torch_sharded"},
         checks=[Check("test_fsdp_matches_ddp", optimizer="adamw", clip="noclip",
                       placement=("cpu", "cpu_loss", "offload")),
                 Check("test_an_optimizer_that_handles_scaling_gets_torchs_protocol", value=float("inf"),
                       placement="cpu"),
                 Check("test_an_overflow_skips_a_fused_optimizer_exactly", fused=STEP_COUNTER_FUSED, placement="cpu")],
         reason=("torch < 2.6: ShardedGradScaler unscales CPU grads in Python "
                 "(_foreach_non_finite_check_and_unscale_cpu_), which on an inf replaces found_inf with "
                 "torch.tensor([1.0]), shape [1]; an optimizer that handles scaling is handed that shape-[1] "
                 "found_inf, and a fused one (AdamW fused=True; fused Adam and Adagrad alike: each keeps a "
                 "shape-[] step counter) raises at the first overflow: RuntimeError: output with shape [] doesn't "
                 "match the broadcast shape [1] (seen on 2.4.0 and 2.4.1; 2.5.1 has the same code, 2.6.0 unscales "
                 "CPU grads with torch._amp_foreach_non_finite_check_and_unscale_)"),
         title="CPU grads: an inf turns found_inf into shape [1], fused AdamW raises at the first overflow",
         reach=Reach(NEEDED, "Torch < 2.6 only: ShardedGradScaler with CPU grads and fused AdamW, at the first "
                             "overflow (shown: FSDP1 fp16 on CPU at the default scale, whose first backward "
                             "overflows by itself). Common on those versions for that setup", run="--real-overflow"),
         torch="<2.6",
         # precedes: on torch < 2.6 the first overflow raises
         precedes={"fairscale-fsdp-mixed-precision-grads", "torch-sharded-fused-adamw-no-agreement"}),
    _bug("torch-sharded-fused-adamw-no-agreement", {"torch_sharded"},
         checks=[Check("test_fsdp_matches_ddp", optimizer="adamw", clip="noclip", world_size=at_least(2),
                       impl=("fsdp1", "fairscale")),
                 Check("test_fsdp_matches_ddp", optimizer="adamw", clip="noclip", impl="fsdp2", mesh="hsdp")],
         reason=("torch ShardedGradScaler + a fused optimizer (AdamW fused=True): step() takes GradScaler's fused "
                 "path, which checks grads through _check_inf_per_device and never reaches the all_reduce in "
                 "ShardedGradScaler.unscale_, so under FSDP1 an inf in one rank's shard makes only that rank skip. "
                 "FSDP2 on one flat mesh hides it (DTensor's handler reduces found_inf over the mesh); under FSDP2 "
                 "HSDP that handler reduces along the shard dim only (dtensor-found-inf-first-grad-placements), so "
                 "one replica skips"),
         title="fused AdamW: found_inf never agreed across ranks",
         reach=Reach(NEEDED, "ShardedGradScaler with fused AdamW under FSDP1 at 2 or more ranks, an overflow in one "
                             "rank's shard only (shown: FSDP1 fp16 on 2 gloo ranks, the overflow in one output "
                             "unit's weight row); its FSDP2 HSDP cells are injection only "
                             "(dtensor-found-inf-hsdp-one-replica). Common: fused AdamW is the default choice for "
                             "speed", run="--real-overflow"),
         needs="torch>=2.6"),
    _bug("fairscale-fused-optimizer-kwarg", {"fairscale_sharded"},
         # the protocol check: an optimizer whose step() takes no grad_scaler gets it all the same
         checks=[Check("test_an_overflow_skips_a_fused_optimizer_exactly", fused=ON_FUSED_PATH),
                 Check("test_fsdp_matches_ddp", optimizer="adamw"),
                 Check("test_an_optimizer_that_handles_scaling_gets_torchs_protocol")],
         reason=("fairscale ShardedGradScaler.step passes grad_scaler=self to an optimizer that supports AMP "
                 "scaling (every fused one: Adam, AdamW, SGD, Adagrad), whose step() no longer takes it: "
                 "TypeError: Adam.step() got an unexpected keyword argument 'grad_scaler'"),
         title="fused AdamW: TypeError on the grad_scaler keyword",
         reach=Reach(NOT_NEEDED, "Fairscale's scaler with any fused optimizer: every step raises TypeError. "
                                 "Uncommon, and arguably unsupported: fairscale predates torch's fused optimizers"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda",
         precedes={"fairscale-cpu-found-inf-not-agreed", "fairscale-fsdp-mixed-precision-grads",
                   "fairscale-state-dict-after-backoff"}),  # the first step raises
    _bug("fairscale-fsdp-mixed-precision-grads", EVERY_SCALER,
         # foreach SGD over orig params, fused AdamW, and the natural cell (climb: nested, flat, SGD; seen on torch
         # 2.11, H100)
         checks=[Check("test_fsdp_matches_ddp", impl="fairscale", offload="nooffload", precision=("fp16", "bf16"),
                       world_size=1, **{axis: allowed})
                 for axis, allowed in [("params", "orig"), ("optimizer", "adamw"),
                                       ("overflow", other_than("injected"))]],
         reason=("fairscale FSDP bug: with mixed_precision and no offload at world size 1 the fp32 params get "
                 "fp16/bf16 grads; foreach SGD (flatten_parameters=False, or the nested model of the "
                 "natural-overflow cell) and fused AdamW reject them: 'Tensors of the same index must be on the "
                 "same device and the same dtype'"),
         title="fairscale FSDP mixed precision, world size 1: fp16/bf16 grads on fp32 params",
         reach=Reach(NOT_NEEDED, "Fairscale FSDP mixed precision without offload at world size 1, with "
                                 "flatten_parameters=False or fused AdamW: every step. Rare: single-rank fairscale "
                                 "FSDP"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda"),
    _bug("fsdp1-keeplow-offload-grad-dtype", EVERY_SCALER,
         # HYBRID_SHARD (an hsdp cell that reshards) trains through
         checks=[Check("test_fsdp_matches_ddp", impl="fsdp1", offload="offload", grads="keeplow", **{axis: allowed})
                 for axis, allowed in [("mesh", other_than("hsdp")), ("reshard", other_than("reshard"))]],
         reason=("torch FSDP1 bug: MixedPrecision(keep_low_precision_grads=True) + "
                 "CPUOffload(offload_params=True): prepare_gradient_for_optim casts the grad through .data, which "
                 "makes flat_param._cpu_grad itself fp16/bf16; it is cast back only while flat_param.grad is not "
                 "None, so after zero_grad(set_to_none=True) the next backward raises in `flat_param.grad = "
                 "flat_param._cpu_grad`: RuntimeError: attempting to assign a gradient with dtype 'c10::Half' to a "
                 "tensor with grad_dtype 'Float' (seen on torch 2.11, H200; the code is the same in 2.4.1 .. "
                 "2.15.0). HYBRID_SHARD trains through (an hsdp cell, torch 2.11, H100); _HYBRID_SHARD_ZERO2 "
                 "raises as FULL_SHARD and SHARD_GRAD_OP do"),
         title="FSDP1 keep_low_precision_grads + CPUOffload: the backward after zero_grad() raises",
         reach=Reach(NOT_NEEDED, "FSDP1 keep_low_precision_grads with CPUOffload, grads zeroed with set_to_none=True "
                                 "(the default): the second backward raises, with or without a scaler. Uncommon: "
                                 "keep_low_precision_grads is opt-in"),
         beats_race=True, needs="cuda",
         precedes={"fairscale-cpu-found-inf-not-agreed"}),  # the second backward raises
    _bug("fairscale-busy-gpu", {"fairscale_sharded"},
         # not an inf at world size 1, where there is no agreement to miss
         checks=[Check("test_busy_gpu_cpu_grads_are_unscaled_and_checked", placement=CPU_GRADS_CUDA_SCALE,
                       **{axis: allowed})
                 for axis, allowed in [("bad", UNSET), ("world_size", other_than(1))]],
         reason=("fairscale ShardedGradScaler reads inv_scale's non_blocking CPU copy before it lands, so CPU "
                 "grads are zeroed (the async-copy race of async-copy-race-busy-gpu), and on 2 ranks it never "
                 "agrees on a CPU found_inf (fairscale-cpu-found-inf-not-agreed)"),
         title="busy GPU: CPU grads zeroed by the async-copy race; on 2 ranks, no agreement either",
         reach=Reach(NOT_NEEDED, "Fairscale's scaler with the scale on CUDA and grads on CPU (FSDP CPU offload) in a "
                                 "loop that queues GPU work between backward and scaler.step. Timing-dependent: 19 "
                                 "of 20 clean trials zeroed the CPU grads with the GPU kept busy"),
         fairscale=FAIRSCALE_0_4_13, needs="cuda"),
    # ---- the GPU gate's shared-GPU ranks: no check claims it; the matrix skips those cells on one GPU
    # (matrix/implementations.py _fsdp2_needs) and runs them on CPU and with a GPU per rank
    _bug("dtensor-gloo-cuda-all-gather-segfault", EVERY_SCALER,
         checks=[],
         reason=("DTensor's functional all-gather (full_tensor, FSDP2's parameter all-gather, clip_grad_norm_ over "
                 "DTensor grads) over gloo ranks that share one GPU kills both ranks with SIGSEGV, no error raised"),
         title="DTensor all-gather over gloo ranks sharing a GPU: both ranks die with SIGSEGV",
         reach=Reach(NOT_NEEDED, "DTensor collectives on CUDA tensors over gloo ranks that share a GPU: FSDP2 "
                                 "without CPU offload, tensor parallelism. Rare in training, where ranks use NCCL "
                                 "and a GPU each; common in test harnesses and single-GPU CI that run a world of 2 "
                                 "on one GPU, as this suite's GPU gate does"),
         needs="cuda"),
]
assert len({bug.id for bug in KNOWN_BUGS}) == len(KNOWN_BUGS), "two KNOWN_BUGS entries share an id"


def bug_by_id(bug_id: str, bugs=None) -> KnownBug:
    """The entry with this id, looked up in KNOWN_BUGS (or the given table) at call time: no copy of the
    table to keep in step with it. ValueError naming the id when no entry has it."""
    found = next((bug for bug in (KNOWN_BUGS if bugs is None else bugs) if bug.id == bug_id), None)
    if found is None:
        raise ValueError(f"repro_of({bug_id!r}): no KNOWN_BUGS entry has that id")
    return found


# The async-copy race (KNOWN_BUGS async-copy-race-busy-gpu, docs/bugs.md) makes these built-ins' results
# timing-dependent wherever CPU grads meet a CUDA scale (or CUDA grads a CPU scale): even with an idle
# GPU they sometimes lose the race.
# Their outcome there, as they stand, can be neither passed nor strictly xfailed, so those checks run race-free:
# the harness makes every copy blocking (fsdp_amp_suite/harness/copies.py), and the race itself is checked
# deterministically, with the GPU kept busy, in test_busy_gpu.py.
RACY_SCALERS = {"torch_amp", "torch_sharded", "fairscale_sharded"}
RACY_PLACEMENTS = GRADS_OFF_SCALE_DEVICE
RACE_FREE_TESTS = {"test_busy_gpu_cpu_grads_are_unscaled_and_checked",
                   "test_scale_multiplies_tensors_and_keeps_structure", "test_disabled_scaler_is_a_pass_through"}


def race_reason(spec: str, test_name: str, params: dict, cuda: bool) -> str | None:
    """Why a built-in's check is timing-dependent on this machine as it stands (None: it is not)."""
    if not cuda:
        return None
    placement = check_param(params, "placement", cuda)
    if spec in RACY_SCALERS and placement in RACY_PLACEMENTS and test_name not in RACE_FREE_TESTS:
        return (f"{spec} on placement {placement!r} is timing-dependent (the async-copy race, known bug "
                f"async-copy-race-busy-gpu: non_blocking CPU copies of inv_scale/found_inf used before they "
                f"land)")
    return None


STANDALONE_DIR = "fsdp_amp_suite/repro/standalone"  # relative to the repository root


def standalone_files(bugs=None) -> dict:
    """{file stem: [the entries it shows, its own first]} over KNOWN_BUGS (or the given table)."""
    out: dict = {}
    for bug in KNOWN_BUGS if bugs is None else bugs:
        out.setdefault(bug.standalone_file, []).append(bug)
    return {stem: sorted(shown, key=lambda b: b.id != stem) for stem, shown in out.items()}


def repro_bug(spec: str, bug_ids, any_version: bool = False, bugs=None, on=None) -> KnownBug | None:
    """The known bug a repro case shows for this scaler: the first of its @pytest.mark.repro_of ids whose
    entry names this built-in scaler (or is an FSDP implementation's bug: every scaler), where in force.
    The entry's `tests` and `when` are the conformance/matrix checks' business: a repro case IS the bug."""
    for bug_id in bug_ids:
        bug = bug_by_id(bug_id, bugs)
        if bug.hits(spec) and (any_version or bug.holds_on(on)):
            return bug
    return None


def known_bug(spec: str, test_name: str, params: dict, cuda: bool, any_version: bool = False,
              bugs=None, on=None) -> KnownBug | None:
    """The known bug this test id hits: a built-in scaler's, or (any scaler) a built-in FSDP's.
    Only a bug in force on the installed versions (or on `on`, versions.here()'s form), unless any_version (the report's
    "fixed"
    column). Where several claim the check, the one no other `precedes` (first_by_precedence)."""
    return first_by_precedence([bug for bug in (KNOWN_BUGS if bugs is None else bugs)
                                if bug.hits(spec) and bug.matches(test_name, params, cuda)
                                and (any_version or bug.holds_on(on))])


def first_by_precedence(claiming: list) -> KnownBug | None:
    """Of the entries claiming one check, the one that no other wins over. test_tables.py checks that every pair
    that can claim a check together declares which wins; were one missing, the first in table order is taken."""
    winners = [bug for bug in claiming if not any(other.wins_over(bug) for other in claiming)]
    return (winners or claiming or [None])[0]
