"""The shape every repro file shares: one `reproduce(scaler)` body, two ways to run it.

    python tests/repro/<file>.py      prints, per scaler, what happened and what should have
    pytest -m repro                   the same body as unittest cases (parameterized.expand over the
                                      built-in scalers): ours must not show the bug; each upstream
                                      scaler the bug hits is a strict xfail whose reason is its entry
                                      in tests/scalers.py KNOWN_BUGS (one home for every bug's text)

A body returns `Outcome(bug, happened, expected)`: whether the bug showed, and both stories in a
sentence. Bodies that need ranks use the rank harness (gloo on CPU, or ranks sharing one GPU).
"""
from __future__ import annotations

import sys
import unittest
from typing import Callable, NamedTuple

import torch

from tests.scalers import BUILTINS, KNOWN_BUGS_BY_ID

SCALERS = [(name,) for name in BUILTINS]  # parameterized.expand: one case per built-in scaler


class Outcome(NamedTuple):
    bug: bool        # did the bug show?
    happened: str    # what this scaler did
    expected: str    # what a correct scaler does


def known(bug_id: str, scalers) -> dict[str, str]:
    """{scaler: reason} for the KNOWN_BUGS entry bug_id, where it holds on the installed versions
    (elsewhere it is fixed: every scaler must pass). An id that names no entry is an error (KeyError).

    On a machine without CUDA, fairscale's scaler disables itself (its own KNOWN_BUGS entry), so
    any repro that builds it there is a known failure for that reason instead.
    """
    bug = KNOWN_BUGS_BY_ID[bug_id]
    hits = {s: bug.reason for s in scalers} if bug.in_force else {}  # fixed on this version
    if not torch.cuda.is_available():
        hits["fairscale_sharded"] = KNOWN_BUGS_BY_ID["fairscale-disabled-without-cuda"].reason
    return hits


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


def needs_cuda(cls):
    return unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (one GPU): this bug lives in the CUDA "
                               "code path; torch sees no GPU here")(cls)


class ReproCase(unittest.TestCase):
    """Subclass with HITS = known(...) and a test that calls self.check(scaler, reproduce)."""

    HITS: dict[str, str] = {}

    def check(self, scaler: str, reproduce: Callable[[str], Outcome]) -> None:
        outcome = run(reproduce, scaler)
        story = f"{scaler}: {outcome.happened} (a correct scaler: {outcome.expected})"
        if scaler not in self.HITS:
            self.assertFalse(outcome.bug, story)
        elif outcome.bug:
            import pytest

            pytest.xfail(self.HITS[scaler])
        else:
            self.fail(f"XPASS(strict): {scaler} no longer shows the known bug: {story}. Upstream may have fixed "
                      f"it: update KNOWN_BUGS in tests/scalers.py. Known as: {self.HITS[scaler]}")


def main(reproduce: Callable[[str], Outcome], hits: dict[str, str], title: str) -> None:
    """Plain-script mode: run the body for every built-in scaler and print what happened."""
    from tests.harness import shutdown_pools

    print(title)
    print(f"torch {torch.__version__}, CUDA {'available' if torch.cuda.is_available() else 'not available'}\n")
    for scaler in BUILTINS:
        try:
            outcome = run(reproduce, scaler)
        except BaseException as exc:  # noqa: B902 - pytest.skip (no GPU) is a BaseException
            print(f"{scaler:18s} skipped: {exc}")
            continue
        verdict = "BUG" if outcome.bug else "ok"
        known_note = " (known upstream bug)" if scaler in hits else ""
        print(f"{scaler:18s} {verdict}{known_note if outcome.bug else ''}: {outcome.happened}")
        if outcome.bug:
            print(f"{'':18s} should have: {outcome.expected}")
    shutdown_pools()
    sys.stdout.flush()
