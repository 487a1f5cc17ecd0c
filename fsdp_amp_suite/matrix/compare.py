"""FSDP vs DDP, what a cell's run must show (test_matrix.py asks it; natural_table.py prints it): the same loss, the
same step/skip decision and the same scale after update() at every step and on every rank, the same params and
optimizer state at the end, within TOLERANCE; and a scaler that was exercised: a growth, a backoff, an applied
step. A failure names the first step, rank and quantity where the two diverged, beside the step table.
"""
import math

import torch

from fsdp_amp_suite.matrix.cell import INPUT_INF_STEP, OVERFLOW_STEP, RESUME_AFTER, injections, scaler_args

# (rtol, atol), written once per precision. The two sides compute the same thing; they differ only
# in the order of the gradient reduction (DDP all-reduce vs FSDP reduce-scatter), which changes a
# reduced grad by at most one rounding in the reduce dtype. With |lr * update| <~ 0.1 over 13 steps
# that stays under one unit of that dtype's eps in every loss and parameter. fp32: 16 ulp (2^-19)
# covers the same reordering plus fused multiply-add differences between devices, i.e. round-off.
TOLERANCE = {
    "fp32": (2.0**-19, 2.0**-19),
    "fp16": (torch.finfo(torch.float16).eps, torch.finfo(torch.float16).eps),
    "bf16": (torch.finfo(torch.bfloat16).eps, torch.finfo(torch.bfloat16).eps),
}


def cell_problem(cell, out) -> str | None:
    """What is wrong with a cell's run, in the order the checks go (None: nothing)."""
    return divergence(cell, out) or scaler_idle(cell, out) or natural_overflow_missing(cell, out)


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= atol + rtol * abs(b)


def divergence(cell, out) -> str | None:
    """Where FSDP and DDP first diverged: step, rank, quantity, both values (None: they agree)."""
    rtol, atol = TOLERANCE[cell.precision]
    for step in range(_steps_run(out)):
        for rank, r in enumerate(out):
            f, d = r.log["fsdp"], r.log["ref"]
            where = f"step {step}{_event(step, cell, r)}, rank {rank}"
            if not _close(f["loss"][step], d["loss"][step], rtol, atol):
                return (f"FSDP and DDP diverged first at {where}: loss FSDP {f['loss'][step]!r} "
                        f"vs DDP {d['loss'][step]!r}")
            if f["stepped"][step] != d["stepped"][step]:
                word = {True: "stepped", False: "skipped"}
                return (f"FSDP and DDP diverged first at {where}: decision FSDP {word[f['stepped'][step]]} vs DDP "
                        f"{word[d['stepped'][step]]}")
            if f["scale"][step] != d["scale"][step]:
                return (f"FSDP and DDP diverged first at {where}: scale after update() FSDP {f['scale'][step]!r} "
                        f"vs DDP {d['scale'][step]!r}")
    crashed = next((f"rank {rank}: {r.crashed}" for rank, r in enumerate(out) if r.crashed), None)
    if crashed:
        return crashed
    for what, label in (("params", "parameter"), ("probe", "optimizer state (param after a zero-grad probe step)")):
        for rank, r in enumerate(out):
            mine, ref = getattr(r, what)["fsdp"], getattr(r, what)["ref"]
            if set(mine) != set(ref):
                return f"rank {rank}: FSDP's full state_dict has names {sorted(mine)}, DDP's {sorted(ref)}"
            for name in ref:
                a, b = mine[name], ref[name]
                if a.shape != b.shape or not torch.allclose(a, b, rtol=rtol, atol=atol):
                    i = int(((a - b).abs().nan_to_num(math.inf) if a.shape == b.shape else torch.ones(1)).argmax())
                    return (f"FSDP and DDP diverged first at the end, rank {rank}: {label} {name!r} element {i}: FSDP "
                            f"{a.view(-1)[i].item()!r} vs DDP {b.view(-1)[i].item()!r}" if a.shape == b.shape else
                            f"rank {rank}: {label} {name!r} has shape {tuple(a.shape)} under FSDP, "
                            f"{tuple(b.shape)} under DDP")
    return None


def _steps_run(out) -> int:
    """STEPS, or fewer where a rank stopped early (its scaler could not be resumed)."""
    return min(len(r.log[side]["loss"]) for r in out for side in ("fsdp", "ref"))


def _event(step, cell, r) -> str:
    if cell.overflow != "injected":
        return _natural_event(step, r)
    if step == OVERFLOW_STEP and cell.precision == "fp16":
        return " (rank 0's micro-batch overflows fp16)"
    if step == INPUT_INF_STEP:
        return " (rank 0's micro-batch holds an inf: the overflow passes through forward, backward and the reduction)"
    if step in injections(cell):
        inject = injections(cell)[step]
        grad = f"the {inject.grad} TP-{inject.tp} grad" if inject.tp else f"the {inject.grad} grad"
        here = r.injected.get(step)
        return (f" ({inject.value} injected into {grad} on the {inject.rank} rank"
                + (f": {here})" if here else ", not this one)"))
    if step > RESUME_AFTER:
        return f" (the FSDP side's scaler was resumed from its state_dict after step {RESUME_AFTER})"
    return ""


