"""Fused optimizers under a scaler: an overflow skips the step exactly as if step() was never called.

torch's fused Adam, AdamW, SGD and Adagrad (fused=True, `_step_supports_amp_scaling`) take found_inf
from the scaler into the kernel, and skip only when it is exactly 1.0 (CPU and CUDA kernels alike):
any other non-zero value applies the step, inf/NaN update and all, and moves the step counter by
1 - found_inf. So a scaler that hands over a sum over devices or ranks corrupts the params while it
reports a skipped step. And fused SGD with momentum allocates its momentum buffer uninitialised on its
first step: a first step skipped inside the kernel leaves garbage that the next step applies.

  - the premise, per optimizer and device: which found_inf values the fused kernel skips on;
  - per scaler, on two ranks (each its own shard, as under FSDP): an overflow on every rank and, where
    the placement has two devices, on every device; whatever the scaler hands the optimizer must be
    exactly 0.0 or 1.0, the params must not move, and after one clean step params and optimizer state
    must equal a fresh fused optimizer's one step on the exact grads. Uninitialised memory is filled
    with NaN (deterministic mode) so that garbage shows on every run, not only when it happens to be
    non-zero.
"""
import math

import pytest
import torch

from fsdp_amp_suite.conformance.problem import (INF_VALUES, Problem, build_scaler, deterministic_fill, device_of,
                                                equal_lists,
                                       placement_params, run_at)

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("fused optimizers")]

