"""The compatibility report printed at the end of every run (`--report PATH` as Markdown,
`--report-json PATH` as data for tools such as the torch-version table, python -m fsdp_amp_suite.version_table).

Built on pytest's own reports: every item carries its scaler, FSDP implementation, check family and
known bug as user_properties (set at collection, carried by xdist to the controller), and
pytest_terminal_summary counts the reports pytest already collected, as Records (fsdp_amp_suite/records.py, the type
--report-json and the version table share). EVERY collected test counts: scaler checks by scaler x the column
their module marks (`pytest.mark.report_column(NAME)`; a module without one is a column of its own, named by its file),
the
matrix by (implementation, mesh, scaler) x (precision, offload), every other test by its file, and a
collection error as a failure. The headline can never disagree with pytest's exit status. Cells
read `passed/failed/xfailed/skipped`; the known-bug reasons (xfails) are listed once under the tables.
"""
from __future__ import annotations

import collections
import json
import os
import shlex

import pytest

from fsdp_amp_suite import versions, xfails
from fsdp_amp_suite.harness.failures import Death, RankDied
from fsdp_amp_suite.matrix import implementations
from fsdp_amp_suite.records import OUTCOMES, Bug, Cell, Record, Report, Unmatched, heading, table
from fsdp_amp_suite.known_bugs import KNOWN_BUGS
from fsdp_amp_suite.scalers import BUILTINS

# the order of the scaler checks' columns (each named by its module's report_column mark; "repro": tests/repro);
# a column not named here comes after these, by name
COLUMNS = ("single rank", "across ranks", "busy GPU", "FSDP2", "model sizes", "sequences", "fused optimizers", "meshes",
           "frameworks", "repro")


def pytest_configure(config):
    """The report's marker; a report path that cannot be written is a usage error now, not an INTERNALERROR after
    the run."""
    config.addinivalue_line("markers", "report_column(name): the compatibility report's column for a module's "
                                       "scaler checks (fsdp_amp_suite/report.py)")
    if hasattr(config, "workerinput"):
        return
    for option in ("--report", "--report-json"):
        path = config.getoption(option)
        if path is None:
            continue
        try:
            with open(path, "a"):
                pass
        except OSError as exc:
            raise pytest.UsageError(f"{option} {path!r}: cannot be written ({exc.strerror})") from None


def pytest_collection_modifyitems(items):
    for item in items:
        label(item)


def column(item) -> str:
    """The report column of a scaler check: "repro" for a repro case, else its report_column mark, else its file's
    name."""
    if item.path.parent.name == "repro":
        return "repro"
    mark = item.get_closest_marker("report_column")
    return mark.args[0] if mark else item.path.name


def label(item) -> None:
    """A check's identity, built once at collection from pytest's own data (the test function, its module, its
    params): the fields of its Record but the outcome (fsdp_amp_suite/records.py). Carried as user_properties of plain
    values (xdist takes them to the controller), so the report, --report-json and the child runs of the
    meta-tests (fsdp_amp_suite/child_run.py) read them as data; nothing parses a test id back."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    cell = params.get("cell")
    props = [("test", item.originalname), ("function", f"{item.parent.nodeid}::{item.originalname}")]
    if "scaler" in params and cell is not None:
        props += [("scaler", params["scaler"]), ("impl", cell.impl), ("mesh", cell.mesh),
                  ("family", Cell(cell.precision, cell.offload).as_data())]
    elif "scaler" in params:
        props += [("scaler", params["scaler"]), ("family", column(item))]
    else:
        props += [("family", item.path.name)]
    item.user_properties += props


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A check whose ranks died carries how each died and the command that reruns it alone (the report's
    "Rank deaths"): a crash in torch's code reads apart from a check that failed."""
    rep = yield
    died = call.excinfo and isinstance(call.excinfo.value, RankDied) and call.excinfo.value.deaths
    if died:
        rep.user_properties = [*rep.user_properties, ("deaths", [d.as_data() for d in died]),
                               ("rerun", rerun_command(item))]
    return rep


