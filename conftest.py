"""Suite-wide options and the ONE scaler parametrization shared by the conformance suite and the matrix.

Every test that takes a `scaler` argument runs once per scaler under test (the built-ins, or the
`--scaler` specs); known upstream bugs become strict xfails and timing-dependent cells skips, both
decided by tests/expectations.py from the table in tests/known_bugs.py.
"""
import pathlib

import pytest
from hypothesis import Phase, settings

from tests import options, xfails
from tests.harness import copies, pool, ranks
from tests.matrix import implementations
from tests.expectations import Machine, ReproOf, expectation
from tests.scalers import BUILTINS, resolve, spec_id

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
    if config.getoption("--require-gpu"):
        import torch

        if not torch.cuda.is_available():
            pytest.exit(f"--require-gpu: torch {torch.__version__} sees no GPU (a CPU build, no driver, or "
                        f"CUDA_VISIBLE_DEVICES hides them); without one use ci/cpu.sh", returncode=2)
    timeout = config.getoption("--rank-timeout")
    if not timeout > 0:
        raise pytest.UsageError(f"--rank-timeout {timeout}: must be a positive number of seconds")
    # the session's ranks: its settings and pools belong to this object, not to module globals; a test that
    # needs other settings builds a Harness of its own (tests/meta/test_harness.py)
    harness = ranks.Harness(isolate=config.getoption("--isolate-ranks"), timeout=timeout)
    config.stash[HARNESS] = (harness, ranks.install(harness))
    if hasattr(config, "workerinput"):  # an xdist worker: its ranks' fork server imports torch while it collects
        pool.start_fork_server()
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
    """Every check's expectation (tests/expectations.py), applied here and nowhere else; --only-pairs deselects."""
    pairs_path = config.getoption("--only-pairs")
    if pairs_path:
        try:
            pairs = options.read_pairs(pairs_path)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        keep = [options.kept_by_pairs(pairs, _params(i).get("scaler"), i.originalname) for i in items]
        config.hook.pytest_deselected(items=[i for i, k in zip(items, keep) if not k])
        items[:] = [i for i, k in zip(items, keep) if k]
    machine, entries = Machine.here(), config.stash.get(xfails.ENTRIES, [])
    for item in items:
        params = _params(item)
        mark = item.get_closest_marker("repro_of")
        repro_of = mark and ReproOf(mark.args, mark.kwargs.get("placement"), mark.kwargs.get("needs"))
        try:
            expected = expectation(params.get("scaler"), item.originalname, params, machine=machine,
                                   repro_of=repro_of, their_entry=xfails.find(entries, item.nodeid))
        except ValueError as exc:
            raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
        if expected.skip:
            item.add_marker(pytest.mark.skip(reason=expected.skip))
        elif expected.xfail:
            item.add_marker(pytest.mark.xfail(strict=True, reason=expected.xfail, raises=expected.raises))
        if expected.race_free and not expected.skip:
            item.add_marker(pytest.mark.race_free(expected.race_free))
        # the report's record of the check (tests/records.py Record): which bug or entry it xfails on
        item.user_properties += [(name, value) for name, value in (
            ("bug", expected.bug), ("xfails_file", expected.xfails_file),
            ("bug_any_version", expected.bug_any_version)) if value]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A race-free check (tests/expectations.py rule 2) runs with every copy blocking, in its ranks too."""
    if item.get_closest_marker("race_free") is None:
        return (yield)
    with copies.blocking_copies():
        return (yield)


def _params(item) -> dict:
    """A collected check's parametrization (empty for an unparametrized one)."""
    return getattr(getattr(item, "callspec", None), "params", {})


def pytest_unconfigure(config):
    if HARNESS in config.stash:
        harness, before = config.stash[HARNESS]
        harness.shutdown()
        ranks.install(before)
