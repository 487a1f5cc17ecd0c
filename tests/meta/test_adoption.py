"""Another project runs our checks against its own scaler with the one command the README gives.

A tiny consumer project is written to a temporary directory outside this repo: its own `tests` package, its scaler
module in it, and its own pytest.ini. From its directory it runs this suite, installed in the environment (the
plugin's pytest11 entry point) and checked out beside it, with `--scaler tests.my_scaler:<factory>` and no `-c`. A
correct scaler gets a green run of the README's command, word for word, on a slice (-k SLICE: the whole run would
repeat the main job for a subclass of ours), and the whole command's collection holds none of the suite's own tests;
a broken one gets a red run that names the failed checks, and its known failures go in an --xfails-file.
"""
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import textwrap

import pytest

from fsdp_amp_suite.child_run import ROOT, clean_env, once_per_run

pytestmark = [pytest.mark.gate, pytest.mark.slow, pytest.mark.skipif(
    not importlib.metadata.entry_points(group="pytest11", name="fsdp_amp_suite.plugin"),
    reason="the suite is not installed here (pip install -e .): a consumer runs it installed, through its plugin's "
           "pytest11 entry point")]

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
# a rank-agreement check, a single-process one and the FSDP2 fp16 matrix cells without offload
SLICE = ("test_inf_on_some_ranks_makes_every_rank_skip_and_back_off or test_clean_step or "
         "(ws2 and fsdp2 and fp16 and nooffload)")
ADOPTION = ('python -m pytest path/to/suite/tests -n auto -m "conformance or matrix" '
            '--scaler your_pkg.module:factory')


