"""One table over torch versions: known bug x torch version, from the sessions' --report-json files.

    python -m fsdp_amp_suite.version_table versions-out [--markdown table.md] [--expect 2.4.1,2.13.0,2.14.1]

Reads every torch-*.json in the directory (one per session, written by `pytest --report-json`, read back as
fsdp_amp_suite/records.py Reports), and prints: known bug x torch version, each session's headline and exit status
(and its --xfails-file entries that matched no test), and the checks whose outcome changed between versions
(grouped by test function and outcome pattern, with a count and an example id). A cell of the bug table is
    hit N         N checks xfailed as this bug (strict xfails: the bug is there)
    fixed N       the bug is not in force on that version and N of its checks passed
    n/a           none of its checks ran there (all skipped or not collected, e.g. CUDA-only on CPU)
    UNEXPECTED N  N of its checks failed (an error, or a strict xfail that passed); (hit M) if M xfailed
    other N       its checks ran, but none of the above (e.g. xfailed as another known bug)
Exit status: non-zero if a session's exit status is non-zero or missing, an expected version has
no report, or a cell is UNEXPECTED.

Only the standard library and packaging: the table job installs nox alone.
"""
from __future__ import annotations

import argparse
import collections
import enum
import json
import pathlib
import sys
from dataclasses import dataclass

from packaging.version import Version

from fsdp_amp_suite.records import Bug, Report, heading, table

LEGEND = ("hit N: N checks xfailed as the bug; fixed N: not in force there and N of its checks passed; "
          "n/a: none of its checks ran there; UNEXPECTED N: N of its checks failed; "
          "other N: ran, but xfailed as another bug")


class Status(enum.Enum):
    HIT = "hit"
    FIXED = "fixed"
    NA = "n/a"
    UNEXPECTED = "UNEXPECTED"
    OTHER = "other"


@dataclass(frozen=True)
class BugCell:
    """A known bug on a session: its status, how many checks say so, and (UNEXPECTED) how many xfailed as it."""
    status: Status
    count: int = 0
    hit: int = 0

    def __str__(self) -> str:
        if self.status is Status.NA:
            return self.status.value
        return f"{self.status.value} {self.count}" + (f" (hit {self.hit})" if self.hit else "")


# ------------------------------------------------------------------------------------------------- data in

def load(directory) -> list[Report]:
    """Every torch-*.json report in directory, ordered by torch version (then file name)."""
    return order([Report.from_data(json.loads(path.read_text()))
                  for path in sorted(pathlib.Path(directory).glob("torch-*.json"))])


def order(sessions: list[Report]) -> list[Report]:
    return sorted(sessions, key=lambda s: Version(s.versions["torch"]))  # stable: then as given


def label(session: Report) -> str:
    return f"torch {session.versions['torch']}"


# ------------------------------------------------------------------------------------------------- logic

def bug_cell(bug_id: str, session: Report) -> BugCell:
    """This known bug on this session: hit / fixed / n/a / UNEXPECTED / other, with a count."""
    mine = [r for r in session.records if r.bug_any_version == bug_id]
    failed = sum(r.outcome == "failed" for r in mine)
    hit = sum(r.bug == bug_id and r.outcome == "xfailed" for r in session.records)
    if failed:
        return BugCell(Status.UNEXPECTED, failed, hit)
    if hit:
        return BugCell(Status.HIT, hit)
    ran = [r for r in mine if r.outcome != "skipped"]
    if not ran:
        return BugCell(Status.NA)
    in_force = next((b.in_force for b in session.known_bugs if b.id == bug_id), None)
    passed = sum(r.outcome == "passed" for r in ran)
    if in_force is False and passed:
        return BugCell(Status.FIXED, passed)
    return BugCell(Status.OTHER, len(ran))


def bugs(sessions: list[Report]) -> list[Bug]:
    """Every known bug of any session (first seen first)."""
    out: dict[str, Bug] = {}
    for s in sessions:
        for b in s.known_bugs:
            out.setdefault(b.id, b)
    return list(out.values())


def short(reason: str, width: int = 60) -> str:
    return reason if len(reason) <= width else reason[:width - 3].rstrip() + "..."


