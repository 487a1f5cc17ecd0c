"""Version specifiers decide where a known bug holds: a bug fixed in the installed torch is expected
to pass here (its strict xfail is gone), and is still known for the version table (any_version)."""
import dataclasses

from packaging.version import Version

from fsdp_amp_suite import known_bugs, versions

CHECK = ("torch_amp", "test_clean_step_unscales_exactly_and_steps", {"scaler": "torch_amp", "dtype": "float16"})


def _with_torch_spec(spec):
    """A table of its own holding the entry with another torch specifier (the real KNOWN_BUGS is untouched)."""
    changed = dataclasses.replace(known_bugs.bug_by_id("torch-amp-refuses-fp16-grads"), torch=spec)
    return changed, [changed]


def test_a_bug_fixed_in_the_installed_torch_is_expected_to_pass():
    bug, table = _with_torch_spec(f"<{versions.installed('torch')}")
    assert not bug.in_force
    assert known_bugs.known_bug(*CHECK, cuda=False, bugs=table) is None
    assert known_bugs.known_bug(*CHECK, cuda=False, any_version=True, bugs=table) is bug


def test_a_bug_that_holds_on_the_installed_torch_is_a_strict_xfail():
    bug, table = _with_torch_spec(f">={versions.installed('torch')}")
    assert bug.in_force and known_bugs.known_bug(*CHECK, cuda=False, bugs=table) is bug


def test_specifiers_compare_releases_not_local_labels():
    torch = versions.installed("torch")
    assert versions.holds(torch=f"=={torch.major}.{torch.minor}.*")  # 2.13.0+cpu is in ==2.13.*
    assert versions.holds(torch="") and versions.holds(torch=">=2.4", fairscale="==0.4.13")
    assert not versions.holds(torch=f">{torch}") and not versions.holds(fairscale="<0.4")


def test_the_checked_torch_versions_are_one_list_that_the_docs_checkpoints_and_nox_follow():
    """pyproject.toml's checked-torch is the one list: oldest first, the floor of `torch>=2.4` and the pin among
    them; docs/versions.md and docs/bugs.md name it, a checkpoint of every built-in is saved by each, nox runs it."""
    import pathlib
    import re
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    checked = versions.CHECKED_TORCH
    assert list(checked) == sorted(checked, key=Version) and checked[0].startswith("2.4."), checked
    pin = re.search(r"^torch==(\S+)$", (root / "requirements.txt").read_text(), re.M)[1]
    assert pin in checked, f"requirements.txt pins torch {pin}, which checked-torch {checked} does not name"
    assert f"torch {', '.join(checked)}**" in (root / "docs" / "versions.md").read_text()
    assert f"{checked[0]} .. {checked[-1]}" in (root / "docs" / "bugs.md").read_text()
    saved = {p.stem.rsplit("-torch-", 1)[1]
             for p in (root / "fsdp_amp_suite/conformance/checkpoints").glob("*-torch-*.pt")}
    assert saved == set(checked), f"checkpoints saved by torch {sorted(saved)}; checked-torch is {checked}"
    nox = (root / "noxfile.py").read_text()
    assert "checked-torch" in nox and not re.search(r"TORCH_VERSIONS = \[", nox)
    assert (tomllib.loads((root / "pyproject.toml").read_text())["tool"]["fsdp-amp-suite"]["checked-torch"]
            == list(checked))
