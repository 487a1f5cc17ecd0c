"""Whether a check should pass, be a strict xfail or skip: one pure function, decided once.

`expectation(...)` takes plain data (the scaler spec, the test function, its params, the repro case's
declaration, the consumer's --xfails-file entry, the machine) and returns an `Expectation`. The root
conftest applies it to every collected item and the repro runner's script mode prints it
(fsdp_amp_suite/repro/runner.py), so a script and pytest cannot disagree. Nothing else adds skip or xfail marks
from the tables; tests/meta/test_expectations.py tests the policy as a table.

The policy, in order:
1. A cell this machine cannot run (fsdp_amp_suite/matrix/axes.py skip_reason), or a repro case whose hardware is
   missing: skip.
2. A built-in scaler's check made timing-dependent by a race (KNOWN_BUGS async-copy-race-busy-gpu) runs race-free
   (`race_free`: the harness makes its copies blocking, fsdp_amp_suite/harness/copies.py) and is judged by rules 3-6,
   unless the known bug there shows whatever the race does (`beats_race`): that check runs as it stands.
3. A known bug in force on these versions: strict xfail with the bug's reason.
4. The consumer's --xfails-file entry: strict xfail.
5. A standalone repro's run (tests/repro/test_standalone.py, params `standalone` and `mode`): skip where the
   file's `needs` are missing; where an entry it shows is in force, its plain and real-training runs are a
   strict xfail with that entry's reason, which only `BugShown` satisfies (a crash of the file fails);
   its --with-fix run must pass.
6. Otherwise the check must pass.
Whatever the outcome, `bug_any_version` names the check's known bug on any version (where it runs), so
the version table tells "fixed here" from "never hit".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from fsdp_amp_suite import versions
from fsdp_amp_suite.known_bugs import bug_by_id, known_bug, race_reason, repro_bug, standalone_files
from fsdp_amp_suite.matrix import axes

NEEDS = {
    "cuda": lambda m: None if m.cuda else "needs CUDA (one GPU): this bug lives in the CUDA code path; torch sees "
                                          "no GPU here",
    "no-cuda": lambda m: "shows only on a machine without CUDA (torch sees a GPU here)" if m.cuda else None,
    "dtensor": lambda m: (versions.DTENSOR_REASON if versions.holds(torch=versions.DTENSOR_TORCH, on=m.versions)
                          else None),
    # where torch-sharded-cpu-unscale-found-inf-shape holds, a fused step raises on it before anything else shows
    "torch>=2.6": lambda m: ("needs torch >= 2.6: before it a fused step raises first on found_inf's shape [1] "
                             "(torch-sharded-cpu-unscale-found-inf-shape)"
                             if bug_by_id("torch-sharded-cpu-unscale-found-inf-shape").holds_on(m.versions) else None),
}


@dataclass(frozen=True)
class Machine:
    cuda: bool
    n_gpus: int
    versions: Mapping  # {package: Version or None}: fsdp_amp_suite/versions.py here()

    @classmethod
    def here(cls) -> Machine:
        import torch

        cuda = torch.cuda.is_available()
        return cls(cuda, torch.cuda.device_count() if cuda else 0, versions.here())


@dataclass(frozen=True)
class ReproOf:
    """A repro case's declaration (fsdp_amp_suite/repro/runner.py @case): the KNOWN_BUGS ids it shows, the placement
    it races at (if any), the hardware it needs (a NEEDS key, if any)."""
    bugs: tuple = ()
    placement: str | None = None
    needs: str | None = None


@dataclass(frozen=True)
class Expectation:
    skip: str | None = None             # why the check does not run here
    xfail: str | None = None            # the reason of a strict xfail
    bug: str | None = None              # the KNOWN_BUGS id behind xfail
    xfails_file: str | None = None      # the --xfails-file entry behind xfail
    bug_any_version: str | None = None  # the check's known bug on any version (the version table)
    raises: type | None = None          # the one exception that counts as the xfail (None: any)
    race_free: str | None = None        # why the check runs with its copies made blocking (rule 2): the race


class BugShown(AssertionError):
    """A standalone repro exited 1 after printing its observed and expected lines: its bug is there."""


def expectation(scaler: str | None, test: str, params: dict, *, machine: Machine, repro_of: ReproOf | None = None,
                their_entry=None, bugs=None) -> Expectation:
    """The expectation of one check. scaler: its --scaler spec (None: not a scaler check); test: the test
    function's name; params: its callspec params (a matrix cell under "cell"); their_entry: the matching
    --xfails-file entry (fsdp_amp_suite/xfails.py) or None; bugs: a KNOWN_BUGS of one's own (the meta-tests').
    ValueError where repro_of names no known bug."""
    if "standalone" in params:
        return _standalone(params["standalone"], params["mode"], machine, bugs)
    cell = params.get("cell")
    unrunnable = (cell is not None and axes.skip_reason(cell, machine.n_gpus)) or (
        repro_of and repro_of.needs and NEEDS[repro_of.needs](machine))
    if unrunnable:
        return Expectation(skip=unrunnable)
    their_xfail = Expectation(xfail=f"{their_entry.reason} (--xfails-file line {their_entry.line})",
                         xfails_file=their_entry.check) if their_entry else Expectation()
    if scaler is None:
        return their_xfail

    def bug_of_check(any_version):
        return known_bug(scaler, test, params, machine.cuda, any_version=any_version, bugs=bugs, on=machine.versions)

    in_force, any_version = bug_of_check(False), bug_of_check(True)
    race = race_reason(scaler, test, params, machine.cuda)
    if repro_of and not any_version:  # a repro case: the bug it shows; the placement it races at, if any
        in_force = repro_bug(scaler, repro_of.bugs, bugs=bugs, on=machine.versions)
        any_version = repro_bug(scaler, repro_of.bugs, any_version=True, bugs=bugs)
        race = repro_of.placement and race_reason(scaler, test, {"placement": repro_of.placement}, machine.cuda)
        # the case shows its bug whatever the race (its author checked it on the GPU)
        shows_in_force = any_version is not None
    else:
        shows_in_force = bool(in_force and in_force.beats_race)
    named = any_version.id if any_version else None
    race_free = race if race and not shows_in_force else None
    if in_force:
        return Expectation(xfail=in_force.reason, bug=in_force.id, bug_any_version=named, race_free=race_free)
    return dataclasses.replace(their_xfail, bug_any_version=named, race_free=race_free)


WITH_FIX = "with-fix"  # the standalone mode that applies the proposed fix: it must pass wherever it runs


def _standalone(stem: str, mode: str, machine: Machine, bugs=None) -> Expectation:
    shown = standalone_files(bugs).get(stem)
    if shown is None:
        raise ValueError(f"standalone repro {stem!r}: no KNOWN_BUGS entry names that file")
    needs = shown[0].needs
    unrunnable = needs and NEEDS[needs](machine)
    if unrunnable:
        return Expectation(skip=unrunnable)
    in_force = next((b for b in shown if b.holds_on(machine.versions)), None)
    named = shown[0].id
    if in_force and mode != WITH_FIX:
        return Expectation(xfail=in_force.reason, bug=in_force.id, bug_any_version=named, raises=BugShown)
    return Expectation(bug_any_version=named)