def _natural_event(step, r) -> str:
    if step >= len(r.nonfinite) or not any(r.nonfinite[step]):
        return ""
    pos, neg, nan = r.nonfinite[step]
    born = ", born in the reduction: this rank's own grads were finite" if r.local_finite[step] else ""
    return f" (the overflow reached this rank's reduced grads as {pos} +inf, {neg} -inf, {nan} NaN{born})"


# a natural cell must make these cycles by itself: overflow, back off, regrow
NATURAL_BACKOFFS = 3


def scaler_idle(cell, out) -> str | None:
    """A cell where the scaler never grew, never backed off, or no step applied proves nothing; a natural cell
    must make NATURAL_BACKOFFS overflow cycles, a growth after each but the last."""
    log = out[0].log["ref"]
    before = [scaler_args(cell)["init_scale"]] + log["scale"][:-1]
    grew = [b > a for a, b in zip(before, log["scale"])]
    backed_off = [b < a for a, b in zip(before, log["scale"])]
    if not (any(grew) and any(backed_off) and any(log["stepped"]) and not all(log["stepped"])):
        return (f"the cell did not exercise the scaler (grew={any(grew)}, backed off={any(backed_off)}, "
                f"steps={log['stepped']})")
    cycles = sum(b and any(grew[i + 1:]) for i, b in enumerate(backed_off)) + 1
    if cell.overflow != "injected" and (sum(backed_off) < NATURAL_BACKOFFS or cycles < NATURAL_BACKOFFS):
        return (f"the cell's scale did not climb into {NATURAL_BACKOFFS} overflow cycles by itself "
                f"(backed off at steps {[i for i, b in enumerate(backed_off) if b]}, grew at "
                f"{[i for i, g in enumerate(grew) if g]})")
    return None


def natural_overflow_missing(cell, out) -> str | None:
    """What a natural cell exists for, seen in the FSDP side's reduced grads: an overflow that reaches the scaler
    as +-inf and no NaN (the commonest real one, which a wrapper clamping its grads hides); at world size >= 2, on
    some ranks only (so the ranks must agree); in a reduction cell, born in the reduction (every rank's own grads
    finite). Checked after the comparison with DDP, so a wrapper that hides an overflow fails there first."""
    if cell.overflow == "injected":
        return None
    steps = range(len(out[0].nonfinite))
    holds = [[r.nonfinite[s] for r in out] for s in steps]  # [step][rank] -> (+inf, -inf, NaN)
    overflowed = [s for s in steps if any(any(c) for c in holds[s])]
    if not any(all(c[2] == 0 for c in holds[s]) for s in overflowed):
        return f"no overflow reached the scaler as +-inf without NaN (overflow steps {overflowed})"
    if cell.world_size > 1 and cell.mesh != "tp" and not any(not all(any(c) for c in holds[s]) for s in overflowed):
        return f"every overflow reached every rank's reduced grads: the ranks never had to agree (steps {overflowed})"
    if cell.overflow == "reduction" and not any(all(r.local_finite[s] for r in out) for s in overflowed):
        return f"no overflow was born in the reduction: some rank's own grads overflowed at each of {overflowed}"
    return None


def step_table(out) -> str:
    natural = bool(out[0].nonfinite)
    lines = ["step  rank  loss FSDP / DDP                     stepped F/D   scale F/D"
             + ("            overflow in the reduced grads (+inf/-inf/NaN; own grads)" if natural else "")]
    for step in range(_steps_run(out)):
        for rank, r in enumerate(out):
            f, d = r.log["fsdp"], r.log["ref"]
            mark = "" if (f["stepped"][step], f["scale"][step]) == (d["stepped"][step], d["scale"][step]) else "  <-"
            seen = ""
            if natural:
                counts = r.nonfinite[step]
                seen = ("/".join(map(str, counts)) + ("; own finite" if r.local_finite[step] else "; own overflowed")
                        if any(counts) else "-")
                seen = f"  {seen}"
            lines.append(f"{step:4d}  {rank:4d}  {f['loss'][step]:<16.9g}/ {d['loss'][step]:<16.9g}  "
                         f"{f['stepped'][step]!s:5}/{d['stepped'][step]!s:5}  "
                         f"{f['scale'][step]:g}/{d['scale'][step]:g}{mark}{seen}")
    r0 = out[0]
    if r0.grad_devices:
        lines.append(f"FSDP grads on rank 0: devices {r0.grad_devices}, dtypes {r0.grad_dtypes}")
    return "\n".join(lines)


