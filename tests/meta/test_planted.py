"""The registry of planted defects (fsdp_amp_suite/planted): every planted defect has a job and a name of its own, and
that name is the factory the suite's own resolution finds (`--scaler fsdp_amp_suite.planted.scalers:<name>`,
`--fsdp fsdp_amp_suite.planted.wrappers:<name>`): a factory the module forgot to bind, or bound to another class, is
named.
"""
import pytest

from fsdp_amp_suite import scalers
from fsdp_amp_suite.matrix import implementations
from fsdp_amp_suite.planted.scalers.checking import MissesNaN
from fsdp_amp_suite.planted.registry import REGISTERED_SCALERS, REGISTERED_WRAPPERS, BrokenWrapper, Mutant, mutant


def problems(mutants, wrappers) -> list[str]:
    """What is wrong with these registrations: a repeated name, a mutant with no job, a name that does not
    resolve to its registered factory."""
    names = [m.name for m in mutants] + [w.name for w in wrappers]
    out = [f"{name!r}: registered {names.count(name)} times" for name in sorted(set(names)) if names.count(name) > 1]
    out += [f"mutant {m.name!r}: no job (an empty caught_by and no matrix role)"
            for m in mutants if not m.caught_by and m.matrix is None]
    for option, resolve, entries in (("--scaler", scalers.resolve, mutants),
                                     ("--fsdp", implementations.resolve, wrappers)):
        for entry in entries:
            try:
                factory = resolve(entry.spec)
            except ValueError as exc:
                out.append(f"{entry.name!r}: {exc}")
                continue
            if factory is not entry.factory:
                out.append(f"{entry.name!r}: {option} {entry.spec} resolves to {factory!r}, "
                           f"not the factory registered under that name")
    return out


def test_every_planted_defect_has_a_job_a_name_of_its_own_and_resolves():
    assert len(REGISTERED_SCALERS) > 40 and REGISTERED_WRAPPERS
    found = problems(REGISTERED_SCALERS, REGISTERED_WRAPPERS)
    assert not found, "planted defects the registry gets wrong:\n" + "\n".join(found)


def test_a_jobless_repeated_or_unbound_defect_is_named():
    nan, ok = MissesNaN, REGISTERED_SCALERS[0]
    mutants = [ok,
               Mutant("jobless", nan, nan.factory, caught_by=(), matrix=None),
               Mutant(ok.name, ok.cls, ok.factory, caught_by=("a_test",), matrix=None),  # ok, twice
               Mutant("misses_nan", nan, ok.factory, caught_by=("a_test",), matrix="small")]  # bound to another
    wrappers = [BrokenWrapper("never_bound", REGISTERED_WRAPPERS[0].factory)]
    found = "\n".join(problems(mutants, wrappers))
    assert f"{ok.name!r}: registered 2 times" in found, found
    assert "'jobless': no job" in found, found
    assert "'jobless': --scaler 'fsdp_amp_suite.planted.scalers.checking:jobless'" in found, found  # no such name in
                                                                                                    # the module
    assert "'misses_nan': --scaler fsdp_amp_suite.planted.scalers.checking:misses_nan resolves to" in found, found
    assert "'never_bound': --fsdp 'fsdp_amp_suite.planted.wrappers:never_bound'" in found, found
    assert len(found.splitlines()) == 5, found


def test_an_unknown_matrix_role_is_refused():
    with pytest.raises(ValueError, match="mutant 'x': matrix='medium' is none of"):
        mutant("x", caught_by=["a_test"], matrix="medium")
