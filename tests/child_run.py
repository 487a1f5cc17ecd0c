"""Run a slice of this suite in a child pytest against some --scaler / --fsdp specs; read the outcomes.

The teeth tests (conformance/test_mutants.py, matrix/test_teeth.py) use it to check that planted
defects fail and the controls pass, in the same run, from the child's JUnit XML.
"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env() -> dict:
    """This environment minus what the parent pytest-xdist set: a child pytest starts its own session."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "PYTEST_ADDOPTS"}


def junit_outcomes(xml) -> list[tuple[str, str, str]]:
    """[(test function, param id, outcome)] with outcome passed / failed / skipped / xfailed."""
    out = []
    for case in ET.parse(xml).iter("testcase"):
        test, _, params = case.get("name").partition("[")
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped")
        outcome = ("failed" if failed else "passed" if skipped is None
                   else "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped")
        out.append((test, params.rstrip("]"), outcome))
    return out


def child_run(xml, paths: list, selection: str, scalers=(), fsdps=(), marker="not slow") -> dict:
    """{(scaler spec, test function, impl spec or None): [outcome per item]} with outcome in
    passed / failed / skipped / xfailed. Each item's id must end with the scaler's id."""
    cmd = [sys.executable, "-m", "pytest", *paths, "-m", marker, "-k", selection, "-q",
           "-p", "no:cacheprovider", "-n", "2", f"--junitxml={xml}"]
    for spec in scalers:
        cmd += ["--scaler", spec]
    for spec in fsdps:
        cmd += ["--fsdp", spec]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode in (0, 1), proc.stdout[-5000:] + proc.stderr[-5000:]
    scaler_ids = sorted(((s.replace(":", "-"), s) for s in scalers), key=lambda p: -len(p[0]))
    fsdp_ids = [(s.replace(":", "-"), s) for s in fsdps]
    result = {}
    for test, params, outcome in junit_outcomes(xml):
        spec = next(s for i, s in scaler_ids if params == i or params.startswith(i + "-") or params.endswith("-" + i))
        impl = next((s for i, s in fsdp_ids if params.startswith(i + "-")), None)
        result.setdefault((spec, test, impl), []).append(outcome)
    return result