# the fused optimizers of torch.optim, with settings that give each the state a wrong step corrupts
OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {}),
    "AdamW": (torch.optim.AdamW, {}),
    "SGD": (torch.optim.SGD, {"momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {}),
}
LR = 0.5
PLACEMENTS = placement_params(["cpu", "cuda", "offload", "mixed"])
N_PARAMS = 2  # round-robin over the placement's devices: on "mixed", param 0 on CPU and param 1 on the GPU
HANDED_OK = (None, 0.0, 1.0)  # None: the scaler skipped optimizer.step() itself


def make_fused(name: str, params):
    cls, settings = OPTIMIZERS[name]
    return cls(params, lr=LR, fused=True, **settings)


def unavailable(exc: Exception) -> bool:
    """torch has no such fused kernel on this device: NotImplementedError, or the RuntimeError torch raises for a
    device it lists as unsupported (fused Adagrad on CUDA: "`fused=True` requires all the params to be floating
    point Tensors of supported devices", seen on torch 2.11; it is a plain RuntimeError, so its text tells it)."""
    return isinstance(exc, NotImplementedError) or (isinstance(exc, RuntimeError)
                                                    and "`fused=True` requires" in str(exc))


def snapshot(params, opt) -> list:
    """Each param and its optimizer state (tensors only), on CPU."""
    return [(p.detach().cpu().clone(), {k: v.detach().cpu().clone() for k, v in opt.state[p].items()
                                        if torch.is_tensor(v)}) for p in params]


def first_difference(got: list, want: list) -> str | None:
    """Where two snapshots differ (torch.equal: a NaN differs from everything), in words; None if nowhere."""
    for i, ((p, state), (q, ref)) in enumerate(zip(got, want)):
        if not torch.equal(p, q):
            return f"param {i} is {p.tolist()}, want {q.tolist()}"
        for key in sorted(set(state) | set(ref)):
            if key not in state or key not in ref or not torch.equal(state[key], ref[key]):
                return (f"param {i}'s state {key!r} is {state[key].tolist() if key in state else 'missing'}, "
                        f"want {ref[key].tolist() if key in ref else 'missing'}")
    return None


# ------------------------------------------------------------------ the premise: what the fused kernels skip on

FOUND_INF_VALUES = (0.0, 1.0, 2.0)
# established on torch 2.13 (CPU) and 2.11 (CUDA): the kernels return early iff *found_inf == 1
SKIPS_ON = {0.0: False, 1.0: True, 2.0: False}


def _kernel_skips(optimizer: str, kind: str, found_inf: float) -> dict:
    device = device_of(kind)
    p = torch.nn.Parameter(torch.ones(2, device=device))
    p.grad = torch.tensor([1.0, math.inf], device=device)
    try:
        opt = make_fused(optimizer, [p])
        opt.grad_scale, opt.found_inf = None, torch.tensor(found_inf, device=device)  # as GradScaler.step sets them
        opt.step()
    except (NotImplementedError, RuntimeError) as exc:
        if not unavailable(exc):
            raise
        return dict(unavailable=f"torch {torch.__version__} has no fused {optimizer} kernel on {kind}: {exc}")
    step = opt.state[p].get("step")
    return dict(skipped=torch.equal(p.detach().cpu(), torch.ones(2)), step=None if step is None else float(step))


@pytest.mark.parametrize("device", placement_params(["cpu", "cuda"]))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_fused_kernel_skips_only_on_found_inf_exactly_one(optimizer, device):
    observed = {v: run_at(device, _kernel_skips, optimizer, device, v)[0] for v in FOUND_INF_VALUES}
    if "unavailable" in observed[0.0]:
        pytest.skip(observed[0.0]["unavailable"])
    assert {v: o["skipped"] for v, o in observed.items()} == SKIPS_ON, (
        f"torch's fused {optimizer} on {device} no longer skips only on found_inf == 1.0: {observed}. The rule "
        f"that a scaler hands exactly 0.0 or 1.0 still holds; SKIPS_ON and docs/bugs.md need the new facts")
    if observed[2.0]["step"] is not None:  # the counter moves by 1 - found_inf
        assert observed[2.0]["step"] == -1.0, f"step counter after found_inf 2.0: {observed[2.0]['step']}"


# ------------------------------------------------------------------ per scaler: an overflow, then a clean step

def _overflow_then_clean(spec: str, placement: str, optimizer: str, explicit_unscale: bool) -> dict:
    """Runs on a rank: one step whose grads overflow on every device, one clean step; what the optimizer was
    handed, whether the params moved, and how the end state differs from a fresh fused optimizer's one step."""
    import torch.distributed as dist

    rank = dist.get_rank()
    with deterministic_fill():
        ref = Problem(placement, n_params=N_PARAMS, seed_offset=rank)
        for p, c in zip(ref.params, ref.targets):
            p.grad = c.clone()  # the exact grads, no scaler
        try:
            ref_opt = make_fused(optimizer, ref.params)
            ref_opt.step()
        except (NotImplementedError, RuntimeError) as exc:
            if not unavailable(exc):
                raise
            return dict(unavailable=f"torch {torch.__version__} has no fused {optimizer} kernel here: {exc}")
        want = snapshot(ref.params, ref_opt)

        pb = Problem(placement, n_params=N_PARAMS, seed_offset=rank)
        opt = make_fused(optimizer, pb.params)
        s = build_scaler(spec, pb, init_scale=256.0)
        handed, plain_step = [], opt.step

        def recording_step(*args, **kwargs):  # what the scaler handed the kernel, read as it calls step()
            found_inf = getattr(opt, "found_inf", None)
            handed[-1] = None if found_inf is None else float(found_inf.sum())
            return plain_step(*args, **kwargs)

        opt.step = recording_step
        before = pb.snapshot()
        for bad in (True, False):
            handed.append(None)
            pb.zero_grad()
            pb.backward(s, inject={i: INF_VALUES["inf"] for i in range(N_PARAMS)} if bad else None)
            if explicit_unscale:  # the clipping path
                s.unscale_(opt)
            s.step(opt)
            s.update()
            if bad:
                moved_on_overflow = not equal_lists(pb.snapshot(), before)
        return dict(handed=handed, moved_on_overflow=moved_on_overflow,
                    differs=first_difference(snapshot(pb.params, opt), want))


@pytest.mark.parametrize("explicit_unscale", [False, True], ids=["step", "unscale_step"])
@pytest.mark.parametrize("fused", list(OPTIMIZERS))
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_overflow_skips_a_fused_optimizer_exactly(scaler, placement, fused, explicit_unscale):
    out = run_at(placement, _overflow_then_clean, scaler, placement, fused, explicit_unscale, world_size=2)
    if "unavailable" in out[0]:
        pytest.skip(out[0]["unavailable"])
    handed = [o["handed"] for o in out]
    assert all(v in HANDED_OK for h in handed for v in h), (
        f"a scaler must hand a fused optimizer found_inf of exactly 0.0 or 1.0 (its kernel skips only on 1.0); "
        f"handed per rank [overflow step, clean step]: {handed}")
    assert not any(o["moved_on_overflow"] for o in out), (
        f"an overflow on every rank and device must skip the fused {fused} step: params moved per rank "
        f"{[o['moved_on_overflow'] for o in out]} (handed {handed})")
    differs = [o["differs"] for o in out]
    assert differs == [None] * len(out), (
        f"after a skipped step and a clean one, params and state must equal a fresh fused {fused}'s one step "
        f"on the exact grads; per rank: {differs} (handed {handed})")
