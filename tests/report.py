"""The compatibility report printed at the end of every run (`--report PATH` as Markdown,
`--report-json PATH` as data for tools such as the torch-version table, ci/versions.py).

Built on pytest's own reports: every item carries its scaler, FSDP implementation, check family and
known bug as user_properties (set at collection, carried by xdist to the controller), and
pytest_terminal_summary counts the reports pytest already collected. EVERY collected test counts:
scaler checks by scaler x family (a test file without a named family is a family of its own), the
matrix by (implementation, scaler) x (precision, offload), every other test by its file, and a
collection error as a failure. The headline can never disagree with pytest's exit status. Cells
read `passed/failed/xfailed/skipped`; the known-bug reasons (xfails) are listed once under the tables.
"""
from __future__ import annotations

import collections
import json
import os

import pytest

from tests import versions, xfails
from tests.scalers import BUILTINS, KNOWN_BUGS

FAMILIES = {  # test file -> the column it counts in
    "test_single_process.py": "single rank",
    "test_ranks.py": "across ranks",
    "test_busy_gpu.py": "busy GPU",
    "test_fsdp2.py": "FSDP2",
    "test_sizes.py": "model sizes",
    "test_sequences.py": "sequences",
}
OUTCOMES = ("passed", "failed", "xfailed", "skipped")


def pytest_configure(config):
    """A report path that cannot be written is a usage error now, not an INTERNALERROR after the run."""
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


def label(item) -> None:
    """A check's identity, built once at collection from pytest's own data (the test function, its file, its
    params): the test, the scaler spec, the FSDP implementation of a matrix cell, the report's family.
    Carried as user_properties (xdist takes them to the controller), so the report, --report-json and the
    child runs of the meta-tests (tests/child_run.py) read them as data; nothing parses a test id back."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    name = item.path.name
    cell = params.get("cell")
    props = [("test", item.originalname)]
    if "scaler" in params and cell is not None:
        props += [("scaler", params["scaler"]), ("impl", cell.impl), ("family", f"{cell.precision} {cell.offload}")]
    elif "scaler" in params:
        family = "repro" if item.path.parent.name == "repro" else FAMILIES.get(name, name)
        props += [("scaler", params["scaler"]), ("family", family)]
    else:
        props += [("family", name)]
    item.user_properties += props


def _outcome(report) -> str | None:
    if report.failed:
        return "failed"  # also a strict xfail that passed ([XPASS(strict)]) and setup/teardown errors
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "failed"  # a non-strict xpass is unexpected too
    if report.skipped:
        return "skipped"
    return "passed" if report.when == "call" else None


def records(reports) -> list[dict]:
    """One record per test id (and per module that failed to collect): its properties, its outcome,
    and the xfail reason if any."""
    out: dict[str, dict] = {}
    rank = {None: -1, "passed": 0, "skipped": 1, "xfailed": 2, "failed": 3}
    for rep in reports:
        # a CollectReport stands for a module that failed to collect or skipped itself whole
        outcome = _outcome(rep) if hasattr(rep, "when") else "failed" if rep.failed else "skipped" if rep.skipped else None
        if outcome is None:
            continue
        props = dict(getattr(rep, "user_properties", ()))
        props.setdefault("family", os.path.basename(rep.nodeid.split("::")[0]) or rep.nodeid)
        rec = out.setdefault(rep.nodeid, dict(props, nodeid=rep.nodeid, outcome=None, reason=None))
        if rank[outcome] > rank[rec["outcome"]]:
            rec["outcome"] = outcome
            rec["reason"] = getattr(rep, "wasxfail", None) if outcome == "xfailed" else None
    return list(out.values())


def _cell(counts) -> str:
    return "/".join(str(counts[o]) for o in OUTCOMES) if sum(counts.values()) else ""


def tables(recs: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """[(title, header, rows)] for the suites present in recs."""
    out = []
    # .get, not "in": the JSON records (--report-json) hold every key, null where absent
    suite = [r for r in recs if r.get("scaler") and not r.get("impl")]
    if suite:
        named = list(FAMILIES.values()) + ["repro"]
        present = {r["family"] for r in suite}
        fams = [f for f in named if f in present] + sorted(present - set(named))
        scalers = sorted({r["scaler"] for r in suite}, key=_scaler_order)
        counts = collections.defaultdict(collections.Counter)
        for r in suite:
            counts[r["scaler"], r["family"]][r["outcome"]] += 1
        out.append(("conformance and repro", ["scaler"] + fams,
                    [[s] + [_cell(counts[s, f]) for f in fams] for s in scalers]))
    matrix = [r for r in recs if r.get("impl")]
    if matrix:
        fams = [f"{p} {o}" for o in ("nooffload", "offload") for p in ("fp32", "fp16", "bf16")
                if any(r["family"] == f"{p} {o}" for r in matrix)]
        rows = sorted({(r["impl"], r["scaler"]) for r in matrix}, key=lambda k: (k[0], _scaler_order(k[1])))
        counts = collections.defaultdict(collections.Counter)
        for r in matrix:
            counts[r["impl"], r["scaler"], r["family"]][r["outcome"]] += 1
        out.append(("FSDP-vs-DDP matrix", ["implementation", "scaler"] + fams,
                    [[i, s] + [_cell(counts[i, s, f]) for f in fams] for i, s in rows]))
    rest = [r for r in recs if not r.get("scaler")]
    if rest:
        counts = collections.defaultdict(collections.Counter)
        for r in rest:
            counts[r["family"]][r["outcome"]] += 1
        out.append(("the suite's own tests and the rest, by file", ["file", "checks"],
                    [[f, _cell(counts[f])] for f in sorted(counts)]))
    return out


def _scaler_order(spec: str):
    builtin = list(BUILTINS)
    return (builtin.index(spec) if spec in builtin else len(builtin), spec)


EXIT_MEANINGS = {1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
                 5: "no tests collected"}


def headline(recs: list[dict], exitstatus: int = 0) -> str:
    """The first line: UNEXPECTED whenever anything failed or pytest itself exits non-zero."""
    total = collections.Counter(r["outcome"] for r in recs)
    counts = ", ".join(f"{total[o]} {o}" for o in OUTCOMES) + " (every collected test)"
    if total["failed"]:
        return f"UNEXPECTED OUTCOMES: {total['failed']} failed (failures, errors or strict xfails that passed); {counts}"
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


def known_bugs(recs: list[dict]) -> list[tuple[str, str, int, list[str]]]:
    """[(bug id, reason, how many xfails, which scalers)] in order of frequency. The id is the KNOWN_BUGS id
    (docs/bugs.md has its write-up), or "xfails-file" for a consumer's own entries."""
    by = collections.defaultdict(list)
    for r in recs:
        if r["outcome"] == "xfailed":
            bug = r.get("bug") or ("xfails-file" if r.get("xfails_file") else "the test's own xfail")
            by[bug, r["reason"] or "(no reason)"].append(r.get("scaler") or "-")
    return sorted(((bug, reason, len(s), sorted(set(s), key=_scaler_order)) for (bug, reason), s in by.items()),
                  key=lambda t: (-t[2], t[0]))


