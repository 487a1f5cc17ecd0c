"""The one shape of a repro case: a body that returns an `Outcome`, declared once with `@case`, run two ways.

    @case("A clean step with AdamW(fused=True) on CUDA (1 rank)", bugs=["fairscale-fused-optimizer-kwarg"],
          needs="cuda")
    def test_clean_step_with_fused_adamw(scaler):
        ...
        return Outcome(bug, happened, expected)

    python -m fsdp_amp_suite.repro NAME [--scaler SPEC ...]   prints, per scaler (the built-ins, or SPECs such as
                                                     your_pkg.mod:factory), what happened and what should
                                                     have; NAME: a file of tests/repro, with or without
                                                     its test_ prefix (no NAME: the list)
    pytest -m repro [--scaler SPEC ...]              the same body as a test per scaler, from the root
                                                     conftest's scaler parametrization like every check

`bugs` names the KNOWN_BUGS ids the case shows: for each scaler an entry names (every scaler for an FSDP
implementation's bug) the case is a strict xfail with the entry's reason; every other scaler, plugged ones
included, must not show the bug. `placement` names where the case races (KNOWN_BUGS
async-copy-race-busy-gpu): a scaler without a bug there skips as timing-dependent. `needs` names missing
hardware that makes it skip (expectations.NEEDS). Both modes take all of this from one function,
fsdp_amp_suite/expectations.py `expectation`, so a script and pytest cannot disagree.
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, NamedTuple

import pytest
import torch

from fsdp_amp_suite import paths
from fsdp_amp_suite.expectations import Machine, ReproOf, expectation
from fsdp_amp_suite.scalers import BUILTINS, resolve


class Outcome(NamedTuple):
    bug: bool        # did the bug show?
    happened: str    # what this scaler did
    expected: str    # what a correct scaler does


def case(title: str, bugs=(), placement: str | None = None, needs: str | None = None) -> Callable:
    """Make `body(scaler) -> Outcome` a pytest case (it fails where the bug shows) and a script entry."""
    def make(body):
        @functools.wraps(body)
        def test(scaler):
            outcome = run(body, scaler)
            if outcome.bug:
                pytest.fail(f"{scaler}: {outcome.happened} (a correct scaler: {outcome.expected})", pytrace=False)

        test.repro = Case(title, body, ReproOf(tuple(bugs), placement, needs))
        return pytest.mark.repro(pytest.mark.repro_of(*bugs, placement=placement, needs=needs)(test))
    return make


class Case(NamedTuple):
    title: str
    body: Callable
    repro_of: ReproOf


def run(body: Callable[[str], Outcome], scaler: str) -> Outcome:
    """The body's outcome; an exception is the bug showing as a crash (last line of the message)."""
    try:
        return body(scaler)
    except Exception as exc:  # noqa: BLE001 - a crash is an outcome
        last = [line for line in str(exc).splitlines() if line.strip()]
        return Outcome(True, f"raised {type(exc).__name__}: {last[-1] if last else ''}".strip(),
                       "no exception")


def rank_without_grads(scaler: str, placement: str) -> Outcome:
    """problem.step_with_rank1_without_grads on 2 gloo ranks sharing one GPU, a hang bounded by 20 s (two
    repro files: fairscale's missing found_inf, and torch's one collective per grad device)."""
    from fsdp_amp_suite.conformance.problem import step_with_rank1_without_grads
    from fsdp_amp_suite.harness import RankHung, RankRaised, run_on_ranks

    expected = "rank 0 steps, rank 1 (no grads) takes part without stepping; both keep scale 256.0"
    try:
        out = run_on_ranks(step_with_rank1_without_grads, scaler, placement, world_size=2, device="cuda-shared",
                           timeout=20)
    except RankHung as exc:
        return Outcome(True, f"rank(s) {sorted(exc.ranks)} {exc.what}", expected)
    except RankRaised as exc:
        return Outcome(True, f"rank(s) {sorted(exc.ranks)} {exc.what}: {exc.error()}", expected)
    stepped, scales = [o["stepped"] for o in out], [o["scale"] for o in out]
    return Outcome(stepped != [True, False] or scales != [256.0, 256.0],
                   f"stepped per rank {stepped}, scale per rank {scales}", expected)


# ------------------------------------------------------------------------------------------ script mode

def names() -> list[str]:
    """The repro files, by the NAME `python -m fsdp_amp_suite.repro` takes."""
    return sorted(p.stem.removeprefix("test_") for p in paths.REPRO_DIR.glob("test_*.py"))


def cases(name: str) -> list:
    """The @case functions of one repro file, in file order; ValueError naming NAME where there is none."""
    stem = name.removesuffix(".py").rsplit("/", 1)[-1].removeprefix("test_")
    if stem not in names():
        raise ValueError(f"{name!r}: no repro file tests/repro/test_{stem}.py (python -m fsdp_amp_suite.repro lists "
                         "them)")
    module = paths.load_file(paths.REPRO_DIR / f"test_{stem}.py", f"_repro_test_{stem}")
    return [fn for fn in vars(module).values() if callable(fn) and hasattr(fn, "repro")]


def report(test, scalers: list[str], machine: Machine, out=sys.stdout) -> None:
    """Print one case for every scaler: its verdict, with the expectation pytest would apply."""
    c = test.repro
    print(f"{c.title}  ({test.__name__})", file=out)
    width = max(18, *(len(s) for s in scalers))
    for scaler in scalers:
        expected = expectation(scaler, test.__name__, {"scaler": scaler}, machine=machine, repro_of=c.repro_of)
        if expected.skip:
            print(f"{scaler:{width}s} skipped: {expected.skip}", file=out)
            continue
        try:
            outcome = run(c.body, scaler)
        except BaseException as exc:  # pytest.skip inside a body is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            print(f"{scaler:{width}s} skipped: {exc}", file=out)
            continue
        note = f" (known upstream bug: {expected.bug})" if expected.bug else ""
        if outcome.bug:
            print(f"{scaler:{width}s} BUG{note}: {outcome.happened}\n{'':{width}s} should have: {outcome.expected}",
                  file=out)
        else:
            fixed = f" (known bug {expected.bug} did not show: fixed here? pytest says XPASS(strict))" if note else ""
            print(f"{scaler:{width}s} ok{fixed}: {outcome.happened}", file=out)
    print(file=out)


def main(argv=None) -> int:
    from fsdp_amp_suite.harness import shutdown_pools

    parser = argparse.ArgumentParser(prog="python -m fsdp_amp_suite.repro", description="Run a repro file's cases for "
                                     "every scaler and print what happened (the pytest case is the same body).")
    parser.add_argument("name", nargs="?", help="a repro file of tests/repro, with or without test_ (omit: list)")
    parser.add_argument("--scaler", action="append", default=[], metavar="SPEC",
                        help="a built-in name or package.module:factory (repeatable; default: the built-ins)")
    args = parser.parse_args(argv)
    if not args.name:
        print("\n".join(names()))
        return 0
    try:
        found = cases(args.name)
        for spec in args.scaler:
            resolve(spec)
    except ValueError as exc:
        parser.error(str(exc))
    scalers = args.scaler or list(BUILTINS)
    machine = Machine.here()
    print(f"torch {torch.__version__}, CUDA {'available' if machine.cuda else 'not available'}\n")
    try:
        for test in found:
            report(test, scalers, machine)
    finally:
        shutdown_pools()
    return 0
