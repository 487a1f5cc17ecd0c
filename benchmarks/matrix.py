"""Throughput of the FSDP-vs-DDP matrix on this machine: cells run per minute of wall time.

    python -m benchmarks.matrix [-n auto] [-k EXPR] [extra pytest args ...]

Runs `pytest -m matrix tests/matrix/test_matrix.py` in a child process (2 cores: `-n auto`) and counts,
from its report records (--report-json), the cells that ran (passed, failed or xfailed; skips cost
nothing and are not counted); then the same for the wide model's cells alone (`-k wide`, the model
axis), and for the cells on a 2x2 mesh alone (`-k "hsdp or tp"`, the mesh axis). Last lines:
cells_per_minute=<cells run / wall minutes>, then wide_cells_per_minute=<the same, wide cells only> (a wide
cell trains 310 params and a 281600-element weight; a small one 10 params), then mesh_cells_per_minute=<the
same, mesh cells only> (world size 4, with DeviceMesh sub-groups; TP cells redistribute activations).
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

from fsdp_amp_suite import paths
from fsdp_amp_suite.child_run import clean_env

ROOT = str(paths.ROOT)


def run(n: str, k: str | None, extra: list) -> tuple[collections.Counter, float]:
    """One child matrix run: ({(impl, outcome): cells}, wall seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "matrix.json")
        cmd = [sys.executable, "-m", "pytest", "tests/matrix/test_matrix.py", "-m", "matrix", "-q", "-n", n,
               "-p", "no:cacheprovider", f"--report-json={out}", *extra] + (["-k", k] if k else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 1):
            sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
        with open(out) as f:
            records = json.load(f)["records"]
    return collections.Counter((r["impl"], r["outcome"]) for r in records if r["impl"]), wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", default="auto", help="xdist workers (default auto)")
    ap.add_argument("-k", default=None, help="select cells, as pytest -k")
    args, extra = ap.parse_known_args()
    rates = {}
    only = {"wide_cells": "wide", "mesh_cells": "(hsdp or tp)"}
    for name, k in (("cells", args.k), *((n, f"({args.k}) and {sel}" if args.k else sel) for n, sel in only.items())):
        counts, wall = run(args.n, k, extra)
        print(f"-- {name} (-k {k}):")
        for impl in sorted({i for i, _ in counts}):
            print(f"{impl:10s} " + "  ".join(f"{o} {counts[impl, o]}"
                                             for o in ("passed", "xfailed", "failed", "skipped")))
        ran = sum(n for (_, o), n in counts.items() if o != "skipped")
        print(f"{ran} cells ran in {wall:.1f} s wall (-n {args.n}), start-up included")
        rates[name] = ran / (wall / 60)
    for name, rate in rates.items():
        print(f"{name}_per_minute={rate:.0f}")


if __name__ == "__main__":
    main()
