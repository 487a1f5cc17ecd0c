"""The GradScaler contract on one rank: scaling, unscaling, skipping, the scale rules, state, misuse.

Each test builds an exact toy problem (problem.py), runs the scaler under test on a rank of the
pool (world_size 1) and compares what the rank observed with what the contract says.
"""
import math

import pytest
import torch

from tests.conformance.problem import (DTYPES, INF_VALUES, Problem, build_scaler, equal_lists, harness_device,
                                       placement_params, reference_scales, reference_sgd_run, run_steps, sgd)
from tests.harness import run_on_ranks

pytestmark = pytest.mark.conformance
REPORT_COLUMN = "single rank"  # the compatibility report's column for these checks (tests/report.py)

ALL_PLACEMENTS = placement_params()
CPU_ONLY = placement_params(["cpu"])


def run1(body, *args, placement="cpu"):
    return run_on_ranks(body, *args, world_size=1, device=harness_device(placement, 1), timeout=60)[0]


# ------------------------------------------------------------------ settings and scale()

def _settings(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    state = s.state_dict()  # before the first scale(): the constructor's values
    return (s.is_enabled(), s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(),
            s.get_growth_interval(), float(state["scale"]), int(state["_growth_tracker"]))


@pytest.mark.parametrize("placement", CPU_ONLY)
def test_enabled_scaler_reports_its_settings(scaler, placement):
    assert run1(_settings, scaler, placement, placement=placement) == (True, 1024.0, 3.0, 0.25, 7, 1024.0, 0)


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
    out = run1(_scale_outputs, scaler, placement, placement=placement)
    t = torch.tensor([1.5, -2.0])
    assert torch.equal(out["single"].float(), t * 512) and out["device"] == out["want_device"]
    assert out["list_type"] == "list" and out["tuple_type"] == "tuple"
    assert equal_lists([x.float() for x in out["list"]], [t * 512, t * 1024])
    assert torch.equal(out["tuple"][0].float(), t * 512)
    assert torch.equal(out["nested"][0][0].float(), t * 512) and torch.equal(out["nested"][1][0].float(), t * 512)
    assert out["bad"] is not None, "scale(3) must raise ValueError"


# ------------------------------------------------------------------ clean and overflowing steps

def _clean_steps(spec, placement, dtype, steps):
    args = dict(placement=placement, dtype=dtype)
    pb = Problem(**args)
    s = build_scaler(spec, pb, init_scale=256.0)
    opt = sgd(pb.params)
    grads = []
    for _ in range(steps):
        pb.zero_grad()
        pb.backward(s)
        s.step(opt)
        s.update()
        grads.append(pb.grads())
    return dict(params=pb.snapshot(), grads=grads, targets=[c.cpu() for c in pb.targets],
                reference=reference_sgd_run(args, steps), scale=s.get_scale())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_clean_step_unscales_exactly_and_steps(scaler, placement, dtype):
    out = run1(_clean_steps, scaler, placement, dtype, 2, placement=placement)
    for step_grads in out["grads"]:
        assert equal_lists(step_grads, out["targets"]), "grads after step() must be exactly the unscaled grads"
    assert equal_lists(out["params"], out["reference"]), "params must match an unscaled SGD run"
    assert out["scale"] == 256.0


def _overflow_then_clean(spec, placement, dtype, where, value):
    args = dict(placement=placement, dtype=dtype)
    pb = Problem(**args)
    s = build_scaler(spec, pb, init_scale=256.0, backoff_factor=0.25)
    opt = sgd(pb.params)
    pb.backward(s)  # step 1: clean, so momentum buffers exist
    s.step(opt)
    s.update()
    after_first = pb.snapshot()
    momentum = [opt.state[p]["momentum_buffer"].cpu().clone() for p in pb.params]
    pb.zero_grad()
    pb.backward(s, inject={where: INF_VALUES[value]})  # step 2: one bad element
    returned = s.step(opt)
    s.update()
    skipped_params = pb.snapshot()
    skipped_momentum = [opt.state[p]["momentum_buffer"].cpu().clone() for p in pb.params]
    scale_after_skip = s.get_scale()
    pb.zero_grad()
    pb.backward(s)  # step 3: clean again, at the backed-off scale
    s.step(opt)
    s.update()
    return dict(after_first=after_first, skipped_params=skipped_params, momentum=momentum,
                skipped_momentum=skipped_momentum, scale_after_skip=scale_after_skip, returned=returned,
                final=pb.snapshot(), grads=pb.grads(), targets=[c.cpu() for c in pb.targets],
                reference=reference_sgd_run(args, 2), final_scale=s.get_scale())


@pytest.mark.parametrize("value", list(INF_VALUES))
@pytest.mark.parametrize("where", [0, 1, 2], ids=["first", "middle", "last"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_inf_or_nan_skips_step_and_backs_off(scaler, placement, dtype, where, value):
    out = run1(_overflow_then_clean, scaler, placement, dtype, where, value, placement=placement)
    assert equal_lists(out["skipped_params"], out["after_first"]), "an inf/NaN step must not touch params"
    assert equal_lists(out["skipped_momentum"], out["momentum"]), "... nor the optimizer state"
    assert out["returned"] is None, "a skipped step returns None"
    assert out["scale_after_skip"] == 64.0, "scale must back off by backoff_factor (256 * 0.25)"
    assert equal_lists(out["grads"], out["targets"]), "after backoff, grads must be unscaled by the new scale"
    assert equal_lists(out["final"], out["reference"]), "the clean step after a skip must apply normally"
    assert out["final_scale"] == 64.0


def _inf_on_two_devices(spec, placement):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=256.0, backoff_factor=0.25)
    opt = sgd(pb.params)
    before = pb.snapshot()
    pb.backward(s, inject={0: math.inf, 1: math.nan})  # param 0 on CPU, param 1 on CUDA
    s.step(opt)
    s.update()
    return dict(stepped=not equal_lists(pb.snapshot(), before), scale=s.get_scale())


@pytest.mark.parametrize("placement", placement_params(["mixed", "mixed_cpu_scale"]))
def test_inf_on_two_devices_backs_off_once(scaler, placement):
    """found_inf summed over two devices is 2.0: still one skip and one backoff."""
    assert run1(_inf_on_two_devices, scaler, placement, placement=placement) == dict(stepped=False, scale=64.0)


def _param_groups(spec, placement, bad):
    pb = Problem(placement)
    frozen = torch.zeros(3, device=pb.params[0].device, requires_grad=True)  # never gets a grad
    s = build_scaler(spec, pb, init_scale=256.0)
    opt = torch.optim.SGD([{"params": [pb.params[0]]}, {"params": [pb.params[1], frozen, pb.params[2]], "lr": 0.25}],
                          lr=0.5)
    before = pb.snapshot()
    pb.backward(s, inject={bad: math.inf} if bad is not None else None)
    s.step(opt)
    s.update()
    return dict(stepped=[not torch.equal(a, b) for a, b in zip(pb.snapshot(), before)], scale=s.get_scale(),
                grads=pb.grads(), targets=[c.cpu() for c in pb.targets])


@pytest.mark.parametrize("bad", [None, 0, 2], ids=["clean", "inf_in_group0", "inf_in_group1"])
@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_every_param_group_is_checked(scaler, placement, bad):
    out = run1(_param_groups, scaler, placement, bad, placement=placement)
    if bad is None:
        assert out["stepped"] == [True, True, True] and out["scale"] == 256.0
        assert equal_lists(out["grads"], out["targets"]), "every group's grads must be unscaled"
    else:
        assert out["stepped"] == [False, False, False] and out["scale"] == 128.0


def _accumulate(spec, placement, micro_batches):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=128.0)
    opt = sgd(pb.params)
    for _ in range(micro_batches):  # gradient accumulation: several scaled backwards, one step
        pb.backward(s)
    s.step(opt)
    s.update()
    return pb.grads(), [c.cpu() * micro_batches for c in pb.targets]


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_gradient_accumulation_over_several_backwards(scaler, placement):
    grads, want = run1(_accumulate, scaler, placement, 3, placement=placement)
    assert equal_lists(grads, want), "each micro-batch's loss must be scaled by the same scale"


# ------------------------------------------------------------------ the scale rules

def _trajectory(spec, placement, init_scale, growth_factor, backoff_factor, growth_interval, pattern):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
              growth_interval=growth_interval)
    opt = sgd(pb.params, lr=0.0)  # lr 0: params stay put, so grads never overflow by themselves
    return run_steps(s, pb, opt, pattern, bad_index=1)


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_growth_after_exactly_growth_interval_clean_steps(scaler, placement):
    scales = run1(_trajectory, scaler, placement, 128.0, 4.0, 0.5, 3, [False] * 7, placement=placement)
    assert scales == [128.0, 128.0, 512.0, 512.0, 512.0, 2048.0, 2048.0]


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_scale_trajectory_matches_reference_model(scaler, placement):
    rng = torch.Generator().manual_seed(7)
    pattern = (torch.rand(40, generator=rng) < 0.3).tolist()
    pattern[10:14] = [False] * 4  # make sure a growth happens right after a backoff
    got = run1(_trajectory, scaler, placement, 1000.0, 3.0, 0.125, 3, pattern, placement=placement)
    assert got == reference_scales(1000.0, 3.0, 0.125, 3, pattern)


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_growth_never_overflows_to_inf(scaler, placement):
    top = 2.0 ** 127  # float32 max is just under 2**128: one more growth would be inf
    got = run1(_trajectory, scaler, placement, top, 2.0, 0.5, 1, [False, False], placement=placement)
    assert got == [top, top], "growth must be skipped when the grown scale is not finite"


