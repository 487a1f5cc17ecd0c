"""The standalone repros (fsdp_amp_suite/repro/standalone, docs/upstream/README.md) keep their contract, and KNOWN_BUGS
keeps what the reports and the bug table say of them: one file per entry or shared by one defect's entries,
nothing imported but the standard library, torch and (in fairscale's files) fairscale, the report's sections in
every docstring, a real-training run for every reachable entry, the reports and the recorded runs current.
Static and fast: the files themselves run in the main job (tests/upstream/test_standalone.py).
"""
import ast
import subprocess
import sys

import pytest

from fsdp_amp_suite.expectations import NEEDS, BugShown
from fsdp_amp_suite.known_bugs import INJECTION_ONLY, KNOWN_BUGS, NEEDED, NOT_NEEDED, STANDALONE_DIR, standalone_files
from fsdp_amp_suite.upstream import reports
from fsdp_amp_suite.upstream.runs import MINIMAL, MINIMAL_DIR, MINIMAL_LINES, ROOT, modes, path_of, verdict

pytestmark = pytest.mark.harness
FILES = standalone_files()
MINIMALS = sorted(p.stem for p in (ROOT / MINIMAL_DIR).glob("*.py"))


def _imports(path) -> set:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." if node.level else node.module.split(".")[0])
    return out


def test_every_file_is_an_entrys_and_every_entry_has_one():
    on_disk = {p.stem for p in (ROOT / STANDALONE_DIR).glob("*.py")}
    assert on_disk == set(FILES), (f"files no KNOWN_BUGS entry names: {sorted(on_disk - set(FILES))}; "
                                   f"entries without their file: {sorted(set(FILES) - on_disk)}")
    for stem, shown in FILES.items():
        assert shown[0].id == stem, f"{stem}.py: shared by {[b.id for b in shown]}, but no entry has its name"


@pytest.mark.parametrize("stem", sorted(FILES))
def test_a_file_imports_only_the_stdlib_torch_and_its_own_upstream(stem):
    allowed = set(sys.stdlib_module_names) | {"torch"}
    if any(bug.fairscale for bug in FILES[stem]) or "fairscale" in stem:
        allowed.add("fairscale")
    foreign = _imports(path_of(stem)) - allowed
    assert not foreign, f"{stem}.py imports {sorted(foreign)}: a standalone repro is pasted as it is"


@pytest.mark.parametrize("stem", MINIMALS)
def test_a_minimal_repro_is_short_belongs_to_a_report_and_imports_what_a_standalone_may(stem):
    """The report's inline repro: at most MINIMAL_LINES lines, for an entry that gets a report, pasted as it is."""
    assert stem in {bug.standalone_file for bug in reports.reported()}, (
        f"{MINIMAL_DIR}/{stem}.py: no reported KNOWN_BUGS entry owns a standalone file of that name")
    path = path_of(stem, MINIMAL)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MINIMAL_LINES, f"{path.name}: {len(lines)} lines, more than {MINIMAL_LINES}"
    allowed = set(sys.stdlib_module_names) | {"torch"} | ({"fairscale"} if "fairscale" in stem else set())
    assert not _imports(path) - allowed, f"{path.name} imports {sorted(_imports(path) - allowed)}"


