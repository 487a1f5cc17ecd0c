"""The shape every repro file shares: one `reproduce(scaler)` body, two ways to run it.

    python tests/repro/<file>.py [--scaler SPEC ...]   prints, per scaler (the built-ins, or SPECs
                                                       such as your_pkg.mod:factory), what happened
                                                       and what should have
    pytest -m repro [--scaler SPEC ...]                the same body as a test per scaler, from the root
                                                       conftest's scaler parametrization like every check

A case names the bugs it shows by KNOWN_BUGS id, `@pytest.mark.repro_of("bug-id", ...)`: for each
scaler an entry names (every scaler for an FSDP implementation's bug), the root conftest makes the
case a strict xfail with the entry's reason, as it does for the conformance and matrix checks (one
engine, one table); every other scaler, plugged ones included, must not show the bug.
`placement=` names where the case races (the async-copy race, KNOWN_BUGS async-copy-race-busy-gpu): a
scaler without a bug there is skipped as
timing-dependent, by the same policy as conformance (tests/scalers.py skip_reason).

A body returns `Outcome(bug, happened, expected)`: whether the bug showed, and both stories in a
sentence. Bodies that need ranks use the rank harness (gloo on CPU, or ranks sharing one GPU).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, NamedTuple

import pytest
import torch

from tests.scalers import BUILTINS, known_bug, repro_bug, resolve


class Outcome(NamedTuple):
    bug: bool        # did the bug show?
    happened: str    # what this scaler did
    expected: str    # what a correct scaler does


def run(reproduce: Callable[[str], Outcome], scaler: str) -> Outcome:
    """The body's outcome; an exception is the bug showing as a crash (first line of the message)."""
    try:
        return reproduce(scaler)
    except Exception as exc:  # noqa: BLE001 - a crash is an outcome
        last = [line for line in str(exc).splitlines() if line.strip()]
        return Outcome(True, f"raised {type(exc).__name__}: {last[-1] if last else ''}".strip(),
                       "no exception")


def rank_without_grads(scaler: str, placement: str) -> Outcome:
    """problem.step_with_rank1_without_grads on 2 gloo ranks sharing one GPU, a hang bounded by 20 s (two
    repro files: fairscale's missing found_inf, and torch's one collective per grad device)."""
    from tests.conformance.problem import step_with_rank1_without_grads
    from tests.harness import RankHung, RankRaised, run_on_ranks

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


# a mark: on a test function, or in a module's pytestmark
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (one GPU): this bug lives in the "
                                "CUDA code path; torch sees no GPU here")


def check(scaler: str, reproduce: Callable[[str], Outcome]) -> None:
    """The pytest case: this scaler must not show the bug (where it is known to, the case is a strict xfail)."""
    outcome = run(reproduce, scaler)
    if outcome.bug:
        pytest.fail(f"{scaler}: {outcome.happened} (a correct scaler: {outcome.expected})", pytrace=False)


def _known_note(spec: str, test: Callable) -> str:
    """" (known upstream bug: <id>)" where the pytest case of this spec is a strict xfail."""
    cuda = torch.cuda.is_available()
    ids = [bug_id for mark in getattr(test, "pytestmark", []) if mark.name == "repro_of" for bug_id in mark.args]
    bug = known_bug(spec, test.__name__, {"scaler": spec}, cuda) or repro_bug(spec, ids)
    return f" (known upstream bug: {bug.id})" if bug else ""


def main(reproduce: Callable[[str], Outcome], test: Callable, title: str) -> None:
    """Plain-script mode: run the body for every scaler (--scaler SPEC, repeatable; default the built-ins)
    and print what happened. `test` is the pytest case whose repro_of marks say which bugs are known."""
    from tests.harness import shutdown_pools

    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--scaler", action="append", default=[], metavar="SPEC",
                        help="a built-in name or package.module:factory (repeatable; default: the built-ins)")
    specs = parser.parse_args().scaler or list(BUILTINS)
    for spec in specs:
        try:
            resolve(spec)
        except ValueError as exc:
            parser.error(str(exc))
    print(title)
    print(f"torch {torch.__version__}, CUDA {'available' if torch.cuda.is_available() else 'not available'}\n")
    width = max(18, *(len(s) for s in specs))
    for scaler in specs:
        try:
            outcome = run(reproduce, scaler)
        except BaseException as exc:  # noqa: B902 - pytest.skip (no GPU) is a BaseException
            print(f"{scaler:{width}s} skipped: {exc}")
            continue
        verdict = "BUG" if outcome.bug else "ok"
        print(f"{scaler:{width}s} {verdict}{_known_note(scaler, test) if outcome.bug else ''}: {outcome.happened}")
        if outcome.bug:
            print(f"{'':{width}s} should have: {outcome.expected}")
    shutdown_pools()
    sys.stdout.flush()
