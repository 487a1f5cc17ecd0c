"""Cost of one 2-rank case through the persistent rank pool vs. spawn-per-case (isolation mode).

    python -m benchmarks.harness [--n 10]

The case: a tiny MLP under torch FSDP on CPU (gloo, 2 ranks), 3 SGD steps with a scaler. Both
engines run it N times in this one process; the first pooled run (which spawns the pool) is
reported apart. Last line: pool_speedup=<spawn seconds per case / pool seconds per case>.
"""
import argparse
import statistics
import sys
import time

from benchmarks.cases import fsdp_mlp_three_steps
from tests.harness import Harness


def timed(harness, n):
    times, results = [], []
    for i in range(n):
        t0 = time.perf_counter()
        results.append(harness.run(fsdp_mlp_three_steps, world_size=2))
        times.append(time.perf_counter() - t0)
    return times, results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args()
    with Harness() as pooled:
        t0 = time.perf_counter()
        first = pooled.run(fsdp_mlp_three_steps, world_size=2)
        start_up = time.perf_counter() - t0
        pool_times, pool_results = timed(pooled, args.n)
    with Harness(isolate=True) as isolated:
        spawn_times, spawn_results = timed(isolated, args.n)
    same = all(all(a.equal(b) for a, b in zip(r, first)) for r in pool_results + spawn_results)
    pool, spawn = statistics.median(pool_times), statistics.median(spawn_times)
    print(f"pool start-up (spawn + first case): {start_up * 1e3:.0f} ms")
    print(f"pool:  median {pool * 1e3:8.1f} ms per case over {args.n} (min {min(pool_times) * 1e3:.1f})")
    print(f"spawn: median {spawn * 1e3:8.1f} ms per case over {args.n} (min {min(spawn_times) * 1e3:.1f})")
    print(f"results identical across all runs and both engines: {same}")
    print(f"pool_speedup={spawn / pool:.1f}")
    if not same:
        sys.exit("results differ between runs: the benchmark case is not deterministic")


if __name__ == "__main__":
    main()
