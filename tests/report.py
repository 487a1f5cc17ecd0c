"""The compatibility report printed at the end of every run (and `--report PATH` as Markdown).

Built on pytest's own reports: every item carries its scaler, FSDP implementation and check family
as user_properties (set at collection, carried by xdist to the controller), and
pytest_terminal_summary counts the reports pytest already collected. Tables: conformance and repro
by scaler x family; the matrix by (implementation, scaler) x (precision, offload). Cells read
`passed/failed/xfailed/skipped`; the known-bug reasons (xfails) are listed once under the tables.
"""
from __future__ import annotations

import collections
import os

from tests.scalers import BUILTINS

FAMILIES = {  # test file -> the column it counts in
    "test_single_process.py": "single rank",
    "test_ranks.py": "across ranks",
    "test_busy_gpu.py": "busy GPU",
    "test_fsdp2.py": "FSDP2",
}
OUTCOMES = ("passed", "failed", "xfailed", "skipped")


def pytest_addoption(parser):
    parser.getgroup("fsdp-amp").addoption(
        "--report", metavar="PATH", default=None,
        help="also write the compatibility report as Markdown to PATH (e.g. $GITHUB_STEP_SUMMARY)")


def pytest_collection_modifyitems(items):
    for item in items:
        label(item)


def label(item) -> None:
    """Attach (scaler, impl, family) to an item at collection."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    path = str(item.path)
    if "scaler" in params:
        cell = params.get("cell")
        if cell is not None:
            item.user_properties += [("scaler", params["scaler"]), ("impl", cell.impl),
                                     ("family", f"{cell.precision} {cell.offload}")]
        elif os.path.basename(path) in FAMILIES:
            item.user_properties += [("scaler", params["scaler"]), ("family", FAMILIES[os.path.basename(path)])]
    elif f"{os.sep}repro{os.sep}" in path:
        # parameterized.expand names a case test_<name>_<index>_<scaler>
        scaler = next((s for s in sorted(BUILTINS, key=len, reverse=True) if item.name.endswith("_" + s)), None)
        if scaler:
            item.user_properties += [("scaler", scaler), ("family", "repro")]


def _outcome(report) -> str | None:
    if report.failed:
        return "failed"  # also a strict xfail that passed ([XPASS(strict)]) and setup/teardown errors
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "failed"  # a non-strict xpass is unexpected too
    if report.skipped:
        return "skipped"
    return "passed" if report.when == "call" else None


def records(reports) -> list[dict]:
    """One record per labelled test id: its properties, its outcome, and the xfail reason if any."""
    out: dict[str, dict] = {}
    rank = {None: -1, "passed": 0, "skipped": 1, "xfailed": 2, "failed": 3}
    for rep in reports:
        props = dict(rep.user_properties)
        outcome = _outcome(rep)
        if "scaler" not in props or outcome is None:
            continue
        rec = out.setdefault(rep.nodeid, dict(props, outcome=None, reason=None))
        if rank[outcome] > rank[rec["outcome"]]:
            rec["outcome"] = outcome
            rec["reason"] = getattr(rep, "wasxfail", None) if outcome == "xfailed" else None
    return list(out.values())


def _cell(counts) -> str:
    return "/".join(str(counts[o]) for o in OUTCOMES) if sum(counts.values()) else ""


def tables(recs: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """[(title, header, rows)] for the suites present in recs."""
    out = []
    suite = [r for r in recs if "impl" not in r]
    if suite:
        fams = [f for f in list(FAMILIES.values()) + ["repro"] if any(r["family"] == f for r in suite)]
        scalers = sorted({r["scaler"] for r in suite}, key=_scaler_order)
        counts = collections.defaultdict(collections.Counter)
        for r in suite:
            counts[r["scaler"], r["family"]][r["outcome"]] += 1
        out.append(("conformance and repro", ["scaler"] + fams,
                    [[s] + [_cell(counts[s, f]) for f in fams] for s in scalers]))
    matrix = [r for r in recs if "impl" in r]
    if matrix:
        fams = [f"{p} {o}" for o in ("nooffload", "offload") for p in ("fp32", "fp16", "bf16")
                if any(r["family"] == f"{p} {o}" for r in matrix)]
        rows = sorted({(r["impl"], r["scaler"]) for r in matrix}, key=lambda k: (k[0], _scaler_order(k[1])))
        counts = collections.defaultdict(collections.Counter)
        for r in matrix:
            counts[r["impl"], r["scaler"], r["family"]][r["outcome"]] += 1
        out.append(("FSDP-vs-DDP matrix", ["implementation", "scaler"] + fams,
                    [[i, s] + [_cell(counts[i, s, f]) for f in fams] for i, s in rows]))
    return out


def _scaler_order(spec: str):
    builtin = list(BUILTINS)
    return (builtin.index(spec) if spec in builtin else len(builtin), spec)


def headline(recs: list[dict]) -> str:
    total = collections.Counter(r["outcome"] for r in recs)
    counts = ", ".join(f"{total[o]} {o}" for o in OUTCOMES) + " scaler checks"
    if total["failed"]:
        return f"UNEXPECTED OUTCOMES: {total['failed']} failed (failures, errors or strict xfails that passed); {counts}"
    return f"All as expected: {counts}; xfailed = known upstream bugs, listed below"


def known_bugs(recs: list[dict]) -> list[tuple[str, int, list[str]]]:
    """[(reason, how many xfails, which scalers)] in order of frequency."""
    by = collections.defaultdict(list)
    for r in recs:
        if r["outcome"] == "xfailed":
            by[r["reason"] or "(no reason)"].append(r["scaler"])
    return sorted(((reason, len(s), sorted(set(s), key=_scaler_order)) for reason, s in by.items()),
                  key=lambda t: -t[1])


def render(recs: list[dict], markdown: bool) -> str:
    lines = [("**" + headline(recs) + "**") if markdown else headline(recs), ""]
    for title, header, rows in tables(recs):
        lines.append(f"### {title}" if markdown else f"{title}:")
        if markdown:
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
        else:
            widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
            for row in [header] + rows:
                lines.append("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
        lines.append("")
    lines.append("cells: passed/failed/xfailed/skipped (failed includes errors and strict xfails that passed)")
    bugs = known_bugs(recs)
    if bugs:
        lines += ["", "### Known upstream bugs (strict xfails)" if markdown else "known upstream bugs (strict xfails):"]
        for reason, n, scalers in bugs:
            lines.append(f"- {n} x [{', '.join(scalers)}] {reason}")
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):  # xdist worker: the controller reports
        return
    import pytest

    reports = [rep for reps in terminalreporter.stats.values() for rep in reps
               if isinstance(rep, pytest.TestReport)]  # stats also hold deselected items, warnings
    recs = records(reports)
    if not recs:
        return
    terminalreporter.write_sep("=", "compatibility report")
    terminalreporter.write(render(recs, markdown=False))
    path = config.getoption("--report")
    if path:
        with open(path, "a" if path == os.environ.get("GITHUB_STEP_SUMMARY") else "w") as f:
            f.write(render(recs, markdown=True))
        terminalreporter.write_line(f"report written to {path}")
