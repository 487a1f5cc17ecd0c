"""Throughput of the FSDP-vs-DDP matrix on this machine: cells run per minute of wall time.

    python benchmarks/matrix.py [-n auto] [-k EXPR] [extra pytest args ...]

Runs `pytest -m matrix tests/matrix/test_matrix.py` in a child process (2 cores: `-n auto`), reads
each cell's outcome from its JUnit XML, and counts the cells that ran (passed, failed or xfailed;
skips cost nothing and are not counted). Last line: cells_per_minute=<cells run / wall minutes>.
"""
import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.child_run import clean_env, junit_outcomes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", default="auto", help="xdist workers (default auto)")
    ap.add_argument("-k", default=None, help="select cells, as pytest -k")
    args, extra = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "matrix.xml")
        cmd = [sys.executable, "-m", "pytest", "tests/matrix/test_matrix.py", "-m", "matrix", "-q", "-n", args.n,
               "-p", "no:cacheprovider", f"--junitxml={xml}", *extra] + (["-k", args.k] if args.k else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 1):
            sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
        counts = collections.Counter((params.split("-")[0], outcome) for _, params, outcome in junit_outcomes(xml))
    for impl in sorted({i for i, _ in counts}):
        print(f"{impl:10s} " + "  ".join(f"{o} {counts[impl, o]}" for o in ("passed", "xfailed", "failed", "skipped")))
    ran = sum(n for (_, o), n in counts.items() if o != "skipped")
    print(f"{ran} cells ran in {wall:.1f} s wall (-n {args.n}), start-up included")
    print(f"cells_per_minute={ran / (wall / 60):.0f}")


if __name__ == "__main__":
    main()
