"""Bad input to the suite's own options is a clear error naming what was wrong: a usage error at
start-up for a bad spec or timeout, and a TypeError naming the factory when a --scaler or --fsdp
factory returns the wrong kind of object. Never a hang, never a silent wrong result."""
import os

import pytest

from tests.child_run import ROOT, runpytest
from tests.harness import run_on_ranks
from tests.matrix import axes
from tests.matrix.cell import train_cell
from tests.scalers import make_scaler

INI = os.path.join(ROOT, "pytest.ini")  # not an xfails file


@pytest.mark.parametrize("args, message", [
    (["--scaler", "nope"], "--scaler 'nope': not a built-in (ours, torch_amp"),
    (["--scaler", "nosuchpkg.mod:make"], "--scaler 'nosuchpkg.mod:make': cannot import module 'nosuchpkg.mod'"),
    (["--scaler", "tests.scalers:KNOWN_BUGS"], "module 'tests.scalers' has no callable 'KNOWN_BUGS'"),
    (["--fsdp", "fsdp3"], "--fsdp 'fsdp3': not a built-in (fairscale, fsdp1, fsdp2)"),
    (["--rank-timeout", "0"], "--rank-timeout 0.0: must be a positive number of seconds"),
    (["--report", "/nonexistent/dir/r.md"], "--report '/nonexistent/dir/r.md': cannot be written (No such file"),
    (["--report-json", "/nonexistent/dir/r.json"], "--report-json '/nonexistent/dir/r.json': cannot be written"),
    (["--xfails-file", "/nonexistent/x.txt"], "--xfails-file '/nonexistent/x.txt': cannot be read (No such file"),
    (["--xfails-file", INI], f"--xfails-file {INI!r} line 1: '[pytest]' is not a test id"),
])
def test_a_bad_option_is_a_usage_error_naming_it(pytester, monkeypatch, args, message):
    result = runpytest(pytester, monkeypatch, os.path.join(ROOT, "tests/matrix/test_axes.py"), "-p", "no:xdist",
                       "--co", "-q", *args, timeout=120)
    stderr = "\n".join(result.errlines)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, "\n".join(result.outlines[-30:]) + stderr[-2000:]
    assert message in stderr and "INTERNALERROR" not in stderr, stderr[-2000:]


def test_a_scaler_factory_returning_a_non_scaler_is_named():
    with pytest.raises(TypeError, match=r"scaler 'builtins:dict': its factory returned an object of type dict, "
                                        r"which lacks scale, "):
        make_scaler("builtins:dict", device="cpu")


def returns_its_state_dict(module, settings):
    """A wrong --fsdp factory: it returns the module's state_dict instead of the wrapped module."""
    return module.state_dict()


def test_an_fsdp_factory_returning_a_non_module_is_named():
    spec = f"{__name__}:returns_its_state_dict"
    cell = next(c for c in axes.cells([spec]) if c.world_size == 1)
    with pytest.raises(Exception, match=rf"--fsdp {spec}: factory\(module, settings\) returned an object of "
                                        r"type OrderedDict"):
        run_on_ranks(train_cell, cell, "ours", spec, world_size=1)
