"""The suite's checks: the session's rank harness, the ONE scaler parametrization shared by the conformance suite and
the matrix, and every check's expectation (fsdp_amp_suite/expectations.py, from fsdp_amp_suite/known_bugs.py).

Registered by fsdp_amp_suite/plugin.py where the configuration turns the suite on. Every test that takes a `scaler`
argument runs once per scaler under test (the built-ins, or the `--scaler` specs); known upstream bugs become strict
xfails, and checks this machine cannot run skips.
"""
import pytest

from fsdp_amp_suite import options, profiles, xfails
from fsdp_amp_suite.harness import copies, pool, ranks
from fsdp_amp_suite.matrix import axes, implementations
from fsdp_amp_suite.expectations import Machine, ReproOf, expectation
from fsdp_amp_suite.scalers import BUILTINS, resolve, spec_id

profiles.register()  # before hypothesis' own pytest_configure, which loads a --hypothesis-profile


def scaler_specs(config) -> list:
    return config.getoption("--scaler") or list(BUILTINS)


HARNESS = pytest.StashKey[tuple]()  # config.stash: (the session's harness, the one installed before it)


def pytest_configure(config):
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
    """The matrix's cells (axes.py, for the built-in or --fsdp implementations), then the scalers: a check's id
    reads `test[cell-scaler]` (what --xfails-file entries name). Which cells this machine cannot run is decided
    with every other expectation."""
    if "cell" in metafunc.fixturenames:
        impls = metafunc.config.getoption("--fsdp") or list(implementations.BUILTINS)
        generated = axes.cells(impls) + axes.natural_cells(impls)
        metafunc.parametrize("cell", generated, ids=[c.id for c in generated])
    if "scaler" in metafunc.fixturenames:
        specs = scaler_specs(metafunc.config)
        metafunc.parametrize("scaler", specs, ids=[spec_id(s) for s in specs])


def pytest_collection_modifyitems(config, items):
    """Every check's expectation (fsdp_amp_suite/expectations.py), applied here and nowhere else; --only-pairs
    deselects."""
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
            item.user_properties.append(("race_free", True))
        # the report's record of the check (fsdp_amp_suite/records.py Record): which bug or entry it xfails on
        item.user_properties += [(name, value) for name, value in (
            ("bug", expected.bug), ("xfails_file", expected.xfails_file),
            ("bug_any_version", expected.bug_any_version)) if value]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A race-free check (fsdp_amp_suite/expectations.py rule 2) runs with every copy blocking, in its ranks too."""
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
