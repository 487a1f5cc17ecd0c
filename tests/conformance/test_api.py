"""The GradScaler contract on one rank, for its API: the settings it reports, scale() on tensors and
structures, the disabled scaler as a pass-through, misuse raising like torch's, step()'s arguments and
return value, the setters.

Each test runs the scaler under test on a rank of the pool (world_size 1) and compares what the rank
observed with what torch.amp.GradScaler's contract says.
"""
import math

import pytest
import torch

from fsdp_amp_suite.conformance.problem import (Problem, build_scaler, equal_lists, placement_params, run_at, sgd)

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("single rank")]

ALL_PLACEMENTS = placement_params()
CPU_ONLY = placement_params(["cpu"])


# ------------------------------------------------------------------ settings and scale()

def _settings(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    state = s.state_dict()  # before the first scale(): the constructor's values
    return (s.is_enabled(), s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(),
            s.get_growth_interval(), float(state["scale"]), int(state["_growth_tracker"]))


@pytest.mark.parametrize("placement", CPU_ONLY)
def test_enabled_scaler_reports_its_settings(scaler, placement):
    assert run_at(placement, _settings, scaler, placement)[0] == (True, 1024.0, 3.0, 0.25, 7, 1024.0, 0)


def _scale_outputs(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=512.0)
    t = torch.tensor([1.5, -2.0], device=pb.loss_device)
    single = s.scale(t)
    as_list = s.scale([t, t * 2])
    as_tuple = s.scale((t,))
    nested = s.scale([(t,), [t]])
    try:
        s.scale(3)
        bad = None
    except ValueError as exc:
        bad = str(exc)
    return dict(single=single, device=str(single.device), want_device=str(t.device), list=as_list,
                list_type=type(as_list).__name__, tuple_type=type(as_tuple).__name__, tuple=as_tuple,
                nested=nested, bad=bad)


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_scale_multiplies_tensors_and_keeps_structure(scaler, placement):
    out = run_at(placement, _scale_outputs, scaler, placement)[0]
    t = torch.tensor([1.5, -2.0])
    assert torch.equal(out["single"].float(), t * 512) and out["device"] == out["want_device"]
    assert out["list_type"] == "list" and out["tuple_type"] == "tuple"
    assert equal_lists([x.float() for x in out["list"]], [t * 512, t * 1024])
    assert torch.equal(out["tuple"][0].float(), t * 512)
    assert torch.equal(out["nested"][0][0].float(), t * 512) and torch.equal(out["nested"][1][0].float(), t * 512)
    assert out["bad"] is not None, "scale(3) must raise ValueError"


# ------------------------------------------------------------------ disabled, misuse, API details

def _disabled(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, enabled=False)
    loss = pb.loss()
    same_object = s.scale(loss) is loss
    opt = sgd(pb.params)
    loss.backward()
    with torch.no_grad():
        pb.params[0].grad.view(-1)[0] = math.inf
    raw = pb.grads()
    s.unscale_(opt)
    after_unscale = pb.grads()
    s.step(opt)
    s.update()
    return dict(same_object=same_object, enabled=s.is_enabled(), scale=s.get_scale(), state=s.state_dict(),
                unchanged_by_unscale=equal_lists(raw, after_unscale),
                stepped_on_inf=bool(torch.isnan(pb.params[0].detach()).any()
                                    or torch.isinf(pb.params[0].detach()).any()))


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_disabled_scaler_is_a_pass_through(scaler, placement):
    out = run_at(placement, _disabled, scaler, placement)[0]
    assert out["same_object"], "disabled scale() returns its input unchanged"
    assert out["enabled"] is False and out["scale"] == 1.0 and out["state"] == {}
    assert out["unchanged_by_unscale"], "disabled unscale_ is a no-op"
    assert out["stepped_on_inf"], "disabled step() calls optimizer.step() unconditionally"


def _misuse(spec, placement, case):
    pb = Problem(placement)
    s = build_scaler(spec, pb)
    opt = sgd(pb.params)
    try:
        if case == "step before scale":
            s.step(opt)
        elif case == "unscale_ before scale":
            s.unscale_(opt)
        elif case == "update before step":
            pb.backward(s)
            s.update()
        elif case == "unscale_ twice":
            pb.backward(s)
            s.unscale_(opt)
            s.unscale_(opt)
        elif case == "unscale_ after step":
            pb.backward(s)
            s.step(opt)
            s.unscale_(opt)
        elif case == "step twice":
            pb.backward(s)
            s.step(opt)
            s.step(opt)
        elif case == "closure":
            pb.backward(s)
            s.step(opt, closure=lambda: None)
        elif case == "load empty state":
            s.load_state_dict({})
        elif case == "next iteration after update":  # legal: update() resets the per-optimizer stages
            for _ in range(2):
                pb.zero_grad()
                pb.backward(s)
                s.unscale_(opt)
                s.step(opt)
                s.update()
        return None
    except Exception as exc:  # noqa: BLE001 - the type and message are the observation
        return type(exc).__name__, str(exc)


MISUSE = {
    "step before scale": ("AssertionError", "Attempted step but _scale is None"),
    "unscale_ before scale": ("AssertionError", "Attempted unscale_ but _scale is None"),
    "update before step": ("AssertionError", "No inf checks were recorded prior to update."),
    "unscale_ twice": ("RuntimeError", "unscale_() has already been called on this optimizer since the last update()."),
    "unscale_ after step": ("RuntimeError", "unscale_() is being called after step()."),
    "step twice": ("RuntimeError", "step() has already been called since the last update()."),
    "closure": ("RuntimeError", "Closure use is not currently supported if GradScaler is enabled."),
    "load empty state": ("RuntimeError", "The source state dict is empty"),
    "next iteration after update": None,
}


@pytest.mark.parametrize("case", list(MISUSE))
@pytest.mark.parametrize("placement", CPU_ONLY)
def test_misuse_raises_like_torch(scaler, placement, case):
    got = run_at(placement, _misuse, scaler, placement, case)[0]
    want = MISUSE[case]
    if want is None:
        assert got is None, f"legal use raised {got}"
    else:
        assert got is not None, f"{case}: must raise {want[0]}"
        assert got[0] == want[0] and want[1] in got[1], f"{case}: got {got}, want {want}"


class _RecordingSGD(torch.optim.SGD):
    def step(self, closure=None, tag=None):
        super().step()
        return ("stepped", tag)


def _forwarding(spec, placement, bad):
    pb = Problem(placement)
    s = build_scaler(spec, pb)
    opt = _RecordingSGD(pb.params, lr=0.1)
    pb.backward(s, inject={0: math.inf} if bad else None)
    return s.step(opt, tag="x")


@pytest.mark.parametrize("placement", CPU_ONLY)
def test_step_forwards_arguments_and_return_value(scaler, placement):
    assert run_at(placement, _forwarding, scaler, placement, False)[0] == ("stepped", "x")
    assert run_at(placement, _forwarding, scaler, placement, True)[0] is None


def _setters(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=64.0, growth_interval=1000)
    s.set_growth_interval(1)
    s.set_growth_factor(8.0)
    s.set_backoff_factor(0.125)
    opt = sgd(pb.params, lr=0.0)
    scales = []
    for bad in (False, True):
        pb.zero_grad()
        pb.backward(s, inject={0: math.inf} if bad else None)
        s.step(opt)
        s.update()
        scales.append(s.get_scale())
    return (s.get_growth_interval(), s.get_growth_factor(), s.get_backoff_factor()), scales


@pytest.mark.parametrize("placement", CPU_ONLY)
def test_setters_take_effect(scaler, placement):
    assert run_at(placement, _setters, scaler, placement)[0] == ((1, 8.0, 0.125), [512.0, 64.0])
