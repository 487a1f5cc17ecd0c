"""The parts of torch.amp.GradScaler that torch's own grad-scaling tests and the integrations (accelerate,
Lightning) use beyond the public API: the private state, `_unscale_grads_`, pickling, the optimizer protocols,
accelerate's lazy-init-then-step after a load. A scaler sold as a drop-in for torch's must keep them coherent
with the scale it really uses.

Behaviour pinned by torch's tests (test/test_torch.py TestTorchDeviceType, test/distributed/fsdp/
test_fsdp_sharded_grad_scaler.py), checked here for every --scaler: each test names the torch test it follows.
"""
import pickle
import warnings

import pytest
import torch
from torch.amp.grad_scaler import OptState

from fsdp_amp_suite.conformance.problem import PLACEMENTS, build_scaler, placement_params, run_at, Problem

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("single rank")]

CPU_ONLY = placement_params(["cpu"])
STATE_PLACEMENTS = placement_params(["cpu", "cuda", "offload"])


def _param(value: float, device, dtype=torch.float32) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(2, device=device, dtype=dtype))
    p.grad = torch.tensor([value, 1.0], device=device, dtype=dtype)
    return p


def _view(t):
    return None if t is None else (str(t.dtype), t.device.type, t.dim(), t.item())


# ------------------------------------------------------------------ _scale and _growth_tracker

def _private_state(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=8.0, growth_interval=1)
    seen = {"subclass": isinstance(s, torch.amp.GradScaler), "before": (s._scale, s._growth_tracker)}
    p = _param(1.0, PLACEMENTS[placement]["params"][0])
    opt = torch.optim.SGD([p], lr=0.0)
    s.scale(torch.ones((), device=pb.loss_device))
    seen["after_scale"] = (_view(s._scale), _view(s._growth_tracker), s.get_scale())
    s.step(opt)
    s.update()  # clean: grows to 16
    seen["after_growth"] = (_view(s._scale), s.get_scale())
    p.grad = torch.tensor([float("inf"), 1.0], device=p.device)
    s.scale(torch.ones((), device=pb.loss_device))
    s.step(opt)
    s.update()  # inf: backs off to 8
    seen["after_backoff"] = (_view(s._scale), s.get_scale(), s._get_growth_tracker())
    s._scale.fill_(4.0)  # as torch's own load_state_dict writes it
    seen["after_fill"] = (s.get_scale(), s.state_dict()["scale"], s.scale(torch.ones((), device=pb.loss_device)).item())
    s.load_state_dict({"scale": 2.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
                       "_growth_tracker": 1})
    seen["after_load"] = (_view(s._scale), _view(s._growth_tracker), s.get_scale(), s._get_growth_tracker(),
                          s._init_growth_tracker)
    return seen, pb.loss_device.type


@pytest.mark.parametrize("placement", STATE_PLACEMENTS)
def test_private_scale_state_follows_the_scale(scaler, placement):
    """test_pickle_gradscaler / test_grad_scaling_state_dict / sharded test_grad_scaling: `_scale` is a float32
    tensor on the first scaled output's device, holding the scale the scaler uses, from its first scale() on;
    a write into it in place, and load_state_dict before or after it exists, move the scale itself."""
    seen, dev = run_at(placement, _private_state, scaler, placement)[0]
    assert seen["subclass"], "not a torch.amp.GradScaler: code written for torch's scaler cannot take it"
    assert seen["before"] == (None, None), f"_scale/_growth_tracker before the first scale(): {seen['before']}"
    assert seen["after_scale"] == (("torch.float32", dev, 0, 8.0), ("torch.int32", dev, 0, 0), 8.0), seen
    assert seen["after_growth"] == (("torch.float32", dev, 0, 16.0), 16.0), seen
    assert seen["after_backoff"] == (("torch.float32", dev, 0, 8.0), 8.0, 0), seen
    assert seen["after_fill"] == (4.0, 4.0, 4.0), f"after _scale.fill_(4.0): (get_scale, state_dict, scale(1)) = " \
                                                  f"{seen['after_fill']}"
    assert seen["after_load"] == (("torch.float32", dev, 0, 2.0), ("torch.int32", dev, 0, 1), 2.0, 1, 1), seen


