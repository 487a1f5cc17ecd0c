"""The known bugs are written up inside the repository, and nowhere else.

Proves that (a) README.md's known-bugs table is the one `python -m fsdp_amp_suite.bugtable` generates from
KNOWN_BUGS and the repro cases' marks; (b) docs/bugs.md has a `## <id>` section for every KNOWN_BUGS
entry, and every section names an entry, in KNOWN_BUGS order; (c) every `@pytest.mark.repro_of` id
in tests/repro names a KNOWN_BUGS entry; (d) no tracked file cites a document from outside the
repository (the working notes this project started from). Each check is also run once on a broken
copy, to show that it fails and names what is wrong.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fsdp_amp_suite import bugtable
from fsdp_amp_suite.known_bugs import EVERY_SCALER, KNOWN_BUGS

REPO = bugtable.REPO
README = REPO / "README.md"
DOC = REPO / "docs" / "bugs.md"
# built from pieces so that this file does not match its own search
OUTSIDE_CITATIONS = ("FIND" + "INGS", "the " + "seed", "seed" + "'s")


# ------------------------------------------------------------------ (a) the README's table is current

def test_readme_table_is_generated_from_known_bugs():
    text = README.read_text(encoding="utf-8")
    try:
        delta = bugtable.diff(text, bugtable.render(bugtable.rows()), "README.md")
    except bugtable.MarkersMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    if delta:
        pytest.fail("README.md's known-bugs table is not the generated one: run "
                    "`python -m fsdp_amp_suite.bugtable --write README.md`\n" + delta, pytrace=False)


def test_a_stale_readme_table_is_a_diff_and_write_fixes_it(tmp_path):
    table = bugtable.render(bugtable.rows())
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{bugtable.START}\n| old | table |\n{bugtable.END}\n\nafter\n", encoding="utf-8")
    assert bugtable.main(["--check", str(readme)]) == 1
    assert "-| old | table |" in bugtable.diff(readme.read_text(), table)
    bugtable.main(["--write", str(readme)])
    text = readme.read_text()
    assert text.startswith(f"# title\n\n{bugtable.START}\n") and text.endswith(f"{bugtable.END}\n\nafter\n")
    assert bugtable.diff(text, table) == "" and bugtable.main(["--check", str(readme)]) == 0


def test_missing_markers_are_a_clear_error(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n", encoding="utf-8")
    assert bugtable.main(["--write", str(readme)]) == 2
    assert "known-bugs:start" in capsys.readouterr().err and readme.read_text() == "# no markers here\n"
    with pytest.raises(bugtable.MarkersMissing, match="wrong order"):
        bugtable.with_table(f"{bugtable.END}\n{bugtable.START}\n", "t")


def test_rows_are_data_and_render_is_markdown():
    bug = next(b for b in KNOWN_BUGS if b.scalers is EVERY_SCALER)  # an FSDP implementation's bug
    marks = [bugtable.ReproMark("tests/repro/test_b.py", "test_x", ("other", bug.id)),
             bugtable.ReproMark("tests/repro/test_a.py", "test_y", (bug.id,))]
    (r,) = bugtable.rows([bug], marks)
    assert r.repro == ("tests/repro/test_a.py", "tests/repro/test_b.py")  # its own case first
    line = bugtable.render([r]).splitlines()[2]
    assert line.startswith(f"| [`{bug.id}`](docs/bugs.md#{bug.id}) | {bug.title} | {bugtable.EVERY_SCALER} |")
    assert (f"| {bug.reach.overflow} | [`{bug.standalone_file}.py`]"
            f"(fsdp_amp_suite/repro/standalone/{bug.standalone_file}.py)" in line)
    row = bugtable.Row("x", "a | b", ("ours",), "<2.6", "", (), "reachable",
                       "fsdp_amp_suite/repro/standalone/x.py", "docs/upstream/x.md")
    assert bugtable.render([row]).splitlines()[2] == (
        "| [`x`](docs/bugs.md#x) | a \\| b | `ours` | `<2.6` | any | reachable | "
        "[`x.py`](fsdp_amp_suite/repro/standalone/x.py), "
        "[report](docs/upstream/x.md) | conformance / matrix |")


# ------------------------------------------------------------------ (b) one docs/bugs.md section per id

def section_problems(doc_text: str, ids: list[str]) -> list[str]:
    """What is wrong between the `## <id>` sections of the doc and the ids: missing, stray, out of order."""
    sections = re.findall(r"^## (.+?)\s*$", doc_text, flags=re.MULTILINE)
    problems = [f"KNOWN_BUGS {i!r} has no '## {i}' section in docs/bugs.md" for i in ids if i not in sections]
    problems += [f"docs/bugs.md section '## {s}' names no KNOWN_BUGS entry" for s in sections if s not in ids]
    problems += [f"docs/bugs.md has two '## {s}' sections" for s in sorted(set(sections)) if sections.count(s) > 1]
    if not problems and sections != ids:
        problems.append(f"docs/bugs.md's sections are not in KNOWN_BUGS order: {sections} vs {ids}")
    return problems


def test_docs_have_one_section_per_known_bug():
    problems = section_problems(DOC.read_text(encoding="utf-8"), [b.id for b in KNOWN_BUGS])
    assert not problems, "\n".join(problems)


def test_each_section_says_whether_real_training_reaches_it_and_names_its_standalone_repro():
    from fsdp_amp_suite.known_bugs import STANDALONE_DIR

    doc = DOC.read_text(encoding="utf-8")
    for bug in KNOWN_BUGS:
        section = " ".join(doc.split(f"\n## {bug.id}\n", 1)[1].split("\n## ", 1)[0].split())
        assert f"- Real training: **{bug.reach.overflow}**." in section, f"docs/bugs.md ## {bug.id}: its reach"
        assert f"`python {STANDALONE_DIR}/{bug.standalone_file}.py`" in section, f"docs/bugs.md ## {bug.id}: its file"


def test_a_missing_or_stray_section_is_named():
    doc = DOC.read_text(encoding="utf-8")
    first, second = KNOWN_BUGS[0].id, KNOWN_BUGS[1].id
    broken = doc.replace(f"## {first}\n", "## no-such-bug\n")
    assert section_problems(broken, [b.id for b in KNOWN_BUGS]) == [
        f"KNOWN_BUGS {first!r} has no '## {first}' section in docs/bugs.md",
        "docs/bugs.md section '## no-such-bug' names no KNOWN_BUGS entry"]
    swapped = (doc.replace(f"## {first}\n", "## @\n").replace(f"## {second}\n", f"## {first}\n")
               .replace("## @\n", f"## {second}\n"))
    assert "not in KNOWN_BUGS order" in section_problems(swapped, [b.id for b in KNOWN_BUGS])[0]


# ------------------------------------------------------------------ (c) repro_of names known ids

def unknown_repro_ids(marks, ids) -> list[str]:
    return [f"{m.file}::{m.test}: repro_of({i!r}) names no KNOWN_BUGS entry" for m in marks for i in m.ids
            if i not in ids]


def test_every_repro_of_id_names_a_known_bug():
    marks = bugtable.repro_marks()
    assert marks, "no repro_of marks found in tests/repro"
    unknown = unknown_repro_ids(marks, {b.id for b in KNOWN_BUGS})
    assert not unknown, "\n".join(unknown)


def test_an_unknown_repro_id_is_named(tmp_path):
    repro = tmp_path / "repro"
    repro.mkdir()
    src = REPO / "tests" / "repro" / "test_bf16_grads_on_cuda.py"
    renamed = src.read_text().replace('bugs=["bf16-cuda-unscale-kernel"]', 'bugs=["bf16-kernel-renamed"]')
    assert renamed != src.read_text(), "the case's @case(..., bugs=[...]) text moved: update this test"
    (repro / "test_renamed_bug.py").write_text(renamed)
    marks = bugtable.repro_marks(repro)
    assert unknown_repro_ids(marks, {b.id for b in KNOWN_BUGS}) == [
        f"{repro / 'test_renamed_bug.py'}::test_clean_step_with_bf16_grads_on_cuda: "
        "repro_of('bf16-kernel-renamed') names no KNOWN_BUGS entry"]


# ------------------------------------------------------------------ (d) no citation of outside documents

def outside_citations(repo: Path) -> list[str]:
    """`git grep` lines (file:line:text) of tracked files that cite an outside document."""
    args = ["git", "grep", "-n", "-i", "-I"] + [a for p in OUTSIDE_CITATIONS for a in ("-e", p)]
    out = subprocess.run(args, cwd=repo, capture_output=True, text=True)
    if out.returncode not in (0, 1):  # 1: no match
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.splitlines()


def _git_checkout(path: Path) -> bool:
    if shutil.which("git") is None:
        return False
    out = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=path, capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "true"


def test_no_tracked_file_cites_outside_documents():
    if not _git_checkout(REPO):
        pytest.skip("not a git checkout: nothing to git grep")
    found = outside_citations(REPO)
    assert not found, ("tracked files cite documents from outside the repository; name the bug by its "
                       "KNOWN_BUGS id (docs/bugs.md) or the upstream thread instead:\n" + "\n".join(found))


def test_a_citation_is_found(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("no git")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "a.py").write_text("x = 1\n# as " + OUTSIDE_CITATIONS[0].lower() + " bug 2 says\n")
    (tmp_path / "b.md").write_text("clean\n")
    subprocess.run(["git", "add", "a.py", "b.md"], cwd=tmp_path, check=True)
    assert outside_citations(tmp_path) == ["a.py:2:# as " + OUTSIDE_CITATIONS[0].lower() + " bug 2 says"]
