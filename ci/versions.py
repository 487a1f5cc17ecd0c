"""One table over torch versions: known bug x torch version, from the sessions' --report-json files.

    python ci/versions.py versions-out [--markdown table.md] [--expect 2.4.1,2.13.0,2.14.1]

Reads every torch-*.json in the directory (one per session, written by `pytest --report-json`), and
prints: known bug x torch version, each session's headline and exit status, and the checks whose
outcome changed between versions (grouped by test function and outcome pattern, with a count and an
example id). A cell of the bug table is
    hit N         N checks xfailed as this bug (strict xfails: the bug is there)
    fixed N       the bug is not in force on that version and N of its checks passed
    n/a           none of its checks ran there (all skipped or not collected, e.g. CUDA-only on CPU)
    UNEXPECTED N  N of its checks failed (an error, or a strict xfail that passed); (hit M) if M xfailed
    other N       its checks ran, but none of the above (e.g. xfailed as another known bug)
Exit status: non-zero if a session's exit status is non-zero or missing, an expected version has
no report, or a cell is UNEXPECTED.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

from packaging.version import Version

LEGEND = ("hit N: N checks xfailed as the bug; fixed N: not in force there and N of its checks passed; "
          "n/a: none of its checks ran there; UNEXPECTED N: N of its checks failed; "
          "other N: ran, but xfailed as another bug")


# ------------------------------------------------------------------------------------------------- data in

def load(directory) -> list[dict]:
    """Every torch-*.json report in directory, ordered by torch version (then file name)."""
    sessions = []
    for path in sorted(pathlib.Path(directory).glob("torch-*.json")):
        data = json.loads(path.read_text())
        sessions.append(dict(data, file=path.name))
    return order(sessions)


def order(sessions: list[dict]) -> list[dict]:
    return sorted(sessions, key=lambda s: (Version(s["versions"]["torch"]), s.get("file", "")))


def label(session: dict) -> str:
    return f"torch {session['versions']['torch']}"


# ------------------------------------------------------------------------------------------------- logic

def bug_cell(bug_id: str, session: dict) -> str:
    """This known bug on this session: hit / fixed / n/a / UNEXPECTED / other, with a count."""
    recs = session.get("records", [])
    mine = [r for r in recs if r.get("bug_any_version") == bug_id]
    failed = sum(r["outcome"] == "failed" for r in mine)
    hit = sum(r.get("bug") == bug_id and r["outcome"] == "xfailed" for r in recs)
    if failed:
        return f"UNEXPECTED {failed}" + (f" (hit {hit})" if hit else "")
    if hit:
        return f"hit {hit}"
    ran = [r for r in mine if r["outcome"] != "skipped"]
    if not ran:
        return "n/a"
    in_force = next((b.get("in_force") for b in session.get("known_bugs", []) if b["id"] == bug_id), None)
    passed = sum(r["outcome"] == "passed" for r in ran)
    if in_force is False and passed:
        return f"fixed {passed}"
    return f"other {len(ran)}"


def bugs(sessions: list[dict]) -> list[dict]:
    """Every known bug of any session (first seen first): id, reason, the versions it holds for."""
    out: dict[str, dict] = {}
    for s in sessions:
        for b in s.get("known_bugs", []):
            out.setdefault(b["id"], dict(id=b["id"], reason=b.get("reason", ""), torch=b.get("torch", ""),
                                         fairscale=b.get("fairscale", "")))
    return list(out.values())


def short(reason: str, width: int = 60) -> str:
    return reason if len(reason) <= width else reason[:width - 3].rstrip() + "..."


def bug_table(sessions: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): known bug x session; a row is id, the versions it holds for, a cell per session, reason."""
    header = ["known bug", "holds for"] + [label(s) for s in sessions] + ["reason"]
    rows = []
    for b in bugs(sessions):
        spec = ", ".join(f"{pkg}{b[pkg]}" for pkg in ("torch", "fairscale") if b[pkg]) or "any"
        rows.append([b["id"], spec] + [bug_cell(b["id"], s) for s in sessions] + [short(b["reason"])])
    return header, rows