def rerun_command(item) -> str:
    """The command that reruns this check alone, in fresh ranks, from any directory."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    cmd = ["python", "-m", "pytest", "--isolate-ranks", "-p", "no:xdist", f"{item.path}::{item.name}"]
    if params.get("scaler") not in (None, *BUILTINS):
        cmd += ["--scaler", params["scaler"]]
    impl = getattr(params.get("cell"), "impl", None)
    if impl is not None and impl not in implementations.BUILTINS:
        cmd += ["--fsdp", impl]
    return shlex.join(cmd)


def _outcome(report) -> str | None:
    if report.failed:
        return "failed"  # also a strict xfail that passed ([XPASS(strict)]) and setup/teardown errors
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "failed"  # a non-strict xpass is unexpected too
    if report.skipped:
        return "skipped"
    return "passed" if report.when == "call" else None


def records(reports) -> list[Record]:
    """One Record per test id (and per module that failed to collect): its properties, its worst outcome,
    and the xfail reason if any."""
    props: dict[str, dict] = {}
    worst: dict[str, tuple] = {}
    rank = {None: -1, "passed": 0, "skipped": 1, "xfailed": 2, "failed": 3}
    for rep in reports:
        # a CollectReport stands for a module that failed to collect or skipped itself whole
        outcome = (_outcome(rep) if hasattr(rep, "when")
                   else "failed" if rep.failed else "skipped" if rep.skipped else None)
        if outcome is None:
            continue
        # a collect report has no properties: its family is its file
        props.setdefault(rep.nodeid, {"family": os.path.basename(rep.fspath) or rep.nodeid,
                                      **dict(getattr(rep, "user_properties", ()))})
        if rank[outcome] > rank[worst.get(rep.nodeid, (None,))[0]]:
            worst[rep.nodeid] = (outcome, getattr(rep, "wasxfail", None) if outcome == "xfailed" else None)
    return [Record.from_data(dict(p, nodeid=nodeid, outcome=worst[nodeid][0], reason=worst[nodeid][1]))
            for nodeid, p in props.items()]


def _cell(counts) -> str:
    return "/".join(str(counts[o]) for o in OUTCOMES) if sum(counts.values()) else ""


def tables(recs: list[Record]) -> list[tuple[str, list[str], list[list[str]]]]:
    """[(title, header, rows)] for the suites present in recs."""
    out = []
    suite = [r for r in recs if r.scaler and not r.impl]
    if suite:
        present = {r.family for r in suite}
        fams = [f for f in COLUMNS if f in present] + sorted(present - set(COLUMNS))
        scalers = sorted({r.scaler for r in suite}, key=_scaler_order)
        counts = collections.defaultdict(collections.Counter)
        for r in suite:
            counts[r.scaler, r.family][r.outcome] += 1
        out.append(("conformance and repro", ["scaler"] + fams,
                    [[s] + [_cell(counts[s, f]) for f in fams] for s in scalers]))
    matrix = [r for r in recs if r.impl]
    if matrix:
        present = {r.family for r in matrix}
        fams = [c for o in ("nooffload", "offload") for p in ("fp32", "fp16", "bf16")
                for c in [Cell(p, o)] if c in present]
        rows = sorted({(r.impl, r.mesh or "1d", r.scaler) for r in matrix},
                      key=lambda k: (k[0], k[1] != "1d", k[1], _scaler_order(k[2])))  # 1d first, then each mesh
        counts = collections.defaultdict(collections.Counter)
        for r in matrix:
            counts[r.impl, r.mesh or "1d", r.scaler, r.family][r.outcome] += 1
        out.append(("FSDP-vs-DDP matrix", ["implementation", "mesh", "scaler"] + [str(f) for f in fams],
                    [[i, m, s] + [_cell(counts[i, m, s, f]) for f in fams] for i, m, s in rows]))
    rest = [r for r in recs if not r.scaler]
    if rest:
        counts = collections.defaultdict(collections.Counter)
        for r in rest:
            counts[r.family][r.outcome] += 1
        out.append(("the suite's own tests and the rest, by file", ["file", "checks"],
                    [[f, _cell(counts[f])] for f in sorted(counts)]))
    return out


def _scaler_order(spec: str):
    builtin = list(BUILTINS)
    return (builtin.index(spec) if spec in builtin else len(builtin), spec)


EXIT_MEANINGS = {1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
                 5: "no tests collected"}


def headline(recs: list[Record], exitstatus: int = 0) -> str:
    """The first line: UNEXPECTED whenever anything failed or pytest itself exits non-zero."""
    total = collections.Counter(r.outcome for r in recs)
    counts = ", ".join(f"{total[o]} {o}" for o in OUTCOMES) + " (every collected test)"
    if total["failed"]:
        theirs = sum(r.outcome == "failed" and r.died_in_upstream_code for r in recs)
        crashes = (f", {theirs} of them a rank that died in torch's, fairscale's or native code, not a scaler verdict "
                   f"(Rank deaths, below)") if theirs else ""
        return (f"UNEXPECTED OUTCOMES: {total['failed']} failed (failures, errors or strict xfails that passed"
                f"{crashes}); {counts}")
    if int(exitstatus) != 0:
        meaning = EXIT_MEANINGS.get(int(exitstatus), "non-zero")
        return f"UNEXPECTED OUTCOMES: pytest exits {int(exitstatus)} ({meaning}); {counts}"
    return f"All as expected: {counts}; xfailed = known upstream bugs, listed below"


def header(about: dict) -> str:
    """What this run is on: the versions and the hardware the verdict holds for."""
    gpus = collections.Counter(about["gpus"])
    hardware = ", ".join(f"{n} x {name}" for name, n in gpus.items()) or "no GPU"
    return (f"torch {about['torch']}, fairscale {about['fairscale'] or '(not installed)'}, "
            f"CUDA {about['cuda'] or '(none)'}, {hardware}, python {about['python']}")


def known_bugs(recs: list[Record]) -> list[tuple[str, str, int, list[str]]]:
    """[(bug id, reason, how many xfails, which scalers)] in order of frequency. The id is the KNOWN_BUGS id
    (docs/bugs.md has its write-up), or "xfails-file" for a consumer's own entries."""
    by = collections.defaultdict(list)
    for r in recs:
        if r.outcome == "xfailed":
            bug = r.bug or ("xfails-file" if r.xfails_file else "the test's own xfail")
            by[bug, r.reason or "(no reason)"].append(r.scaler or "-")
    return sorted(((bug, reason, len(s), sorted(set(s), key=_scaler_order)) for (bug, reason), s in by.items()),
                  key=lambda t: (-t[2], t[0]))


