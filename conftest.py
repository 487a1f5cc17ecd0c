"""Suite-wide options: the rank harness engine, its timeout, and the scalers under test."""

from tests.harness import ranks


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


def pytest_configure(config):
    ranks.configure(isolate=config.getoption("--isolate-ranks"),
                    timeout=config.getoption("--rank-timeout"))


def pytest_sessionfinish(session, exitstatus):
    ranks.shutdown_pools()