def bug_table(sessions: list[Report]) -> tuple[list[str], list[list]]:
    """(header, rows): known bug x session; a row is id, the versions it holds for, a BugCell per session, reason."""
    header = ["known bug", "holds for"] + [label(s) for s in sessions] + ["reason"]
    rows = []
    for b in bugs(sessions):
        spec = ", ".join(f"{pkg}{spec}" for pkg, spec in (("torch", b.torch), ("fairscale", b.fairscale)) if spec)
        rows.append([b.id, spec or "any"] + [bug_cell(b.id, s) for s in sessions] + [short(b.reason)])
    return header, rows


def changed(sessions: list[Report]) -> list[dict]:
    """Checks whose outcome differs between sessions ('-': not collected there), grouped by test function and
    outcome pattern: [{test, pattern, count, example, bugs}], largest groups first."""
    outcomes: dict[str, list[str]] = collections.defaultdict(lambda: ["-"] * len(sessions))
    function: dict[str, str] = {}
    bug_of: dict[str, set] = collections.defaultdict(set)
    for i, s in enumerate(sessions):
        for r in s.records:
            outcomes[r.nodeid][i] = r.outcome
            function[r.nodeid] = r.function or r.nodeid  # a module that failed to collect: its own id
            if r.bug_any_version:
                bug_of[r.nodeid].add(r.bug_any_version)
    groups: dict[tuple, dict] = {}
    for nodeid, pattern in outcomes.items():
        if len(set(pattern)) < 2:
            continue
        test = function[nodeid]
        g = groups.setdefault((test, tuple(pattern)), dict(test=test, pattern=tuple(pattern), count=0,
                                                           example=nodeid, bugs=set()))
        g["count"] += 1
        g["bugs"] |= bug_of[nodeid]
    return sorted(groups.values(), key=lambda g: (-g["count"], g["test"], g["pattern"]))


def problems(sessions: list[Report], expect: list[str] = ()) -> list[str]:
    """Why the run is not green: sessions that exited non-zero (or say nothing), missing versions, UNEXPECTED."""
    out = [f"{label(s)}: exit status {'missing' if s.exitstatus is None else s.exitstatus}"
           for s in sessions if s.exitstatus != 0]
    have = {Version(Version(s.versions["torch"]).base_version) for s in sessions}
    out += [f"torch {v}: no report (the session did not run, or died before writing it)"
            for v in expect if Version(v) not in have]
    out += [f"{b.id} on {label(s)}: {cell}" for b in bugs(sessions) for s in sessions
            for cell in [bug_cell(b.id, s)] if cell.status is Status.UNEXPECTED]
    return out


# ------------------------------------------------------------------------------------------------- data out

def render(sessions: list[Report], expect: list[str] = (), markdown: bool = False) -> str:
    bad = problems(sessions, expect)
    title = (f"NOT GREEN: {len(bad)} problem(s)" if bad else "All as expected") + \
        f" across {len(sessions)} torch version(s)"
    lines = [f"**{title}**" if markdown else title, ""]
    lines += [f"- {p}" for p in bad] + ([""] if bad else [])
    lines += [heading("known bug x torch version", markdown)] + table(*bug_table(sessions), markdown) + ["", LEGEND, ""]
    if markdown:  # the whole reasons, folded
        lines += ["<details><summary>known bugs: the whole reasons</summary>", ""]
        lines += [f"- `{b.id}`: {b.reason}" for b in bugs(sessions)] + ["", "</details>", ""]
    lines.append(heading("sessions", markdown))
    for s in sessions:
        v = s.versions
        env = (f"python {v.get('python')}, fairscale {v.get('fairscale')}, cuda {v.get('cuda')}, "
               f"{len(v.get('gpus') or [])} GPU(s)")
        exit_status = "missing" if s.exitstatus is None else s.exitstatus
        lines.append(f"- {label(s)} ({env}): exit {exit_status}: {s.headline}")
        lines += [f"  - --xfails-file line {u.line} matched no test: {u.check}" for u in s.xfails_file_unmatched]
    lines.append("")
    groups = changed(sessions)
    lines.append(heading(f"checks whose outcome changed ({sum(g['count'] for g in groups)} in {len(groups)} group(s); "
                         f"outcomes in the order {' / '.join(label(s) for s in sessions)}, '-': not "
                         "collected)", markdown))
    for g in groups:
        bug = f" [{', '.join(sorted(g['bugs']))}]" if g["bugs"] else ""
        example = g["example"].removeprefix(g["test"])
        lines.append(f"- {g['count']} x {g['test']}: {' / '.join(g['pattern'])}{bug}  e.g. {example}")
    if not groups:
        lines.append("(none)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fsdp_amp_suite.version_table", description=__doc__.splitlines()[0])
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
