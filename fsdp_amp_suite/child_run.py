"""Run a slice of this suite in a child pytest against some --scaler / --fsdp specs; read the outcomes.

The teeth tests (tests/meta/test_mutants.py, test_teeth.py) use it to check that planted
defects fail and the controls pass, in the same run. The child writes its report as data
(--report-json): each record names its test function, scaler spec and FSDP implementation, so nothing
here parses a test id back.
"""
import fcntl
import json
import os
import subprocess
import sys

from fsdp_amp_suite import paths

ROOT = str(paths.ROOT)


def _parent_session(key: str) -> bool:
    """A variable of the parent pytest session (its xdist worker, its addopts), which a child must not inherit."""
    return key.startswith("PYTEST_XDIST") or key == "PYTEST_ADDOPTS"


def clean_env() -> dict:
    """This environment minus what the parent session set: a child pytest starts its own session."""
    return {k: v for k, v in os.environ.items() if not _parent_session(k)}


def runpytest(pytester, monkeypatch, *args, timeout: float = 600):
    """pytest's own pytester (RunResult: .ret, .outlines, .errlines, assert_outcomes) on this suite's files
    (absolute paths under ROOT: its pytest.ini and conftest apply), in a child process of its own session."""
    for key in [k for k in os.environ if _parent_session(k)]:
        monkeypatch.delenv(key)
    # the child imports this checkout's library (its -p fsdp_amp_suite.plugin), installed here or not: it runs in
    # pytester's directory, where the checkout is not the working directory
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=timeout)


def child_run(out, paths: list, selection: str, scalers=(), fsdps=(), marker="not slow", extra=()) -> list[dict]:
    """The child's records (fsdp_amp_suite/report.py as_data: nodeid, test, outcome, scaler, impl, ...), outcome in
    passed / failed / skipped / xfailed; `out` is where the child writes its --report-json. One xdist worker: under the
    meta job's --dist loadfile the other core runs other files, and a second worker would start torch and its rank
    pools again; a worker (not -p no:xdist) keeps a check that crashes its process from ending the child run."""
    cmd = [sys.executable, "-m", "pytest", *paths, "-m", marker, "-k", selection, "-q",
           "-p", "no:cacheprovider", "-n", "1", f"--report-json={out}"]
    for spec in scalers:
        cmd += ["--scaler", spec]
    for spec in fsdps:
        cmd += ["--fsdp", spec]
    cmd += list(extra)
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode in (0, 1), proc.stdout[-5000:] + proc.stderr[-5000:]
    with open(out) as f:
        return json.load(f)["records"]


def once_per_run(tmp_path_factory, name: str, make):
    """make()'s JSON value, made once per pytest run: the module fixture of every xdist worker that draws one of its
    tests asks for it, and the first one calls make() while the others wait on a file lock and read what it wrote
    (xdist's advice for a fixture that must run once). Without this, two workers each made the same minutes-long
    child run."""
    shared = _run_dir(tmp_path_factory)
    out = shared / f"{name}.value.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file() and out.stat().st_size:
            with open(out) as f:
                return json.load(f)
        value = make()
        out.write_text(json.dumps(value))
        return value


def child_run_once(tmp_path_factory, name: str, paths: list, selection: str, **kwargs) -> list[dict]:
    """child_run, once per pytest run (once_per_run)."""
    out = _run_dir(tmp_path_factory) / f"{name}.json"
    return once_per_run(tmp_path_factory, name, lambda: child_run(out, paths, selection, **kwargs))


def _run_dir(tmp_path_factory):
    """The pytest run's temporary directory, which its xdist workers share (not the worker's own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def outcomes(records: list[dict], **match) -> list[str]:
    """The outcomes of the records whose fields equal match's, e.g. outcomes(recs, scaler=s, test=t)."""
    return [r["outcome"] for r in records if all(r.get(k) == v for k, v in match.items())]
