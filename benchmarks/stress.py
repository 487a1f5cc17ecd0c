"""Rank deaths under the gate's load: how often a rank process dies in the checks that run DTensor's functional
collectives over gloo (FSDP2 and mesh checks), in ranks that served the gate's other work first.

    python -m benchmarks.stress [--rounds N] [--max-s S] [-n WORKERS] [--cpu-ranks] [--isolate-ranks] [PATH ...]
                                [-- pytest args]

Runs one child pytest over PATH (default: the gate's conformance, matrix and repro paths) at the gate's concurrency
(ci/gpu.sh's worker count where there is a GPU, else -n auto) with --maxschedchunk 1, which hands tests out in
collection order: first every check once (round 0, the gate's work), then the target checks again, N - 1 more
rounds, in the same ranks. Targets (`is_target`): matrix cells of FSDP2 or on a 2-D mesh at world size >= 2, and the
mesh and FSDP2 conformance checks. Settings to compare, one at a time:
    --cpu-ranks      the child sees no GPU (CUDA_VISIBLE_DEVICES=""): CPU-only gloo ranks instead of GPU gloo ranks
    --isolate-ranks  fresh ranks for every check instead of ranks reused across the run
    --max-s S        stop the child after S seconds, as Ctrl-C does, and count what ran (a device's time is bounded)
Prints the deaths by signal and by frame (fsdp_amp_suite/harness/failures.py Death), and every other failure. Last line:
rank_deaths=<deaths> target_runs=<target checks that ran, not skipped> deaths_per_1000=<rate>.

Loaded as a plugin (-p benchmarks.stress) it is what repeats the targets: --stress-rounds N.
"""
import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from fsdp_amp_suite import paths

ROOT = str(paths.ROOT)
GATE_PATHS = ["tests/conformance", "tests/matrix", "tests/repro"]
ROUND = "stress_round"
STOP_GRACE_S = 120  # for the stopped child to end its workers and write its report
# the checks that run DTensor functional collectives (full_tensor, clip_grad_norm_, redistribute) on every rank
TARGET_FILES = {"test_meshes.py", "test_fsdp2.py"}
TARGET_TESTS = {"test_every_sequence_on_a_mesh_follows_the_contract"}


def is_target(item) -> bool:
    cell = getattr(getattr(item, "callspec", None), "params", {}).get("cell")
    if cell is not None:
        return cell.world_size >= 2 and (cell.impl == "fsdp2" or cell.mesh != "1d")
    return item.path.name in TARGET_FILES or item.originalname in TARGET_TESTS


# ------------------------------------------------------------------ the plugin (in the child)

def pytest_addoption(parser):
    parser.addoption("--stress-rounds", type=int, default=1, help="benchmarks/stress.py: rounds of the targets")
    parser.addoption("--stress-targets", default=None, help="benchmarks/stress.py: where to write the targets' ids")


def pytest_generate_tests(metafunc):
    rounds = metafunc.config.getoption("--stress-rounds")
    if rounds > 1:
        metafunc.fixturenames.append(ROUND)
        metafunc.parametrize(ROUND, range(rounds), ids=[f"round{r}" for r in range(rounds)])


def pytest_collection_modifyitems(config, items):
    """Round 0 of every check in collection order, then each later round of the targets; the targets' ids written
    for the driver (every xdist worker collects the same items, so each writes the same file)."""
    def round_of(item):
        return getattr(getattr(item, "callspec", None), "params", {}).get(ROUND, 0)
    kept = [i for i in items if round_of(i) == 0 or is_target(i)]
    items[:] = sorted(kept, key=round_of)  # stable: collection order within a round
    path = config.getoption("--stress-targets")
    if path:
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
            json.dump([i.nodeid for i in items if is_target(i)], f)
        os.replace(f.name, path)


# ------------------------------------------------------------------ the driver

