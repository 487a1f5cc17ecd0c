"""Where a run's time went: worker-seconds per test file, from the JUnit XML of any run of the suite.

    python -m benchmarks.junit JUNIT.xml [JUNIT.xml ...]     e.g. ci-out/junit.xml ci-out/meta-junit.xml

Prints, per file, the seconds its tests took summed over workers (what -n N divides), the share of the total,
and the slowest tests. Last line: worker_seconds=<total>. ci/cpu.sh and ci/gpu.sh write the XML
(--junitxml); benchmarks/gpu.py reads the GPU gate's through per_file().
"""
import collections
import sys
import xml.etree.ElementTree as ET


def cases(path: str) -> list[tuple[str, str, float, bool]]:
    """(file, test id, seconds, ran) per testcase; ran: not skipped (an xfail ran)."""
    out = []
    for case in ET.parse(path).iter("testcase"):
        skipped = case.find("skipped")
        classname = case.get("classname", "")
        out.append((classname.split(".")[-1] or "?", f"{classname}::{case.get('name')}", float(case.get("time", 0)),
                    skipped is None or skipped.get("type") == "pytest.xfail"))
    return out


def per_file(rows) -> collections.Counter:
    total = collections.Counter()
    for file, _, seconds, _ in rows:
        total[file] += seconds
    return total


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        sys.exit(__doc__)
    rows = [row for path in paths for row in cases(path)]
    files = per_file(rows)
    total = sum(files.values())
    print(f"{'file':40s} {'worker-s':>9s} {'share':>6s}")
    for file, seconds in files.most_common():
        print(f"{file:40s} {seconds:9.1f} {seconds / total:6.1%}")
    print("slowest: " + "; ".join(f"{name.split('::', 1)[-1][:70]} {s:.0f}s" for _, name, s, _ in
                                   sorted(rows, key=lambda r: r[2])[-8:]))
    print(f"{sum(r[3] for r in rows)} checks ran, {len(rows)} collected")
    print(f"worker_seconds={total:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
