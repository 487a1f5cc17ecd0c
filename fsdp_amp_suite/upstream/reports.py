"""Upstream reports of the known bugs, from their KNOWN_BUGS entries, standalone files and recorded runs.

    python -m fsdp_amp_suite.upstream.reports ID                  print the report of one entry
                                                                  (docs/upstream/ID.md's text)
    python -m fsdp_amp_suite.upstream.reports --write docs/upstream   write the report of every entry that gets one
    python -m fsdp_amp_suite.upstream.reports --check docs/upstream   exit 1 naming each report that is not current
    python -m fsdp_amp_suite.upstream.reports --record RUNS.json --merge DIR   add the runs a main job recorded into DIR
    python -m fsdp_amp_suite.upstream.reports --record RUNS.json [--python PY ...]
                                                       run every standalone file (each of its modes) under each
                                                       interpreter (default: this one) and merge the outcomes
                                                       into RUNS.json; prints the table of exit statuses against
                                                       what KNOWN_BUGS expects for that torch

A report is written for every entry that owns a standalone file, unless it is torch's behaviour by design
or fixed upstream. Its "seen on" versions and outputs come from docs/upstream/runs.json, the recorded runs
(--record), so the reports say only what was run.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from fsdp_amp_suite.known_bugs import STANDALONE_DIR, KnownBug, bug_by_id, standalone_files
from fsdp_amp_suite.upstream.runs import (MINIMAL, MINIMAL_DIR, PLAIN, ROOT, SKIP_STATUS, minimal_path, modes, path_of,
                                         run_file)

RUNS = ROOT / "docs" / "upstream" / "runs.json"
ENVS = ROOT / "docs" / "upstream" / "collect_env"  # one collect_env output per (torch, device) that ran the files
COMMENTS = ROOT / "docs" / "upstream" / "comments"  # hand-written: the new evidence only, for the thread's readers
SECTIONS = ("Root cause", "Fix", "Related")


@dataclass(frozen=True)
class Doc:
    """A standalone file's docstring, split: its title line, the paragraphs before the report sections, and each
    section (SECTIONS) as one paragraph."""
    title: str
    body: str
    sections: dict


def doc(stem: str) -> Doc:
    """The docstring of fsdp_amp_suite/repro/standalone/<stem>.py; ValueError naming the file and what is missing."""
    import ast

    path = path_of(stem)
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not text:
        raise ValueError(f"{path}: no module docstring")
    title, _, rest = text.partition("\n")
    heads = "|".join(SECTIONS)
    parts = re.split(rf"^({heads}):[ \t]*", rest, flags=re.M)
    body, found = parts[0].strip(), {}
    for head, para in zip(parts[1::2], parts[2::2]):
        found[head] = " ".join(para.split())
    missing = [s for s in SECTIONS if not found.get(s)]
    if missing:
        raise ValueError(f"{path}: its docstring has no {', '.join(s + ':' for s in missing)} paragraph "
                         f"(docs/upstream/README.md: the report's sections end the docstring)")
    return Doc(title.strip(), body, found)


def reported() -> list[KnownBug]:
    """The entries that get an upstream report: each owns its file, and is neither by design nor fixed upstream,
    nor new evidence for a thread already open (commented())."""
    return [shown[0] for stem, shown in standalone_files().items()
            if not shown[0].by_design and not shown[0].torch and not shown[0].comment_on]


def commented() -> list[KnownBug]:
    """The entries whose write-up upstream is a comment on a thread already open: a draft in COMMENTS."""
    return [shown[0] for shown in standalone_files().values() if shown[0].comment_on]


# ------------------------------------------------------------------------------------------------ runs

def run(stem: str, mode: str, python: str = sys.executable) -> dict:
    """One run of a standalone file, as runs.json records it."""
    return as_record(stem, mode, run_file(stem, mode, python), python)


@functools.lru_cache(maxsize=None)
def _versions_of(python: str) -> tuple:
    """(torch, fairscale or "-", device) of an interpreter: one start-up of it per process, not one per record."""
    with tempfile.TemporaryDirectory() as cwd:
        return tuple(subprocess.run([python, "-c", _VERSIONS], cwd=cwd, capture_output=True, text=True,
                                    check=True).stdout.split())


def as_record(stem: str, mode: str, proc, python: str = sys.executable) -> dict:
    versions = _versions_of(python)
    return {"file": stem, "mode": mode, "torch": versions[0], "fairscale": versions[1], "device": versions[2],
            "python": versions[3],
            "status": proc.returncode, "output": proc.stdout.strip() or proc.stderr.strip()[-2000:]}


def record(stem: str, mode: str, proc, directory: Path) -> None:
    """The run's record as directory/<stem>-<mode>.json (the main job's runs, FSDP_AMP_STANDALONE_RECORD);
    `--merge DIR` adds them to runs.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{stem}-{mode}.json").write_text(json.dumps(as_record(stem, mode, proc)), encoding="utf-8")