def readme_command(factory: str) -> list:
    """The README's adoption command, word for word, for this suite and their factory."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert ADOPTION in f.read(), f"the README no longer gives the adoption command {ADOPTION!r}: update this test"
    words = {"python": sys.executable, "path/to/suite/tests": os.path.join(ROOT, "tests"),
             "your_pkg.module:factory": f"tests.my_scaler:{factory}"}
    return [words.get(w, w) for w in shlex.split(ADOPTION)]


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    """Their own `tests` package (the suite's has that name too) and their own pytest configuration, which would
    fail the suite's run if pytest took it (an option no pytest knows)."""
    project = tmp_path_factory.mktemp("consumer")
    (project / "tests").mkdir()
    (project / "tests" / "__init__.py").write_text("")
    (project / "tests" / "my_scaler.py").write_text(THEIR_SCALERS)
    (project / "tests" / "test_theirs.py").write_text("def test_theirs():\n    pass\n")
    (project / "pytest.ini").write_text("[pytest]\ntestpaths = tests\naddopts = --their-option-no-pytest-knows\n")
    return project


def run_suite(project, factory, *extra):
    """The README's adoption command, run from the consumer's checkout, in one process: the slice is a few seconds
    of checks, and xdist's workers would each start torch and rank pools for them (the README's own -n auto runs
    in test_their_correct_scaler_gets_a_green_run_of_the_readme_command)."""
    cmd = [sys.executable, "-m", "pytest", os.path.join(ROOT, "tests"), "-p", "no:xdist", "-m", "conformance or matrix",
           "-k", SLICE, "-p", "no:cacheprovider", "--scaler", f"tests.my_scaler:{factory}", *extra]
    return subprocess.run(cmd, cwd=project, env=clean_env(), capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def broken_run(consumer, tmp_path_factory):
    """The broken scaler's run, and the checks it failed (as data: the report's JSON records); once per run."""
    def make():
        proc = run_suite(consumer, "broken", f"--report-json={consumer / 'broken.json'}")
        records = json.loads((consumer / "broken.json").read_text())["records"]
        return dict(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr,
                    failed=sorted(r["nodeid"] for r in records if r["outcome"] == "failed"))
    run = once_per_run(tmp_path_factory, "adoption-broken", make)
    proc = subprocess.CompletedProcess("run_suite(broken)", run["returncode"], run["stdout"], run["stderr"])
    return proc, run["failed"]


def test_their_correct_scaler_gets_a_green_run_of_the_readme_command(consumer):
    proc = subprocess.run(readme_command("good") + ["-k", SLICE], cwd=consumer, env=clean_env(), capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "All as expected" in proc.stdout and " passed" in proc.stdout
    assert "test_fsdp_matches_ddp" in proc.stdout or "FSDP-vs-DDP matrix" in proc.stdout, "the matrix did not run"
    assert "tests/meta" not in proc.stdout and "test_mutants" not in proc.stdout, proc.stdout[-3000:]


def test_the_readme_command_collects_none_of_the_suites_own_tests(consumer):
    """Collected, not only selected: without -m, the adoption command's collection holds no test of tests/meta."""
    words = readme_command("good")
    for option in ("-m", "-n"):  # every test it collects (no marker selection), listed by one process
        at = words.index(option, words.index("pytest"))
        del words[at:at + 2]
    command = words + ["--co", "-q", "-p", "no:xdist"]
    proc = subprocess.run(command, cwd=consumer, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert ids and not [i for i in ids if "tests/meta/" in i], [i for i in ids if "tests/meta/" in i][:5]


def test_their_broken_scaler_gets_a_red_run_naming_the_failed_checks(broken_run):
    proc, _ = broken_run
    assert proc.returncode == 1, proc.stdout[-5000:] + proc.stderr[-3000:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert any("test_inf_on_some_ranks_makes_every_rank_skip_and_back_off" in line for line in failed), failed
    assert any("test_fsdp_matches_ddp" in line for line in failed), failed
    assert "UNEXPECTED OUTCOMES" in proc.stdout


def test_their_known_bugs_in_an_xfails_file_give_a_green_run(consumer, broken_run):
    """A team that lists its scaler's known failures (--xfails-file) gets a green gate: "nothing new broke"."""
    _, failed = broken_run
    assert failed, "the broken scaler failed nothing: this test proves nothing"
    (consumer / "xfails.txt").write_text("# our scaler decides found_inf per rank (TICKET-1)\n"
                                         + "".join(f"{nodeid}  # TICKET-1\n" for nodeid in failed))
    proc = run_suite(consumer, "broken", f"--xfails-file={consumer / 'xfails.txt'}")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TICKET-1 (--xfails-file line") >= 1 and "All as expected" in proc.stdout


def test_a_check_outside_the_xfails_file_makes_it_red_and_a_stale_entry_is_named(consumer, broken_run):
    _, failed = broken_run
    left_out, listed = failed[0], failed[1:]
    stale = "tests/conformance/test_ranks.py::test_no_such_check"
    (consumer / "xfails-partial.txt").write_text("".join(f"{nodeid}  # TICKET-1\n" for nodeid in listed) + stale + "\n")
    proc = run_suite(consumer, "broken", f"--xfails-file={consumer / 'xfails-partial.txt'}")
    assert proc.returncode == 1, proc.stdout[-5000:] + proc.stderr[-3000:]
    failed_lines = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed_lines) == 1 and left_out in failed_lines[0], failed_lines
    assert "UNEXPECTED OUTCOMES: 1 failed" in proc.stdout
    assert f"line {len(listed) + 1}: {stale}" in proc.stdout, "the entry that matches no test must be named"


def test_their_own_tests_run_as_before_with_the_suite_installed(tmp_path):
    """Installed, the plugin is in every pytest run of that environment: in a project's own run (its configuration
    does not turn the suite on) it parametrizes nothing, starts no ranks and prints no report."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_theirs.py").write_text(textwrap.dedent('''
        import pytest


        @pytest.fixture
        def scaler():
            return "theirs"


        def test_theirs(scaler):
            assert scaler == "theirs"
    '''))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compatibility report" not in proc.stdout, proc.stdout[-3000:]