def changed(sessions: list[dict]) -> list[dict]:
    """Checks whose outcome differs between sessions ('-': not collected there), grouped by test function and
    outcome pattern: [{test, pattern, count, example, bugs}], largest groups first."""
    outcomes: dict[str, list[str]] = collections.defaultdict(lambda: ["-"] * len(sessions))
    bug_of: dict[str, set] = collections.defaultdict(set)
    for i, s in enumerate(sessions):
        for r in s.get("records", []):
            outcomes[r["nodeid"]][i] = r["outcome"]
            if r.get("bug_any_version"):
                bug_of[r["nodeid"]].add(r["bug_any_version"])
    groups: dict[tuple, dict] = {}
    for nodeid, pattern in outcomes.items():
        if len(set(pattern)) < 2:
            continue
        test = nodeid.split("[", 1)[0]
        g = groups.setdefault((test, tuple(pattern)), dict(test=test, pattern=tuple(pattern), count=0,
                                                           example=nodeid, bugs=set()))
        g["count"] += 1
        g["bugs"] |= bug_of[nodeid]
    return sorted(groups.values(), key=lambda g: (-g["count"], g["test"], g["pattern"]))


def problems(sessions: list[dict], expect: list[str] = ()) -> list[str]:
    """Why the run is not green: sessions that exited non-zero (or say nothing), missing versions, UNEXPECTED."""
    out = []
    for s in sessions:
        if s.get("exitstatus") != 0:
            out.append(f"{label(s)}: exit status {s.get('exitstatus', 'missing')}")
    have = {Version(Version(s["versions"]["torch"]).base_version) for s in sessions}
    out += [f"torch {v}: no report (the session did not run, or died before writing it)"
            for v in expect if Version(v) not in have]
    out += [f"{b['id']} on {label(s)}: {cell}" for b in bugs(sessions) for s in sessions
            for cell in [bug_cell(b["id"], s)] if cell.startswith("UNEXPECTED")]
    return out


# ------------------------------------------------------------------------------------------------- data out

def _table(header: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header] + rows]


def render(sessions: list[dict], expect: list[str] = (), markdown: bool = False) -> str:
    bad = problems(sessions, expect)
    title = (f"NOT GREEN: {len(bad)} problem(s)" if bad else "All as expected") + \
        f" across {len(sessions)} torch version(s)"
    h = (lambda t: f"### {t}") if markdown else (lambda t: f"{t}:")
    lines = [f"**{title}**" if markdown else title, ""]
    lines += [f"- {p}" for p in bad] + ([""] if bad else [])
    lines += [h("known bug x torch version")] + _table(*bug_table(sessions), markdown) + ["", LEGEND, ""]
    if markdown:  # the whole reasons, folded
        lines += ["<details><summary>known bugs: the whole reasons</summary>", ""]
        lines += [f"- `{b['id']}`: {b['reason']}" for b in bugs(sessions)] + ["", "</details>", ""]
    lines.append(h("sessions"))
    for s in sessions:
        v = s["versions"]
        env = f"python {v.get('python')}, fairscale {v.get('fairscale')}, cuda {v.get('cuda')}, {len(v.get('gpus') or [])} GPU(s)"
        lines.append(f"- {label(s)} ({env}): exit {s.get('exitstatus', 'missing')}: {s.get('headline', '')}")
        for u in s.get("unmatched", []):
            lines.append(f"  - unmatched {u.get('table')} entry: {u.get('entry')}")
    lines.append("")
    groups = changed(sessions)
    lines.append(h(f"checks whose outcome changed ({sum(g['count'] for g in groups)} in {len(groups)} group(s); "
                   f"outcomes in the order {' / '.join(label(s) for s in sessions)}, '-': not collected)"))
    for g in groups:
        bug = f" [{', '.join(sorted(g['bugs']))}]" if g["bugs"] else ""
        example = g["example"][len(g["test"]):]
        lines.append(f"- {g['count']} x {g['test']}: {' / '.join(g['pattern'])}{bug}  e.g. {example}")
    if not groups:
        lines.append("(none)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown to PATH")
    ap.add_argument("--expect", default="", help="comma-separated torch versions that must have a report")
    args = ap.parse_args(argv)
    sessions = load(args.directory)
    expect = [v for v in args.expect.split(",") if v]
    print(render(sessions, expect))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(render(sessions, expect, markdown=True))
    return 1 if problems(sessions, expect) or not sessions else 0


if __name__ == "__main__":
    sys.exit(main())
