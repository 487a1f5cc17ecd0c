"""Whether the matrix cells skipped on one GPU run in gloo ranks sharing it: FSDP2 without offload, and tensor
parallelism, at world size > the GPUs (fsdp_amp_suite/matrix/implementations.py _fsdp2_needs says why they skip).

    python -m benchmarks.shared_gpu [--cells N] [--scaler ours] [-k SUBSTRING]

Trains up to N such cells, one after another, in one harness's ranks (cuda-shared), and prints each cell's outcome:
ok, the first divergence from DDP, or how its ranks failed (a death's signal and frame). Needs one GPU. Last line:
cells=<run> ok=<agreeing with DDP> diverged=<...> died=<...> raised=<...>.
"""
import argparse
import collections

from fsdp_amp_suite.harness import Harness, RankDied, RankFailure
from fsdp_amp_suite.matrix import axes
from fsdp_amp_suite.matrix.cell import train_cell
from fsdp_amp_suite.matrix.compare import cell_problem


def skipped_on_one_gpu(cell) -> bool:
    """The matrix's own decision (axes.skip_reason) on one GPU, for cells of at most 4 ranks sharing it."""
    return cell.world_size <= 4 and axes.skip_reason(cell, 1) is not None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=40)
    ap.add_argument("--scaler", default="ours")
    ap.add_argument("-k", default="", help="only cells whose id contains this")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU: these cells run in gloo ranks sharing it")
    chosen = [c for c in axes.cells(["fsdp2"]) if skipped_on_one_gpu(c) and args.k in c.id][:args.cells]
    tally = collections.Counter()
    with Harness() as harness:
        for cell in chosen:
            try:
                out = harness.run(train_cell, cell, args.scaler, cell.impl, world_size=cell.world_size,
                                  device="cuda-shared", timeout=180)
                problem = None if out[0].unsupported else cell_problem(cell, out)
                kind, said = ("diverged", problem.splitlines()[0]) if problem else ("ok", "")
            except RankDied as exc:
                kind, said = "died", "; ".join(map(str, exc.deaths))
            except RankFailure as exc:
                kind, said = "raised", str(exc).splitlines()[0][:200]
            tally[kind] += 1
            print(f"{cell.id}: {kind} {said}", flush=True)
    print(f"cells={len(chosen)} " + " ".join(f"{k}={tally[k]}" for k in ("ok", "diverged", "died", "raised")))


if __name__ == "__main__":
    main()
