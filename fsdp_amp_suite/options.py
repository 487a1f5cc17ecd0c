"""The suite's command-line options, and the ini key that turns the suite's checks on.

fsdp_amp_suite/plugin.py registers them (pytest loads the plugin through its pytest11 entry point, or from
pytest.ini's `-p fsdp_amp_suite.plugin` in an uninstalled checkout) before pytest reads the command line: a PATH
after an option is its value, not a place to load conftests from. xdist's workers read the command line as typed
before any plugin is loaded, and by then --report has created its file, so `--report PATH` would read as a test
path there: `hand_to_workers` gives them the `--opt=VALUE` form. A run that reaches the suite's conftest under
another configuration stops with a usage error that says how to run it (`check_configuration`).

One case no plugin can reach (pytest#6904): before pytest loads any plugin it looks for its configuration
around the paths on the command line, and there `--report /existing/file` is an unknown option and a
path. With no test path given, the suite's pytest.ini is then not found at all, and pytest itself stops
with "unrecognized arguments" (inifile: None). Name a path (`python -m pytest . --report PATH`) or write
`--report=PATH`; tests/meta/test_options.py keeps that case as a strict xfail, to see the day it is fixed.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from fsdp_amp_suite.harness.ranks import DEFAULT_TIMEOUT_S  # the standard library only, at import: no torch yet

# the ini key of the suite's pytest.ini: the plugin's checks, expectations and report apply only where it is true,
# so an environment with the suite installed runs a project's own tests as before
ACTIVE = "fsdp_amp_suite"


def add_options(parser) -> None:
    parser.addini(ACTIVE, type="bool", default=False,
                  help="run the FSDP + AMP suite's checks under this configuration (the suite's pytest.ini sets it)")
    group = parser.getgroup("fsdp-amp", "FSDP + AMP gradient-scaling suite")
    group.addoption("--scaler", action="append", default=[], metavar="SPEC",
                    help="scaler under test, repeatable: a built-in name (ours, torch_amp, torch_sharded, "
                         "fairscale_sharded) or package.module:factory. Replaces the built-in set.")
    group.addoption("--fsdp", action="append", default=[], metavar="SPEC",
                    help="FSDP implementation for the matrix, repeatable: a built-in name (fairscale, fsdp1, "
                         "fsdp2) or package.module:factory(module, settings) -> wrapped module. Replaces the "
                         "matrix's implementation axis.")
    group.addoption("--xfails-file", metavar="PATH", default=None,
                    help="your own known bugs (for a plugged --scaler / --fsdp): one test id per line, a reason "
                         "after '#'; each becomes a strict xfail, and entries that match no test are named "
                         "(fsdp_amp_suite/xfails.py)")
    group.addoption("--report", metavar="PATH", default=None,
                    help="also write the compatibility report as Markdown to PATH (e.g. $GITHUB_STEP_SUMMARY)")
    group.addoption("--report-json", metavar="PATH", default=None,
                    help="also write the report's records as JSON to PATH (the torch-version table reads it)")
    group.addoption("--isolate-ranks", action="store_true",
                    help="spawn fresh ranks for every multi-rank case (slow; for reproducing a bug in a pristine "
                         "process) instead of the persistent rank pool")
    group.addoption("--rank-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                    help="seconds a multi-rank case may run before its ranks' stacks are dumped and it fails "
                         "(default %(default)s)")
    group.addoption("--require-gpu", action="store_true",
                    help="stop at start-up with exit status 2 unless torch sees a GPU (ci/gpu.sh passes it: a CPU "
                         "build of torch on a GPU runner would otherwise skip every GPU check and pass)")
    group.addoption("--only-pairs", metavar="PATH", default=None,
                    help="run each --scaler only on the checks a JSON file names for it, {spec: [test function, "
                         "...] or \"*\"}; the rest are deselected (the suite's own mutant runs use it)")


VALUE_OPTIONS = ("--scaler", "--fsdp", "--xfails-file", "--report", "--report-json", "--rank-timeout", "--only-pairs")


def read_pairs(path: str) -> dict:
    """--only-pairs: {scaler spec: "*" or a list of test function names}, checked up front."""
    try:
        with open(path) as f:
            pairs = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--only-pairs {path!r}: cannot be read as JSON ({exc})") from None
    bad = [k for k, v in (pairs.items() if isinstance(pairs, dict) else [])
           if not (v == "*" or (isinstance(v, list) and all(isinstance(t, str) for t in v)))]
    if not isinstance(pairs, dict) or bad:
        raise ValueError(f"--only-pairs {path!r}: must map each scaler spec to \"*\" or a list of test function "
                         f"names{f'; not so for {bad}' if bad else ''}")
    return pairs


def kept_by_pairs(pairs: dict, scaler: str | None, test: str) -> bool:
    """Whether --only-pairs keeps this check: a check without a scaler (a matrix cell's other params) is kept."""
    if scaler is None:
        return True
    wanted = pairs.get(scaler, [])
    return wanted == "*" or test in wanted


def joined(args) -> list[str]:
    """The command line with the suite's options in the --opt=VALUE form (the same meaning)."""
    out, rest = [], iter(args)
    for arg in rest:
        if arg == "--":
            return out + [arg, *rest]
        value = next(rest, None) if arg in VALUE_OPTIONS else None
        out.append(arg if value is None else f"{arg}={value}")
    return out


def hand_to_workers(config) -> None:
    """xdist starts its workers on the command line as typed (invocation_params.args), and a worker's first look at
    it knows no plugin's option: by then --report has created its file, and `--report PATH` would read as a test
    path there. In the =VALUE form it cannot."""
    if not hasattr(config, "workerinput"):
        params = config.invocation_params
        config.invocation_params = dataclasses.replace(params, args=tuple(joined(params.args)))


def check_configuration(config, suite_ini: str) -> None:
    """The suite's checks mean what they say only under its pytest.ini (strict markers and xfails, test ids
    relative to this directory, which --xfails-file entries and the report name). A run that took another
    configuration (a consumer project's own pytest.ini or pyproject.toml, found because a PATH given after
    an option lies in that project) is a usage error that says how to run it, not a run with other rules."""
    used = str(config.inipath) if config.inipath else None
    if used and os.path.realpath(used) == os.path.realpath(suite_ini):
        return
    raise pytest.UsageError(
        f"this suite runs under its own configuration, {suite_ini}, but pytest took "
        f"{used or 'none'} (rootdir {config.rootpath}). pytest looks for its configuration around the paths on "
        f"the command line, and a project with a pytest configuration of its own wins. Name the suite's: "
        f"add `-c {suite_ini}` to the command.")
