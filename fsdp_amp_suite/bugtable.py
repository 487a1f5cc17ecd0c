"""The README's table of known upstream bugs, generated from KNOWN_BUGS (fsdp_amp_suite/known_bugs.py) and the
`repro_of` marks that `@case` sets on the repro cases (tests/repro/test_*.py).

    python -m fsdp_amp_suite.bugtable                     print the table (Markdown)
    python -m fsdp_amp_suite.bugtable --write README.md   replace the table between the two marker lines
    python -m fsdp_amp_suite.bugtable --check README.md   exit 1, printing a unified diff, if the README's copy differs

Run from the repository root. The README holds the table between a `<!-- known-bugs:start -->` line
and a `<!-- known-bugs:end -->` line (either may carry a note inside the comment, as in
`<!-- known-bugs:start (generated: ...) -->`); everything else in the file is left as it is. Each bug's write-up is
its `## <id>` section of docs/bugs.md, which the `bug` column links to. tests/meta/test_bugtable.py
checks that the README's copy is current.
"""
from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass
from pathlib import Path

from fsdp_amp_suite import known_bugs, paths
from fsdp_amp_suite.known_bugs import KNOWN_BUGS, KnownBug
from fsdp_amp_suite.scalers import BUILTINS

REPO, REPRO_DIR = paths.ROOT, paths.REPRO_DIR
DOC = "docs/bugs.md"  # relative to the repository root, as the README links it
START = "<!-- known-bugs:start -->"
END = "<!-- known-bugs:end -->"
HEADER = ("bug", "what", "hits", "torch", "fairscale", "real training", "standalone", "repro")
EVERY_SCALER = "every scaler (an FSDP bug)"
NO_REPRO = "conformance / matrix"


class MarkersMissing(ValueError):
    """The file has no (or no well-formed) pair of marker lines to put the table between."""


@dataclass(frozen=True)
class ReproMark:
    """One repro case's `repro_of` mark (set by `@case`): the bugs (KNOWN_BUGS ids) it shows."""
    file: str  # relative to the repository root: tests/repro/test_x.py
    test: str  # the test function
    ids: tuple  # the mark's ids, in its order (the first is the case's own bug)


@dataclass(frozen=True)
class Row:
    """One bug's row of the table, as plain data (render() turns rows into Markdown)."""
    bug: str
    what: str
    hits: tuple  # the built-in scalers it names, in BUILTINS order; () for an FSDP implementation's bug
    torch: str  # PEP 440 specifier, "" for every supported version
    fairscale: str
    repro: tuple  # repro files (relative to the repository root) whose repro_of names the bug
    reach: str = ""  # can real training hit it: a known_bugs Reach kind
    standalone: str = ""  # its standalone repro (relative to the repository root)
    report: str = ""  # its upstream report or comment draft, where it has one (relative to the repository root)


def _marks_of(obj) -> list:
    marks = getattr(obj, "pytestmark", [])
    return list(marks) if isinstance(marks, (list, tuple)) else [marks]


def _repro_ids(marks) -> tuple:
    return tuple(bug_id for mark in marks if mark.name == "repro_of" for bug_id in mark.args)


def _load(path: Path):
    """A repro file, loaded by its path."""
    return paths.load_file(path, f"_bugtable_{path.stem}")


def repro_marks(repro_dir: Path = REPRO_DIR) -> list[ReproMark]:
    """The repro_of marks of every test function in repro_dir/test_*.py (the modules are imported), plus a
    module-level repro_of (in its pytestmark), which applies to each of its test functions."""
    out = []
    for path in sorted(Path(repro_dir).glob("test_*.py")):
        module = _load(path)
        file = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
        module_ids = _repro_ids(_marks_of(module))  # pytest.mark.* decorators and Marks both have name and args
        for name, fn in sorted(vars(module).items()):
            if name.startswith("test_") and callable(fn) and getattr(fn, "__module__", None) == module.__name__:
                ids = module_ids + _repro_ids(_marks_of(fn))
                if ids:
                    out.append(ReproMark(file, name, ids))
    return out


def repro_files(bug_id: str, marks: list[ReproMark]) -> tuple:
    """The files whose repro_of names this bug: those where it is a case's own (first) bug, then the others."""
    own = sorted({m.file for m in marks if m.ids[0] == bug_id})
    also = sorted({m.file for m in marks if bug_id in m.ids[1:]} - set(own))
    return tuple(own + also)


