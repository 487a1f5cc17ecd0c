"""The report's data, one type for its writer and its readers: a Record per check and a Report per run
(fsdp_amp_suite/report.py writes them, `--report-json` carries them as plain data, fsdp_amp_suite/version_table.py
reads them back with the same code), and the one table renderer (Markdown or plain text) both print with.

Only the standard library: the version table runs where neither pytest nor torch is installed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

OUTCOMES = ("passed", "failed", "xfailed", "skipped")


@dataclass(frozen=True)
class Cell:
    """The family of an FSDP-vs-DDP matrix cell: its precision and its offload (a report column each pair)."""
    precision: str
    offload: str

    def __str__(self) -> str:
        return f"{self.precision} {self.offload}"

    def as_data(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Record:
    """One check of a run: its id, its worst outcome (passed / failed / xfailed / skipped) and what it is: the test
    function (its name, and its id without params), the scaler spec, the FSDP implementation of a matrix cell, the
    family it counts in (a report column, a matrix Cell, or the file of any other test), the known bug it xfails as
    here and on any version, its --xfails-file entry, the xfail reason."""
    nodeid: str
    outcome: str
    test: str | None = None
    function: str | None = None
    scaler: str | None = None
    impl: str | None = None
    mesh: str | None = None  # a matrix cell's mesh (axes.AXES["mesh"]); None in reports from before the axis: 1d
    family: str | Cell | None = None
    bug: str | None = None
    bug_any_version: str | None = None
    xfails_file: str | None = None
    reason: str | None = None
    deaths: tuple = ()  # a failed check whose ranks died: fsdp_amp_suite/harness/failures.py Death.as_data() of each
    rerun: str | None = None  # the command that reruns it alone, in fresh ranks (set where ranks died)
    race_free: bool = False  # run with its copies made blocking (fsdp_amp_suite/expectations.py rule 2)

    def as_data(self) -> dict:
        return dataclasses.asdict(self)  # a Cell family becomes {precision, offload}

    @property
    def died_in_upstream_code(self) -> bool:
        """Every rank that died did so in torch's, fairscale's or native code: not a scaler verdict."""
        return bool(self.deaths) and all(d["owner"] != "other" for d in self.deaths)

    @classmethod
    def from_data(cls, data: dict) -> Record:
        """From as_data's dict, or from a test's user_properties (fsdp_amp_suite/report.py label) plus id and
        outcome."""
        known = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        family = known["family"]
        return cls(**dict(known, family=Cell(**family) if isinstance(family, dict) else family,
                          deaths=tuple(known["deaths"] or ()), race_free=bool(known["race_free"])))


@dataclass(frozen=True)
class Bug:
    """A known bug as a run saw it: in_force is whether it holds for that run's versions."""
    id: str
    reason: str = ""
    torch: str = ""
    fairscale: str = ""
    in_force: bool | None = None


@dataclass(frozen=True)
class Unmatched:
    """An --xfails-file entry that matched no test of the run (a renamed test, a deselected one, a typo)."""
    line: int
    check: str


@dataclass(frozen=True)
class Report:
    """A whole run (`--report-json`): what it ran on, its exit status (None: not known) and headline, the known
    bugs, every record, the --xfails-file entries that matched nothing."""
    versions: dict
    exitstatus: int | None
    headline: str = ""
    known_bugs: tuple[Bug, ...] = ()
    records: tuple[Record, ...] = ()
    xfails_file_unmatched: tuple[Unmatched, ...] = ()

    def as_data(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_data(cls, data: dict) -> Report:
        return cls(versions=data["versions"], exitstatus=data.get("exitstatus"), headline=data.get("headline", ""),
                   known_bugs=tuple(Bug(**b) for b in data.get("known_bugs", ())),
                   records=tuple(Record.from_data(r) for r in data.get("records", ())),
                   xfails_file_unmatched=tuple(Unmatched(**u) for u in data.get("xfails_file_unmatched", ())))


def heading(title: str, markdown: bool) -> str:
    return f"### {title}" if markdown else f"{title}:"


def table(header: list, rows: list[list], markdown: bool) -> list[str]:
    """The lines of a table; a cell is anything with a str()."""
    header, rows = [str(x) for x in header], [[str(x) for x in row] for row in rows]
    if markdown:
        return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in [header] + rows]
