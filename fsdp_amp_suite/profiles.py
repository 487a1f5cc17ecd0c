"""The suite's Hypothesis profiles (tests/conformance/test_sequences.py), chosen with --hypothesis-profile=NAME.

ci (the default): derandomized, so a gate's verdict is the same on every run, and a budget sized to the 2-core CI
machine; no example database, so nothing is written into the tree.
deep: many more and longer sequences with fresh randomness, for a nightly job or a GPU runner; its database
(.hypothesis/) replays a failure first on the next run.
no-shrink: ci without shrinking, for child runs that only ask "is it caught" (tests/meta/test_mutants.py).
"""
from hypothesis import Phase, settings

DEFAULT = "ci"


def register() -> None:
    """Register the profiles (again is harmless) and load the default; --hypothesis-profile loads another after."""
    settings.register_profile("ci", derandomize=True, max_examples=40, stateful_step_count=30, database=None,
                              deadline=None, print_blob=False)
    settings.register_profile("deep", max_examples=1000, stateful_step_count=60, deadline=None, print_blob=True)
    settings.register_profile("no-shrink", settings.get_profile("ci"),
                              phases=[p for p in Phase if p is not Phase.shrink])
    settings.load_profile(DEFAULT)