_VERSIONS = ("import importlib.metadata as m, platform, torch\n"
             "try: fs = m.version('fairscale')\nexcept m.PackageNotFoundError: fs = '-'\n"
             "print(torch.__version__, fs, torch.cuda.get_device_name(0).replace(' ', '_') "
             "if torch.cuda.is_available() else 'cpu', platform.python_version())")


def env_path(torch_version: str, device: str) -> Path:
    """Where the collect_env output of an interpreter with this torch on this device is kept."""
    return ENVS / f"{torch_version}_{device}.txt"


def record_env(python: str = sys.executable) -> Path:
    """`python -m torch.utils.collect_env` of an interpreter, kept for the reports (env_path)."""
    torch_version, _, device, _ = _versions_of(python)
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run([python, "-m", "torch.utils.collect_env"], cwd=cwd, capture_output=True, text=True,
                             check=True).stdout
    path = env_path(torch_version, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.strip() + "\n", encoding="utf-8")
    return path


def expected_status(stem: str, record: dict) -> int:
    """What KNOWN_BUGS expects a run of the file to exit with on the record's versions and machine: the main job's
    expectation of that run (fsdp_amp_suite/expectations.py policy 5) as an exit status."""
    from fsdp_amp_suite.expectations import Machine, expectation

    on = {"torch": Version(Version(record["torch"]).base_version),
          "fairscale": None if record["fairscale"] == "-" else Version(record["fairscale"])}
    machine = Machine(cuda=record["device"] != "cpu", n_gpus=int(record["device"] != "cpu"), versions=on)
    expected = expectation(None, "test_standalone_repro_shows_no_bug", {"standalone": stem, "mode": record["mode"]},
                           machine=machine)
    return SKIP_STATUS if expected.skip else int(bool(expected.xfail))


def load_runs(path: Path = RUNS) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else []


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """new replaces old runs of the same file, mode, torch and device."""
    key = lambda r: (r["file"], r["mode"], r["torch"], r["device"])  # noqa: E731
    fresh = {key(r) for r in new}
    return sorted([r for r in old if key(r) not in fresh] + new, key=key)