@pytest.mark.parametrize("stem", sorted(FILES))
def test_a_files_ranks_meet_without_picking_a_port(stem):
    """A port found free and bound later by the store can be taken in between by another process on a busy runner:
    a process group gets its store (HashStore, FileStore) and no socket is bound."""
    tree = ast.parse(path_of(stem).read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    bad = [f"line {n.lineno}: {n.func.attr}" for n in calls if n.func.attr == "bind" or (
        n.func.attr == "init_process_group" and "store" not in {k.arg for k in n.keywords})]
    assert not bad, f"{stem}.py picks a port ({', '.join(bad)}): pass init_process_group a store"


@pytest.mark.parametrize("stem", sorted(FILES))
def test_a_file_has_the_reports_sections_and_every_flag_its_modes_run(stem):
    d = reports.doc(stem)
    assert d.title and d.body
    source = path_of(stem).read_text(encoding="utf-8")
    for mode in [m for m in modes(FILES[stem])[1:] if m != MINIMAL]:
        assert f'"--{mode}"' in source, f"{stem}.py has no --{mode} flag, which KNOWN_BUGS runs it with"


def test_entries_sharing_a_file_agree_on_versions_and_needs():
    for stem, shown in FILES.items():
        assert {(b.torch, b.fairscale) for b in shown} == {(shown[0].torch, shown[0].fairscale)}, stem
        assert all(not b.needs for b in shown[1:]), f"{stem}: `needs` belongs on the file's own entry"
        assert shown[0].needs in ("", *NEEDS), f"{stem}: needs={shown[0].needs!r} is no NEEDS key"


COMMONNESS = ("Common", "Uncommon", "Rare", "Timing-dependent")  # words a reach's setups says how common it is by


def test_every_entry_says_whether_real_training_reaches_it():
    """Two fields: whether an overflow is needed, and the setups with how common they are (or, injection only,
    why training does not get there); an overflow that real training makes is shown by a real-training run."""
    for bug in KNOWN_BUGS:
        assert bug.reach and bug.reach.overflow in (NEEDED, NOT_NEEDED, INJECTION_ONLY), bug.id
        assert bug.reach.setups.strip(), f"{bug.id}: a reach without its setups"
        if bug.reach.overflow == NEEDED:
            assert bug.reach.run.startswith("--"), f"{bug.id}: an overflow reaches it, but no real run shows it"
        if bug.reach.overflow != INJECTION_ONLY:
            assert any(word in bug.reach.setups for word in COMMONNESS), f"{bug.id}: its setups do not say how common"


def test_the_reports_are_current():
    stale = reports.check(ROOT / "docs" / "upstream", reports.load_runs())
    assert not stale, f"run `python -m fsdp_amp_suite.upstream.reports --write docs/upstream`: {stale}"


def test_a_duplicate_of_an_open_thread_is_a_comment_draft_not_a_report(tmp_path):
    """An entry with comment_on gets no report: a stray report file, or a draft that is missing or does not name
    the entry, is named by the check."""
    bug = reports.commented()[0]
    reports_dir, comments = tmp_path / "upstream", tmp_path / "comments"
    reports_dir.mkdir()
    comments.mkdir()
    for other in reports.reported():
        (reports_dir / f"{other.id}.md").write_text(reports.report(other, reports.load_runs()), encoding="utf-8")
    for other in reports.commented():
        (comments / f"{other.comment_on}.md").write_text(f"`KNOWN_BUGS` id `{other.id}`", encoding="utf-8")
    assert reports.check(reports_dir, reports.load_runs(), comments) == []
    (reports_dir / f"{bug.id}.md").write_text("# the old report", encoding="utf-8")
    (comments / f"{bug.comment_on}.md").write_text("words that name no entry", encoding="utf-8")
    assert reports.check(reports_dir, reports.load_runs(), comments) == [
        f"{reports_dir / (bug.id + '.md')}: no KNOWN_BUGS entry gets this report",
        f"{comments / (bug.comment_on + '.md')}: the comment draft for {bug.id} is missing or does not name it"]


def test_a_report_without_recorded_runs_lacks_its_versions_table_and_is_named(tmp_path):
    bug = reports.reported()[0]
    runs = [r for r in reports.load_runs() if r["file"] != bug.standalone_file]
    assert reports.versions_table(bug.standalone_file, []) == []
    assert f"{tmp_path / (bug.id + '.md')}: no recorded run, so no versions table (--record)" in reports.check(
        tmp_path, runs)


def test_the_recorded_runs_cover_every_report_and_match_known_bugs():
    """Every report of a bug that shows without CUDA has its recorded runs (a CUDA-only one is recorded from the GPU
    gate's runs, --merge, and says so until then), and every recorded status is what KNOWN_BUGS expects."""
    runs = reports.load_runs()
    for bug in reports.reported():
        ran = {r["mode"] for r in runs if r["file"] == bug.id and r["status"] != 77}
        if bug.needs != "cuda":
            assert {"plain", "with-fix"} <= ran, (f"{bug.id}: no recorded plain and --with-fix run; run `python -m "
                                                  f"fsdp_amp_suite.upstream.reports --record docs/upstream/runs.json`")
    wrong = [r for r in runs if r["file"] in FILES and r["status"] != reports.expected_status(r["file"], r)]
    assert not wrong, [(r["file"], r["mode"], r["torch"], r["status"]) for r in wrong]


def _proc(status, out):
    return subprocess.CompletedProcess([], status, stdout=out, stderr="Traceback ...")


def test_only_the_two_lines_and_status_1_count_as_the_bug():
    assert verdict(_proc(1, "observed: it stepped\nexpected: it skips\n")) is True
    assert verdict(_proc(0, "observed: it skipped\nexpected: it skips\n")) is False
    for status, out in [(1, ""), (1, "observed: x\n"), (2, "observed: x\nexpected: y\n"), (77, "skip: needs CUDA")]:
        with pytest.raises(AssertionError) as caught:
            verdict(_proc(status, out))
        assert not isinstance(caught.value, BugShown), "a crash or a wrong skip must not count as the bug"