def workers() -> str:
    """ci/gpu.sh's worker count where there is a GPU, else auto."""
    from fsdp_amp_suite.harness.budget import context_budget, gate_workers, visible_gpus

    if visible_gpus() == 0:
        return "auto"
    return str(gate_workers(len(os.sched_getaffinity(0)), context_budget(0)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the targets (the first is the gate's own)")
    ap.add_argument("-n", default=None, help="xdist workers (default: the gate's)")
    ap.add_argument("--cpu-ranks", action="store_true", help="hide the GPUs from the child: CPU-only ranks")
    ap.add_argument("--isolate-ranks", action="store_true", help="fresh ranks for every check")
    ap.add_argument("--max-s", type=float, default=None,
                    help="stop the child (as Ctrl-C does) after this many seconds and count what ran")
    ap.add_argument("paths", nargs="*", default=GATE_PATHS)
    args, extra = ap.parse_known_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be at least 1")
    from fsdp_amp_suite.child_run import clean_env

    env = clean_env()
    if args.cpu_ranks:
        env["CUDA_VISIBLE_DEVICES"] = ""
    n = args.n or workers()
    with tempfile.TemporaryDirectory() as tmp:
        out, listed = os.path.join(tmp, "stress.json"), os.path.join(tmp, "targets.json")
        cmd = [sys.executable, "-m", "pytest", *args.paths, "-m", "not slow", "-q", "-n", n, "--maxschedchunk", "1",
               "-p", "benchmarks.stress", f"--stress-rounds={args.rounds}", f"--stress-targets={listed}",
               "-p", "no:cacheprovider", f"--report-json={out}", *(["--isolate-ranks"] if args.isolate_ranks else []),
               *[a for a in extra if a != "--"]]
        t0 = time.perf_counter()
        log = os.path.join(tmp, "child.log")
        with open(log, "w") as f:
            child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
            try:
                child.wait(timeout=args.max_s)
                stopped = ""
            except subprocess.TimeoutExpired:  # as Ctrl-C would: pytest stops its workers and still reports
                child.send_signal(signal.SIGINT)
                child.wait(timeout=STOP_GRACE_S)
                stopped = f", stopped at --max-s {args.max_s:.0f}"
        wall = time.perf_counter() - t0
        if not (os.path.exists(out) and os.path.exists(listed)):
            with open(log) as f:
                sys.exit(f"the child pytest wrote no report (exit {child.returncode}):\n" + f.read()[-6000:])
        with open(out) as f:
            records = json.load(f)["records"]
        with open(listed) as f:
            targets = set(json.load(f))
    print(summary(records, targets, wall, f"-n {n}" + (", CPU-only ranks" if args.cpu_ranks else "")
                  + (", fresh ranks" if args.isolate_ranks else "") + stopped, args.rounds))


def summary(records: list, targets: set, wall: float, setting: str, rounds: int) -> str:
    """The deaths by signal and by frame, the other failures, and the rate over the target runs."""
    ran = [r for r in records if r["nodeid"] in targets and r["outcome"] != "skipped"]
    deaths = [d for r in records for d in r.get("deaths") or ()]
    lines = [f"{len(records)} checks, {len(ran)} target runs in {rounds} round(s), {wall:.0f} s wall ({setting})",
             "deaths by signal: " + (", ".join(f"{how} {k}" for how, k in
                                               collections.Counter(d["how"] for d in deaths).most_common()) or "none")]
    lines += [f"  {k} x {frame or '(no Python stack)'} ({owner}'s code)" for (frame, owner), k in
              collections.Counter((d["frame"], d["owner"]) for d in deaths).most_common()]
    lines += [f"failed{' (a rank died)' if r.get('deaths') else ''}: {r['nodeid']}" for r in records
              if r["outcome"] == "failed"]
    rate = 1000 * len(deaths) / max(1, len(ran))
    lines.append(f"rank_deaths={len(deaths)} target_runs={len(ran)} deaths_per_1000={rate:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
