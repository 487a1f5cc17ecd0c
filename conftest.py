"""Suite-wide options and the ONE scaler parametrization shared by the conformance suite and the matrix.

Every test that takes a `scaler` argument runs once per scaler under test (the built-ins, or the
`--scaler` specs); known upstream bugs become strict xfails and timing-dependent cells skips, both
decided by the tables in tests/scalers.py.
"""
import pytest
import torch
from hypothesis import Phase, settings

from tests import xfails
from tests.harness import ranks
from tests.matrix import implementations
from tests.scalers import BUILTINS, known_bug, repro_bug, resolve, skip_reason

pytest_plugins = ["tests.report", "pytester"]  # the compatibility report at the end of every run; child runs

# Hypothesis profiles (tests/conformance/test_sequences.py), chosen with --hypothesis-profile=NAME.
# ci (the default): derandomized, so a gate's verdict is the same on every run, and a budget sized to
# the 2-core CI machine; no example database, so nothing is written into the tree.
# deep: many more and longer sequences with fresh randomness, for a nightly job or a GPU runner; its
# database (.hypothesis/) replays a failure first on the next run.
# no-shrink: ci without shrinking, for child runs that only ask "is it caught" (tests/meta/test_mutants.py)
settings.register_profile("ci", derandomize=True, max_examples=40, stateful_step_count=30, database=None,
                          deadline=None, print_blob=False)
settings.register_profile("deep", max_examples=1000, stateful_step_count=60, deadline=None, print_blob=True)
settings.register_profile("no-shrink", settings.get_profile("ci"),
                          phases=[p for p in Phase if p is not Phase.shrink])
settings.load_profile("ci")


def pytest_addoption(parser):
    group = parser.getgroup("fsdp-amp")
    group.addoption("--isolate-ranks", action="store_true",
                    help="spawn fresh ranks for every multi-rank case (slow; for reproducing a bug "
                         "in a pristine process) instead of the persistent rank pool")
    group.addoption("--rank-timeout", type=float, default=ranks.DEFAULT_TIMEOUT_S,
                    help="seconds a multi-rank case may run before its ranks' stacks are dumped and it "
                         "fails (default %(default)s)")
    group.addoption("--scaler", action="append", default=[], metavar="SPEC",
                    help="scaler under test, repeatable: a built-in name (ours, torch_amp, "
                         "torch_sharded, fairscale_sharded) or package.module:factory. "
                         "Replaces the built-in set.")
    group.addoption("--fsdp", action="append", default=[], metavar="SPEC",
                    help="FSDP implementation for the matrix, repeatable: a built-in name (fairscale, "
                         "fsdp1, fsdp2) or package.module:factory(module, settings) -> wrapped module. "
                         "Replaces the matrix's implementation axis.")
    group.addoption("--xfails-file", metavar="PATH", default=None,
                    help="your own known bugs (for a plugged --scaler / --fsdp): one test id per line, a reason "
                         "after '#'; each becomes a strict xfail, and entries that match no test are named "
                         "(tests/xfails.py)")


def scaler_specs(config) -> list:
    return config.getoption("--scaler") or list(BUILTINS)


def pytest_configure(config):
    timeout = config.getoption("--rank-timeout")
    if not timeout > 0:
        raise pytest.UsageError(f"--rank-timeout {timeout}: must be a positive number of seconds")
    ranks.configure(isolate=config.getoption("--isolate-ranks"), timeout=timeout)
    # a bad --scaler or --fsdp is a clear usage error at start-up, not 300 failures
    specs = ([(resolve, s) for s in scaler_specs(config)]
             + [(implementations.resolve, s) for s in config.getoption("--fsdp")])
    for resolve_spec, spec in specs:
        try:
            resolve_spec(spec)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
    path = config.getoption("--xfails-file")
    try:
        config.stash[xfails.ENTRIES] = xfails.read(path) if path else []
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_generate_tests(metafunc):
    if "scaler" in metafunc.fixturenames:
        specs = scaler_specs(metafunc.config)
        metafunc.parametrize("scaler", specs, ids=[s.replace(":", "-") for s in specs])


def pytest_collection_modifyitems(config, items):
    # before -m/-k deselect anything (conftest hooks run before the mark plugin's): the tables that
    # name tests are checked against this (tests/meta/test_tables.py), when it is the whole built-in suite
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("--fsdp"):
        from tests.report import WHOLE_SUITE  # a plugin of this conftest: imported once pytest registered it

        config.stash[WHOLE_SUITE] = [(item.originalname, getattr(getattr(item, "callspec", None), "params", {}),
                                      item.path.name) for item in items]
    cuda = torch.cuda.is_available()
    theirs = config.stash.get(xfails.ENTRIES, [])
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "scaler" not in params:
            _their_xfail(item, theirs)
            continue
        spec = params["scaler"]
        bug = known_bug(spec, item.originalname, params, cuda)
        anywhere = known_bug(spec, item.originalname, params, cuda, any_version=True)
        timing = skip_reason(spec, item.originalname, params, cuda)
        repro = item.get_closest_marker("repro_of")
        if repro and not anywhere:  # a repro case: the bugs it shows, by id; the placement it races at, if any
            try:
                bug, anywhere = repro_bug(spec, repro.args), repro_bug(spec, repro.args, any_version=True)
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
            placement = repro.kwargs.get("placement")
            timing = placement and skip_reason(spec, item.originalname, {"placement": placement}, cuda)
            # the case shows its bug whatever the race (its author checked it on the GPU)
            beats_now = beats_any = anywhere is not None
        else:
            beats_now, beats_any = bool(bug and bug.beats_race), bool(anywhere and anywhere.beats_race)
        if timing and not beats_now:
            item.add_marker(pytest.mark.skip(reason=timing))
        elif bug:
            item.add_marker(pytest.mark.xfail(strict=True, reason=bug.reason))
            item.user_properties.append(("bug", bug.id))
        else:
            _their_xfail(item, theirs)
        # the known bug of this check on any version: the version table tells "fixed here" from "never hit"
        if anywhere and not (timing and not beats_any):
            item.user_properties.append(("bug_any_version", anywhere.id))


def _their_xfail(item, entries) -> None:
    """The consumer's --xfails-file: a strict xfail where a built-in known bug did not already decide."""
    entry = xfails.find(entries, item.nodeid)
    if entry:
        item.add_marker(pytest.mark.xfail(strict=True, reason=f"{entry.reason} (--xfails-file line {entry.line})"))
        item.user_properties.append(("xfails_file", entry.check))


def pytest_sessionfinish(session, exitstatus):
    ranks.shutdown_pools()