# ------------------------------------------------------------------ _unscale_grads_

def _unscale_grads(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=4.0)
    params = [_param(2.0, "cpu"), _param(4.0, "cpu", torch.float64), _param(8.0, "cpu", torch.float16)]
    opt = torch.optim.SGD(params, lr=0.0)
    found = s._unscale_grads_(opt, torch.full((), 0.5), torch.zeros(()), True)  # before any scale(), as torch's test
    clean = ({str(d): float(t.sum()) for d, t in found.items()}, [p.grad.tolist() for p in params])
    params[1].grad[0] = float("inf")
    found = s._unscale_grads_(opt, torch.full((), 1.0), torch.zeros(()), True)
    one_inf = {str(d): float(t.sum()) for d, t in found.items()}
    # an uncoalesced fp16 sparse grad whose duplicates sum past fp16's max: only the coalesced sum shows it
    sp = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    sp.grad = torch.sparse_coo_tensor([[0, 0]], torch.tensor([64000.0, 64000.0], dtype=torch.float16), (2,))
    found = s._unscale_grads_(torch.optim.SGD([sp], lr=0.0), torch.full((), 1.0), torch.zeros(()), True)
    return clean, one_inf, {str(d): float(t.sum()) for d, t in found.items()}


@pytest.mark.parametrize("placement", CPU_ONLY)
def test_unscale_grads_keeps_torchs_signature(scaler, placement):
    """test_grad_scaling_unscale / _unscale_sparse, sharded test_scaling_unscaling_sparse:
    `_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)` unscales every dtype in place by inv_scale and
    returns found_inf per device: 0 when clean, exactly 1 for an inf, and 1 for fp16 sparse duplicates whose sum
    overflows."""
    clean, one_inf, sparse = run_at(placement, _unscale_grads, scaler, placement)[0]
    assert clean == ({"cpu": 0.0}, [[1.0, 0.5], [2.0, 0.5], [4.0, 0.5]]), f"clean: {clean}"
    assert one_inf == {"cpu": 1.0}, f"one inf in the fp64 grads: found_inf per device {one_inf}"
    assert sparse == {"cpu": 1.0}, f"fp16 sparse duplicates 64000 + 64000: found_inf per device {sparse}"


# ------------------------------------------------------------------ pickling

def _pickled(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=3.0, growth_factor=4.0, growth_interval=2)
    fresh = pickle.loads(pickle.dumps(s))
    p = _param(1.0, "cpu")
    opt = torch.optim.SGD([p], lr=0.0)
    s.scale(torch.ones(()))
    s.step(opt)
    try:
        pickle.dumps(s)
        mid = "pickled"
    except AssertionError:
        mid = "AssertionError"
    s.update()
    copy = pickle.loads(pickle.dumps(s))
    settings = lambda c: (c.is_enabled(), c.get_scale(), c.get_growth_factor(), c.get_backoff_factor(),  # noqa: E731
                          c.get_growth_interval(), c._get_growth_tracker())
    return dict(fresh=settings(fresh), mid=mid, copy=settings(copy), scaled=copy.scale(torch.tensor([4.0])).item(),
                states=dict(copy._per_optimizer_states["any"]))


@pytest.mark.parametrize("placement", CPU_ONLY)
def test_a_scaler_pickles_between_iterations(scaler, placement):
    """test_pickle_gradscaler: a scaler pickles before its first scale() and after update(), not in between; the
    copy has the settings, the scale and the tracker, scales with them, and starts optimizer states afresh."""
    out = run_at(placement, _pickled, scaler, placement)[0]
    assert out["fresh"] == (True, 3.0, 4.0, 0.5, 2, 0), f"pickled before scale(): {out['fresh']}"
    assert out["mid"] == "AssertionError", "pickling between step() and update() did not raise AssertionError"
    assert out["copy"] == (True, 3.0, 4.0, 0.5, 2, 1), f"pickled after one clean update: {out['copy']}"
    assert out["scaled"] == 12.0, f"the copy's scale(tensor([4.])) = {out['scaled']}"
    assert out["states"] == {"stage": OptState.READY, "found_inf_per_device": {}}, out["states"]