# ------------------------------------------------------------------ state_dict

def _resume(spec, placement, pattern, split):
    train = run_steps
    kw = dict(init_scale=64.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    pb = Problem(placement)
    whole = build_scaler(spec, pb, **kw)
    opt = sgd(pb.params)
    uninterrupted = train(whole, pb, opt, pattern)
    whole_params = pb.snapshot()

    pb = Problem(placement)
    first = build_scaler(spec, pb, **kw)
    opt = sgd(pb.params)
    before = train(first, pb, opt, pattern[:split])
    saved = first.state_dict()
    second = build_scaler(spec, pb, init_scale=2.0**16, growth_interval=2000)  # settings come from the state
    second.load_state_dict(saved)
    after = train(second, pb, opt, pattern[split:])
    return dict(uninterrupted=uninterrupted, resumed=before + after, saved=saved,
                whole_params=whole_params, resumed_params=pb.snapshot())


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_state_dict_round_trip_resumes_identically(scaler, placement):
    pattern = [False, True, False, False, False, False, True, False, False, False, False]
    out = run1(_resume, scaler, placement, pattern, 4, placement=placement)  # saved 2 clean steps into an interval
    saved = out["saved"]
    assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= set(saved)
    assert float(saved["scale"]) == 32.0 and int(saved["_growth_tracker"]) == 2
    assert (float(saved["growth_factor"]), float(saved["backoff_factor"]), int(saved["growth_interval"])) == (2.0, 0.5, 3)
    assert out["resumed"] == out["uninterrupted"] == reference_scales(64.0, 2.0, 0.5, 3, pattern)
    assert equal_lists(out["resumed_params"], out["whole_params"])


# ------------------------------------------------------------------ unscale_, clip, two optimizers, sparse

def _unscale_clip_step(spec, placement, max_norm):
    args = dict(placement=placement)
    pb = Problem(**args)
    s = build_scaler(spec, pb, init_scale=1024.0)
    opt = sgd(pb.params)
    pb.backward(s)
    s.unscale_(opt)
    after_unscale = pb.grads()
    norm = torch.nn.utils.clip_grad_norm_(pb.params, max_norm)
    clipped = pb.grads()
    s.step(opt)
    s.update()
    true_norm = torch.linalg.vector_norm(torch.cat([c.cpu().float().flatten() for c in pb.targets]))
    return dict(after_unscale=after_unscale, targets=[c.cpu() for c in pb.targets], norm=float(norm),
                true_norm=float(true_norm), clipped=clipped, after_step=pb.grads(), params=pb.snapshot(),
                reference=reference_sgd_run(args, 1, clip=max_norm))


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_unscale_then_clip_then_step_unscales_once(scaler, placement):
    out = run1(_unscale_clip_step, scaler, placement, 0.5, placement=placement)
    assert equal_lists(out["after_unscale"], out["targets"]), "unscale_ must leave the true grads"
    assert out["norm"] == pytest.approx(out["true_norm"], rel=1e-6), "clip must see unscaled grads"
    assert equal_lists(out["after_step"], out["clipped"]), "step() after unscale_ must not unscale again"
    assert equal_lists(out["params"], out["reference"])


def _two_optimizers(spec, placement, bad_opts):
    pb = Problem(placement, n_params=2)
    s = build_scaler(spec, pb, init_scale=256.0)
    opt_a, opt_b = sgd([pb.params[0]]), sgd([pb.params[1]])
    before = pb.snapshot()
    pb.backward(s, inject={i: math.inf for i in bad_opts})
    s.step(opt_a)
    s.step(opt_b)
    s.update()
    first = pb.snapshot()
    scale_first = s.get_scale()
    pb.zero_grad()
    pb.backward(s)
    s.step(opt_a)
    s.step(opt_b)
    s.update()
    return dict(before=before, first=first, scale_first=scale_first, second=pb.snapshot(),
                scale_second=s.get_scale())


@pytest.mark.parametrize("bad_opts", [(0,), (1,), (0, 1)], ids=["inf_in_a", "inf_in_b", "inf_in_both"])
@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_two_optimizers_skip_independently_back_off_once(scaler, placement, bad_opts):
    out = run1(_two_optimizers, scaler, placement, bad_opts, placement=placement)
    for i in range(2):
        stepped = not torch.equal(out["first"][i], out["before"][i])
        assert stepped is (i not in bad_opts), f"optimizer {'ab'[i]}: steps iff its own grads are finite"
        assert not torch.equal(out["second"][i], out["first"][i]), "the next clean iteration steps both"
    assert out["scale_first"] == 128.0, "one backoff per update, however many optimizers saw inf"
    assert out["scale_second"] == 128.0


def _sparse(spec, placement, bad):
    pb = Problem(placement)  # only for the devices
    dev = pb.params[0].device
    emb = torch.nn.Embedding(5, 3, sparse=True).to(dev)
    ref = torch.nn.Embedding(5, 3, sparse=True).to(dev)
    ref.load_state_dict(emb.state_dict())
    idx = torch.tensor([0, 2, 2, 4], device=dev)  # a repeated index: uncoalesced grad
    s = build_scaler(spec, pb, init_scale=256.0)
    opt, ref_opt = torch.optim.SGD(emb.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    s.scale(emb(idx).sum().to(pb.loss_device)).backward()
    if bad:
        emb.weight.grad = torch.sparse_coo_tensor(emb.weight.grad._indices(),
                                                  torch.full_like(emb.weight.grad._values(), math.inf),
                                                  emb.weight.grad.shape)
    before = emb.weight.detach().cpu().clone()
    s.step(opt)
    s.update()
    ref(idx).sum().backward()
    ref_opt.step()
    return dict(before=before, after=emb.weight.detach().cpu().clone(), ref=ref.weight.detach().cpu().clone(),
                grad=emb.weight.grad.to_dense().cpu(), ref_grad=ref.weight.grad.to_dense().cpu(),
                scale=s.get_scale())


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "inf"])
@pytest.mark.parametrize("placement", placement_params(["cpu", "cuda", "offload"]))
def test_sparse_grads(scaler, placement, bad):
    out = run1(_sparse, scaler, placement, bad, placement=placement)
    if bad:
        assert torch.equal(out["after"], out["before"]) and out["scale"] == 128.0
    else:
        assert torch.equal(out["grad"], out["ref_grad"]) and torch.equal(out["after"], out["ref"])
        assert out["scale"] == 256.0


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
                stepped_on_inf=bool(torch.isnan(pb.params[0].detach()).any() or torch.isinf(pb.params[0].detach()).any()))


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_disabled_scaler_is_a_pass_through(scaler, placement):
    out = run1(_disabled, scaler, placement, placement=placement)
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
    got = run1(_misuse, scaler, placement, case, placement=placement)
    want = MISUSE[case]
    if want is None:
        assert got is None, f"legal use raised {got}"
    else:
        assert got is not None, f"{case}: must raise {want[0]}"
        assert got[0] == want[0] and want[1] in got[1], f"{case}: got {got}, want {want}"


def _new_scale(spec, placement, as_tensor):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=256.0)
    opt = sgd(pb.params)
    pb.backward(s)
    s.step(opt)
    s.update(torch.tensor(32.0, device=pb.scaler_device) if as_tensor else 32.0)
    set_scale = s.get_scale()
    pb.zero_grad()
    pb.backward(s)
    grads_scaled = [p.grad.detach().cpu().clone() for p in pb.params]
    s.step(opt)
    s.update()
    return dict(set_scale=set_scale, scaled=grads_scaled, targets=[c.cpu() for c in pb.targets],
                grads=pb.grads())


@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_update_with_new_scale(scaler, placement, as_tensor):
    out = run1(_new_scale, scaler, placement, as_tensor, placement=placement)
    assert out["set_scale"] == 32.0
    assert equal_lists(out["scaled"], [c * 32 for c in out["targets"]]), "the next backward uses the new scale"
    assert equal_lists(out["grads"], out["targets"])


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
    assert run1(_forwarding, scaler, placement, False, placement=placement) == ("stepped", "x")
    assert run1(_forwarding, scaler, placement, True, placement=placement) is None


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
    assert run1(_setters, scaler, placement, placement=placement) == ((1, 8.0, 0.125), [512.0, 64.0])