def render(recs: list[Record], markdown: bool, exitstatus: int = 0, about: dict | None = None,
           stale: tuple = ()) -> str:
    first = headline(recs, exitstatus)
    lines = [("**" + first + "**") if markdown else first, ""]
    if about:
        lines += [("on " + header(about)), ""]
    for title, head, rows in tables(recs):
        lines += [heading(title, markdown)] + table(head, rows, markdown) + [""]
    lines.append("cells: passed/failed/xfailed/skipped (failed includes errors and strict xfails that passed)")
    died = [r for r in recs if r.deaths and r.outcome == "failed"]
    if died:
        lines += ["", heading("Rank deaths (a rank process died: in torch's, fairscale's or native code: not a scaler "
                              "verdict)",
                              markdown)]
        for r in died:
            whose = "torch's, fairscale's or native code" if r.died_in_upstream_code else "a verdict on the scaler"
            lines.append(f"- {r.nodeid}: {'; '.join(_death_line(d) for d in r.deaths)} ({whose}); rerun: {r.rerun}")
    race_free = collections.Counter((r.scaler, r.outcome) for r in recs if r.race_free)
    if race_free:  # the checks a timing-dependent skip used to hide, judged with blocking copies
        lines += ["", heading("Race-free checks (copies made blocking: the async-copy race cannot decide them)",
                              markdown)]
        lines += table(["scaler", *OUTCOMES], [[s, *(race_free[s, o] for o in OUTCOMES)]
                                               for s in sorted({s for s, _ in race_free})], markdown)
    bugs = known_bugs(recs)
    if bugs:
        lines += ["", heading("Known upstream bugs (strict xfails)" if markdown else
                              "known upstream bugs (strict xfails)",
                              markdown)]
        for bug, reason, n, scalers in bugs:
            lines.append(f"- {n} x [{', '.join(scalers)}] {bug}: {reason}")
    if stale:  # fsdp_amp_suite/xfails.py: a renamed or deselected test, or a typo, never misses silently
        lines += ["", heading("--xfails-file entries that match no test of this run", markdown)]
        lines += [f"- line {e.line}: {e.check}" for e in stale]
    return "\n".join(lines) + "\n"


def _death_line(d: dict) -> str:
    return str(Death(**d))


def as_data(recs: list[Record], exitstatus: int, about: dict, stale: tuple = ()) -> dict:
    """The report as plain data (--report-json; fsdp_amp_suite/records.py Report.from_data reads it back): what ran
    where, every record, every known bug, the --xfails-file entries that matched nothing."""
    return Report(versions=about, exitstatus=int(exitstatus), headline=headline(recs, exitstatus),
                  known_bugs=tuple(Bug(b.id, b.reason, b.torch, b.fairscale, b.in_force) for b in KNOWN_BUGS),
                  records=tuple(recs), xfails_file_unmatched=tuple(Unmatched(e.line, e.check) for e in stale)).as_data()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or config.option.collectonly:  # xdist worker: the controller reports
        return
    reports = [rep for reps in terminalreporter.stats.values() for rep in reps
               if isinstance(rep, (pytest.TestReport, pytest.CollectReport))]  # stats also hold warnings
    recs = records(reports)
    about = versions.describe()
    stale = xfails.unmatched(config.stash.get(xfails.ENTRIES, []), (r.nodeid for r in recs))
    terminalreporter.write_sep("=", "compatibility report")
    terminalreporter.write(render(recs, markdown=False, exitstatus=exitstatus, about=about, stale=stale))
    path = config.getoption("--report")
    if path:
        with open(path, "a" if path == os.environ.get("GITHUB_STEP_SUMMARY") else "w") as f:
            f.write(render(recs, markdown=True, exitstatus=exitstatus, about=about, stale=stale))
        terminalreporter.write_line(f"report written to {path}")
    path = config.getoption("--report-json")
    if path:
        with open(path, "w") as f:
            json.dump(as_data(recs, exitstatus, about, stale), f, indent=1)
        terminalreporter.write_line(f"report data written to {path}")