# ------------------------------------------------------------------ optimizers that handle scaling themselves

class _TakesScaler(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None, *, grad_scaler=None):
        self.handed = grad_scaler
        return "took the scaler"


class _ReadsAttributes(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        self.handed = (_view(getattr(self, "grad_scale", None)), _view(getattr(self, "found_inf", None)))
        return "read the attributes"


def _protocols(spec, placement, value):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=4.0)
    takes, reads = _TakesScaler([_param(value, "cpu")], lr=0.0), _ReadsAttributes([_param(value, "cpu")], lr=0.0)
    s.scale(torch.ones(()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = (s.step(takes), s.step(reads))
    left = [hasattr(reads, "grad_scale"), hasattr(reads, "found_inf")]
    s._check_inf_per_device(takes)  # what a grad_scaler-taking optimizer calls; update() then has its found_inf
    s.update()
    return dict(got=got, is_scaler=takes.handed is s, future=any(w.category is FutureWarning for w in caught),
                handed=reads.handed, left=left, scale=s.get_scale())


@pytest.mark.parametrize("placement", CPU_ONLY)
@pytest.mark.parametrize("value", [1.0, float("inf")], ids=["clean", "inf"])
def test_an_optimizer_that_handles_scaling_gets_torchs_protocol(scaler, placement, value):
    """test_grad_scaler_pass_itself: an optimizer with _step_supports_amp_scaling whose step() takes grad_scaler
    is handed the scaler (with a FutureWarning); one whose step() does not finds grad_scale (the scale) and
    found_inf (1.0 on an inf, else 0.0) set as attributes, removed after; update() takes both steps' checks."""
    out = run_at(placement, _protocols, scaler, placement, value)[0]
    assert out["got"] == ("took the scaler", "read the attributes"), f"step() returned {out['got']}"
    assert out["is_scaler"] and out["future"], f"handed the scaler: {out['is_scaler']}, FutureWarning: {out['future']}"
    inf = value != 1.0
    assert out["handed"] == (("torch.float32", "cpu", 0, 4.0), ("torch.float32", "cpu", 0, float(inf))), out["handed"]
    assert out["left"] == [False, False], "grad_scale / found_inf left on the optimizer after step()"
    assert out["scale"] == (2.0 if inf else 4.0), f"scale after update(): {out['scale']}"


# ------------------------------------------------------------------ accelerate's load_state (FSDP2)

def _lazy_init_after_load(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=65536.0, growth_interval=2)
    s.load_state_dict({"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2,
                       "_growth_tracker": 1})
    s._lazy_init_scale_growth_tracker(s._device)  # accelerate, before the optimizer's dummy step
    p = _param(0.0, "cpu")
    opt = torch.optim.SGD([p], lr=0.0)
    s.step(opt)  # no scale() first: accelerate's set_optimizer_state_dict steps on a dummy grad
    s.update()
    try:
        s._lazy_init_scale_growth_tracker(s._device)
        again = "initialized again"
    except AssertionError:
        again = "AssertionError"
    return s.get_scale(), s._get_growth_tracker(), s.scale(torch.ones(())).item(), again


@pytest.mark.parametrize("placement", CPU_ONLY)
def test_lazy_init_after_load_then_step_continues_the_checkpoint(scaler, placement):
    """accelerate's FSDP2 load_state: load_state_dict, _lazy_init_scale_growth_tracker(scaler._device), then a step
    with no scale() before it: the loaded scale and tracker go on (the clean step completes the growth interval);
    a second lazy init raises as torch's does."""
    out = run_at(placement, _lazy_init_after_load, scaler, placement)[0]
    assert out == (1024.0, 0, 1024.0, "AssertionError"), f"(scale, tracker, scale(1), second lazy init) = {out}"