def render(recs: list[dict], markdown: bool, exitstatus: int = 0, about: dict | None = None,
           stale: tuple = ()) -> str:
    first = headline(recs, exitstatus)
    lines = [("**" + first + "**") if markdown else first, ""]
    if about:
        lines += [("on " + header(about)), ""]
    for title, head, rows in tables(recs):
        lines.append(f"### {title}" if markdown else f"{title}:")
        if markdown:
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
        else:
            widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
            for row in [head] + rows:
                lines.append("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
        lines.append("")
    lines.append("cells: passed/failed/xfailed/skipped (failed includes errors and strict xfails that passed)")
    bugs = known_bugs(recs)
    if bugs:
        lines += ["", "### Known upstream bugs (strict xfails)" if markdown else "known upstream bugs (strict xfails):"]
        for bug, reason, n, scalers in bugs:
            lines.append(f"- {n} x [{', '.join(scalers)}] {bug}: {reason}")
    if stale:  # tests/xfails.py: a renamed or deselected test, or a typo, never misses silently
        lines += ["", "### --xfails-file entries that match no test of this run" if markdown
                  else "--xfails-file entries that match no test of this run:"]
        lines += [f"- line {e.line}: {e.check}" for e in stale]
    return "\n".join(lines) + "\n"


def as_data(recs: list[dict], exitstatus: int, about: dict, stale: tuple = ()) -> dict:
    """The report as plain data (--report-json): what ran where, every record, every known bug."""
    keys = ("nodeid", "test", "outcome", "scaler", "impl", "family", "bug", "bug_any_version", "xfails_file")
    return {"versions": about, "exitstatus": int(exitstatus), "headline": headline(recs, exitstatus),
            "known_bugs": [{"id": b.id, "reason": b.reason, "torch": b.torch, "fairscale": b.fairscale,
                            "in_force": b.in_force} for b in KNOWN_BUGS],
            "records": [{k: r.get(k) for k in keys} for r in recs],
            "xfails_file_unmatched": [{"line": e.line, "check": e.check} for e in stale]}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or config.option.collectonly:  # xdist worker: the controller reports
        return
    reports = [rep for reps in terminalreporter.stats.values() for rep in reps
               if isinstance(rep, (pytest.TestReport, pytest.CollectReport))]  # stats also hold warnings
    recs = records(reports)
    about = versions.describe()
    stale = xfails.unmatched(config.stash.get(xfails.ENTRIES, []), (r["nodeid"] for r in recs))
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
