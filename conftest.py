"""Suite-wide options and the ONE scaler parametrization shared by the conformance suite and the matrix.

Every test that takes a `scaler` argument runs once per scaler under test (the built-ins, or the
`--scaler` specs); known upstream bugs become strict xfails and timing-dependent cells skips, both
decided by the tables in tests/scalers.py.
"""
import pathlib

import pytest
import torch
from hypothesis import Phase, settings

from tests import options, xfails
from tests.harness import ranks
from tests.matrix import implementations
from tests.scalers import BUILTINS, known_bug, repro_bug, resolve, skip_reason, spec_id

# the suite's options (also named by pytest.ini's addopts, so that pytest knows them before it reads the command
# line: tests/options.py says why), the compatibility report at the end of every run, child runs
pytest_plugins = ["tests.options", "tests.report", "pytester"]

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


def scaler_specs(config) -> list:
    return config.getoption("--scaler") or list(BUILTINS)


ROOT = pathlib.Path(__file__).resolve().parent
HARNESS = pytest.StashKey[tuple]()  # config.stash: (the session's harness, the one installed before it)


def pytest_configure(config):
    options.check_configuration(config)
    timeout = config.getoption("--rank-timeout")
    if not timeout > 0:
        raise pytest.UsageError(f"--rank-timeout {timeout}: must be a positive number of seconds")
    # the session's ranks: its settings and pools belong to this object, not to module globals; a test that
    # needs other settings builds a Harness of its own (tests/meta/test_harness.py)
    harness = ranks.Harness(isolate=config.getoption("--isolate-ranks"), timeout=timeout)
    config.stash[HARNESS] = (harness, ranks.install(harness))
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
        metafunc.parametrize("scaler", specs, ids=[spec_id(s) for s in specs])


META = ROOT / "tests" / "meta"


def pytest_ignore_collect(collection_path, config):
    """The suite's own tests (tests/meta) run only when a path on the command line names them: the main job
    and a consumer's `pytest path/to/suite -m ...` collect the verdict on torch and the scaler, nothing else."""
    if collection_path == META and not any(_names_meta(arg, config) for arg in config.args):
        return True
    return None


def _names_meta(arg: str, config) -> bool:
    path = (config.invocation_params.dir / arg.split("::", 1)[0]).resolve()
    return path == META or META in path.parents


def pytest_collection_modifyitems(config, items):
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


def pytest_unconfigure(config):
    if HARNESS in config.stash:
        harness, before = config.stash[HARNESS]
        harness.shutdown()
        ranks.install(before)