def table(runs: list[dict]) -> str:
    """Markdown: file x mode rows, one column per (torch, device), each cell the status and whether KNOWN_BUGS
    expected it (`1 ok`, `0 UNEXPECTED (1)`)."""
    cols = sorted({(r["torch"], r["device"]) for r in runs}, key=lambda c: (Version(c[0].split("+")[0]), c[1]))
    rows = sorted({(r["file"], r["mode"]) for r in runs})
    at = {(r["file"], r["mode"], r["torch"], r["device"]): r for r in runs}
    lines = ["| file | mode | " + " | ".join(f"torch {t} {d}" for t, d in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for stem, mode in rows:
        cells = []
        for col in cols:
            r = at.get((stem, mode, *col))
            if r is None:
                cells.append("")
                continue
            want = expected_status(stem, r) if stem in standalone_files() else None
            cells.append(f"{r['status']} ok" if r["status"] == want else f"{r['status']} UNEXPECTED ({want})")
        lines.append(f"| `{stem}` | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- reports

def _device(device: str) -> str:
    return "CPU" if device == "cpu" else device.replace("_", " ")


def _torch_key(version: str):
    return Version(version.split("+")[0])


def _newest(record: dict):
    """Sort key of a recorded run: the newer torch last, and on one torch a GPU run after a CPU one."""
    return _torch_key(record["torch"]), record["device"] != "cpu"


def versions_table(stem: str, runs: list[dict]) -> list[str]:
    """One row per (torch, device) that ran the file: the Python version and each mode's exit status (1: the bug
    shows, 0: it does not, 77: this machine cannot run it). Empty where nothing was recorded."""
    at = {}
    for r in runs:
        at.setdefault((r["torch"], r["device"]), {})[r["mode"]] = r
    if not at:
        return []
    file_modes = modes(standalone_files()[stem])
    lines = ["| torch | device | python | " + " | ".join(m if m in (PLAIN, MINIMAL) else f"`--{m}`" for m in file_modes)
             + " |", "|---|---|---|" + "---|" * len(file_modes)]
    for torch_version, device in sorted(at, key=lambda k: (_torch_key(k[0]), k[1])):
        row = at[(torch_version, device)]
        python = next((r["python"] for r in row.values() if r.get("python")), "not recorded")
        cells = [str(row[m]["status"]) if m in row else "" for m in file_modes]
        lines.append(f"| {torch_version} | {_device(device)} | {python} | " + " | ".join(cells) + " |")
    return lines


def minimal_section(stem: str, runs: list[dict]) -> list[str]:
    """The report's first section where the bug has a minimal repro: the file inline, then what the newest recorded
    run of it that did not skip printed, and its exit status."""
    if not minimal_path(stem).exists():
        return []
    lines = ["## Minimal repro", "", f"`{MINIMAL_DIR}/{stem}.py`, runnable as is:", "", "```python",
             minimal_path(stem).read_text(encoding="utf-8").rstrip(), "```", ""]
    ran = sorted((r for r in runs if r["mode"] == MINIMAL and r["status"] != SKIP_STATUS), key=_newest)
    if ran:
        r = ran[-1]
        lines += [f"On torch {r['torch']} ({_device(r['device'])}):", "", "```", r["output"], "$ echo $?",
                  str(r["status"]), "```", ""]
    return lines


def newest_env(runs: list[dict]) -> tuple | None:
    """(torch, device) of the newest torch that ran the file, not skipping it (77), and has its collect_env kept
    (env_path)."""
    kept = [r for r in runs if r["status"] != SKIP_STATUS and env_path(r["torch"], r["device"]).exists()]
    newest = max(kept, key=_newest) if kept else None
    return (newest["torch"], newest["device"]) if newest else None


def report(bug: KnownBug, runs: list[dict]) -> str:
    """The Markdown report of one entry."""
    stem = bug.standalone_file
    d = doc(stem)
    mine = [r for r in runs if r["file"] == stem]
    also = [b.id for b in standalone_files()[stem][1:]]
    lines = [f"# {d.title}", "",
             f"`KNOWN_BUGS` id `{bug.id}`"
             + (f" (the same defect: {', '.join(f'`{a}`' for a in also)})" if also else "")
             + f"; write-up: [docs/bugs.md](../bugs.md#{bug.id}).", "", d.body, "",
             *minimal_section(stem, mine),
             "## Versions", "", *versions_table(stem, mine)]
    lines += ["", "KNOWN_BUGS claims it on " + (f"torch `{bug.torch}`" if bug.torch else
                                               "every supported torch (its code is unchanged in the 2.4.1 .. 2.15.0 "
                                               "sources)")
              + (f", fairscale `{bug.fairscale}`" if bug.fairscale else "") + "."]
    if bug.needs == "cuda" and not any(r["device"] != "cpu" for r in mine):
        lines.append("Not yet recorded on a GPU (the GPU gate records it: `ci/gpu.sh` writes the runs, `python -m "
                     "fsdp_amp_suite.upstream.reports --record docs/upstream/runs.json --merge OUT/standalone-runs`).")
    env = newest_env(mine)
    if env:
        lines += ["", f"<details><summary>collect_env of the torch {env[0]} run ({_device(env[1])})</summary>", "",
                  "```", env_path(*env).read_text(encoding="utf-8").strip(), "```", "", "</details>"]
    needs = "torch" + (" and fairscale" if "fairscale" in stem else "")
    file_modes = modes(standalone_files()[stem])
    if minimal_path(stem).exists():  # the minimal repro is the report's; the full file is linked, not pasted
        lines += ["", "## Reproduce", "", f"The full standalone file, with nothing but {needs} installed: "
                  f"[`{STANDALONE_DIR}/{stem}.py`](../../{STANDALONE_DIR}/{stem}.py) (its flags: "
                  + ", ".join(f"`--{m}`" for m in file_modes if m not in (PLAIN, MINIMAL))
                  + ").", ""]
    else:
        lines += ["", "## Reproduce", "", f"`{STANDALONE_DIR}/{stem}.py`, with nothing but {needs} installed:", "",
                  "```python", path_of(stem).read_text(encoding="utf-8").rstrip(), "```", ""]
    for mode in [m for m in file_modes if m != MINIMAL]:
        ran = [r for r in mine if r["mode"] == mode and r["status"] != SKIP_STATUS]
        if ran:
            r = ran[-1]
            flag = "" if mode == PLAIN else f" --{mode}"
            lines += [f"On torch {r['torch']} ({_device(r['device'])}):",
                      "", "```", f"$ python {stem}.py{flag}", r["output"], "$ echo $?", str(r["status"]), "```", ""]
    lines += ["## Can real training hit it?", "", f"- Overflow: **{bug.reach.overflow}**.",
              f"- Setups: {bug.reach.setups}."
              + (f" Shown by `python {stem}.py {bug.reach.run}`." if bug.reach.run else ""), "",
              "## Root cause", "", _sentence(d.sections["Root cause"]), "",
              "## Proposed fix", "", _sentence(d.sections["Fix"]) + ("" if "--with-fix" in d.sections["Fix"] else
                                                         f" `python {stem}.py --with-fix` applies it by "
                                                         "monkeypatching."),
              "", "## Related", "", d.sections["Related"], ""]
    return "\n".join(lines)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def check(directory: Path, runs: list[dict], comments: Path = COMMENTS) -> list[str]:
    """What is wrong with `directory`'s reports: each that is missing or differs from what would be written, a
    report that no entry gets (a duplicate turned comment, a removed entry), and a comment draft that is missing
    or does not name its entry's id."""
    out, wanted = [], {f"{bug.id}.md" for bug in reported()}
    for bug in reported():
        path = directory / f"{bug.id}.md"
        if not any(r["file"] == bug.standalone_file for r in runs):
            out.append(f"{path}: no recorded run, so no versions table (--record)")
        if not path.exists() or path.read_text(encoding="utf-8") != report(bug, runs):
            out.append(f"{path}: not current")
    out += [f"{path}: no KNOWN_BUGS entry gets this report" for path in sorted(directory.glob("*.md"))
            if path.name not in wanted and path.name != "README.md"]
    for bug in commented():
        path = comments / f"{bug.comment_on}.md"
        if not path.exists() or f"`{bug.id}`" not in path.read_text(encoding="utf-8"):
            out.append(f"{path}: the comment draft for {bug.id} is missing or does not name it")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_amp_suite.upstream.reports",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("id", nargs="?", help="a KNOWN_BUGS id: print its report")
    parser.add_argument("--write", metavar="DIR", type=Path)
    parser.add_argument("--check", metavar="DIR", type=Path)
    parser.add_argument("--record", metavar="RUNS", type=Path)
    parser.add_argument("--python", action="append", default=[], metavar="PY",
                        help="--record: an interpreter to run the files with (repeatable; default: this one)")
    parser.add_argument("--only", action="append", default=[], metavar="STEM", help="--record: these files only")
    parser.add_argument("--merge", metavar="DIR", type=Path,
                        help="with --record RUNS: add the records a main job wrote into DIR "
                             "(FSDP_AMP_STANDALONE_RECORD)")
    args = parser.parse_args(argv)
    if args.record:
        if args.merge:
            new = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(args.merge.glob("*.json"))]
        else:
            for py in args.python or [sys.executable]:
                print(f"{record_env(py)}: collect_env kept")
            new = [run(stem, mode, py) for py in args.python or [sys.executable]
                   for stem, shown in standalone_files().items() if not args.only or stem in args.only
                   for mode in modes(shown)]
        runs = merge(load_runs(args.record), new)
        args.record.write_text(json.dumps(runs, indent=1) + "\n", encoding="utf-8")
        print(table(new))
        return int(any(r["status"] != expected_status(r["file"], r) for r in new))
    runs = load_runs()
    if args.write or args.check:
        if args.check:
            stale = check(args.check, runs)
            for problem in stale:
                print(f"{problem} (`python -m fsdp_amp_suite.upstream.reports --write {args.check}` writes the "
                      "reports; comment drafts are written by hand)")
            return int(bool(stale))
        args.write.mkdir(parents=True, exist_ok=True)
        for bug in reported():
            (args.write / f"{bug.id}.md").write_text(report(bug, runs), encoding="utf-8")
        for bug in commented():  # its report was a duplicate of an open thread: the comment draft replaces it
            (args.write / f"{bug.id}.md").unlink(missing_ok=True)
        print(f"{args.write}: {len(reported())} reports written; {len(commented())} bugs are comments on open "
              f"threads ({COMMENTS.relative_to(ROOT)})")
        return 0
    if not args.id:
        parser.error("name a KNOWN_BUGS id, or --write/--check/--record")
    try:
        bug = bug_by_id(args.id)
    except ValueError as exc:
        parser.error(str(exc))
    print(report(bug, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