def row(bug: KnownBug, marks: list[ReproMark]) -> Row:
    hits = () if bug.scalers is known_bugs.EVERY_SCALER else tuple(s for s in BUILTINS if s in bug.scalers)
    from fsdp_amp_suite.upstream.reports import reported

    report = (f"docs/upstream/{bug.id}.md" if bug in reported() else
              f"docs/upstream/comments/{bug.comment_on}.md" if bug.comment_on else "")
    return Row(bug.id, bug.title, hits, bug.torch, bug.fairscale, repro_files(bug.id, marks), bug.reach.overflow,
               f"{known_bugs.STANDALONE_DIR}/{bug.standalone_file}.py", report)


def rows(bugs=None, marks=None) -> list[Row]:
    """One row per KNOWN_BUGS entry (or per entry of the given table), in its order."""
    marks = repro_marks() if marks is None else marks
    return [row(bug, marks) for bug in (KNOWN_BUGS if bugs is None else bugs)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(table: list[Row]) -> str:
    """The Markdown table (no trailing newline)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in table:
        written = "comment" if "/comments/" in r.report else "report"
        cells = (f"[`{r.bug}`]({DOC}#{r.bug})",
                 _cell(r.what),
                 ", ".join(f"`{s}`" for s in r.hits) if r.hits else EVERY_SCALER,
                 f"`{r.torch}`" if r.torch else "any",
                 f"`{r.fairscale}`" if r.fairscale else "any",
                 r.reach,
                 f"[`{Path(r.standalone).name}`]({r.standalone})" + (f", [{written}]({r.report})" if r.report else ""),
                 ", ".join(f"[`{Path(f).name}`]({f})" for f in r.repro) if r.repro else NO_REPRO)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _is_marker(line: str, marker: str) -> bool:
    """The marker line itself, or the marker with a note inside the comment: `<!-- known-bugs:start (...) -->`."""
    line, head = line.strip(), marker[:-len("-->")].rstrip()
    return line == marker or (line.startswith(head + " ") and line.endswith("-->"))


def _marker_lines(lines: list[str], name: str) -> tuple[int, int]:
    starts = [i for i, line in enumerate(lines) if _is_marker(line, START)]
    ends = [i for i, line in enumerate(lines) if _is_marker(line, END)]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise MarkersMissing(
            f"{name}: expected one line {START!r} and, after it, one line {END!r} "
            f"(found {len(starts)} and {len(ends)}"
            f"{', in the wrong order' if starts and ends and ends[0] < starts[0] else ''}); "
            f"put the two marker lines where the known-bugs table belongs, then run "
            f"`python -m fsdp_amp_suite.bugtable --write {name}`")
    return starts[0], ends[0]


def with_table(text: str, table: str, name: str = "the file") -> str:
    """text with the lines between its marker lines replaced by the table (a blank line either side)."""
    lines = text.splitlines(keepends=True)
    start, end = _marker_lines(lines, name)
    return "".join(lines[:start + 1]) + "\n" + table + "\n\n" + "".join(lines[end:])


def diff(text: str, table: str, name: str = "README.md") -> str:
    """A unified diff from the file's text to the text it should have ("" when it is current)."""
    expected = with_table(text, table, name)
    return "".join(difflib.unified_diff(text.splitlines(keepends=True), expected.splitlines(keepends=True),
                                        fromfile=f"{name} (as it is)", tofile=f"{name} (generated)"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_amp_suite.bugtable", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="FILE", help="replace the table between the markers in FILE")
    group.add_argument("--check", metavar="FILE", help="exit 1 with a unified diff if FILE's table is not current")
    args = parser.parse_args(argv)
    table = render(rows())
    if not (args.write or args.check):
        print(table)
        return 0
    path = Path(args.write or args.check)
    try:
        text = path.read_text(encoding="utf-8")
        if args.write:
            new = with_table(text, table, str(path))
            if new != text:
                path.write_text(new, encoding="utf-8")
            print(f"{path}: known-bugs table {'written' if new != text else 'already current'} "
                  f"({len(KNOWN_BUGS)} bugs)")
            return 0
        delta = diff(text, table, str(path))
    except (OSError, MarkersMissing) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if delta:
        sys.stdout.write(delta)
        print(f"\n{path}: the known-bugs table is not current: run `python -m fsdp_amp_suite.bugtable --write {path}`")
        return 1
    print(f"{path}: the known-bugs table is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
