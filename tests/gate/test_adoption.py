"""Another project runs our checks against its own scaler with the one command the README gives.

A tiny consumer project is written to a temporary directory outside this repo, with its own scaler
module; from its directory it runs this suite (as a git submodule checkout would sit there) with
`--scaler their_pkg.scalers:<factory>`. A correct scaler gets a green run; a broken one a red run
that names the failed checks.
"""
import subprocess
import sys
import textwrap

import pytest

from tests.child_run import ROOT, clean_env

pytestmark = [pytest.mark.gate, pytest.mark.slow]

THEIR_SCALERS = textwrap.dedent('''
    """The consumer's scalers: a correct one, and one that decides found_inf per rank."""
    from scaler_impl import DeviceSplitGradScaler


    class TheirScaler(DeviceSplitGradScaler):
        pass


    class TheirBrokenScaler(DeviceSplitGradScaler):
        def _agree(self, found):
            return float(sum(t.item() for t in found.values()))  # never all-reduced


    def good(**kwargs):
        return TheirScaler(**kwargs)


    def broken(**kwargs):
        return TheirBrokenScaler(**kwargs)
''')
SLICE = "test_inf_on_some_ranks_makes_every_rank_skip_and_back_off or test_clean_step or (ws2 and fsdp2 and fp16)"


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    project = tmp_path_factory.mktemp("consumer")
    (project / "their_pkg").mkdir()
    (project / "their_pkg" / "__init__.py").write_text("")
    (project / "their_pkg" / "scalers.py").write_text(THEIR_SCALERS)
    return project


def run_suite(project, factory):
    # the README's adoption command, run from the consumer's checkout
    cmd = [sys.executable, "-m", "pytest", ROOT, "-n", "2", "-m", "conformance or matrix", "-k", SLICE,
           "-p", "no:cacheprovider", "--scaler", f"their_pkg.scalers:{factory}"]
    return subprocess.run(cmd, cwd=project, env=clean_env(), capture_output=True, text=True, timeout=900)


def test_their_correct_scaler_gets_a_green_run(consumer):
    proc = run_suite(consumer, "good")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "All as expected" in proc.stdout and " passed" in proc.stdout


def test_their_broken_scaler_gets_a_red_run_naming_the_failed_checks(consumer):
    proc = run_suite(consumer, "broken")
    assert proc.returncode == 1, proc.stdout[-5000:] + proc.stderr[-3000:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert any("test_inf_on_some_ranks_makes_every_rank_skip_and_back_off" in line for line in failed), failed
    assert any("test_fsdp_matches_ddp" in line for line in failed), failed
    assert "UNEXPECTED OUTCOMES" in proc.stdout
