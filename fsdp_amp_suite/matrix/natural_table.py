"""Print the step tables of the natural-overflow cells (axes.natural_cells): FSDP beside DDP at every step.

    python -m fsdp_amp_suite.matrix.natural_table [--impl fsdp1|fsdp2|fairscale ...] [--scaler NAME]
    [--overflow climb|reduction]

The same cells and the same table a failing matrix test prints, for reading a cycle of overflow, back-off and
regrowth when nothing failed (docs/suites.md pastes them). Cells this machine cannot run are named and skipped.
"""
import argparse
import sys

import torch

from fsdp_amp_suite.harness import Harness, RankFailure
from fsdp_amp_suite.matrix import axes
from fsdp_amp_suite.matrix.cell import train_cell
from fsdp_amp_suite.matrix.compare import cell_problem, step_table
from fsdp_amp_suite.scalers import BUILTINS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", action="append", choices=axes.AXES["impl"], help="default: every implementation")
    parser.add_argument("--scaler", default="ours", choices=sorted(BUILTINS))
    parser.add_argument("--overflow", action="append", choices=sorted(axes.NATURAL), help="default: both kinds")
    args = parser.parse_args(argv)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cells = [c for c in axes.natural_cells(tuple(args.impl or axes.AXES["impl"]))
             if c.overflow in (args.overflow or axes.NATURAL)]
    failed = 0
    with Harness(isolate=True) as harness:
        for cell in cells:
            device = axes.cell_device_mode(cell, n_gpus)
            print(f"\n## {cell.id} (scaler {args.scaler}, device {device}, torch {torch.__version__})", flush=True)
            unrunnable = axes.skip_reason(cell, n_gpus)  # what the matrix skips here (fsdp_amp_suite/expectations.py)
            if unrunnable:
                print(f"skipped: {unrunnable}")
                continue
            try:
                out = harness.run(train_cell, cell, args.scaler, cell.impl, world_size=cell.world_size, device=device)
            except RankFailure as exc:  # a cell whose training raises (a known bug of the FSDP implementation)
                print(f"raised: {str(exc).strip().splitlines()[-1]}", flush=True)
                failed += 1
                continue
            if out[0].unsupported:
                print(f"skipped: {out[0].unsupported}")
                continue
            print(step_table(out))
            problem = cell_problem(cell, out)
            print(f"verdict: {problem or 'FSDP matches DDP; the cycles and the overflow are as the cell requires'}",
                  flush=True)
            failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
