"""The GradScaler contract on one rank, for the scale itself: growth after exactly growth_interval clean
steps, backoff, the trajectory against the reference model, no growth to inf, update(new_scale=...),
and state_dict round trips that resume identically.

Each test runs the scaler under test on a rank of the pool (world_size 1) and compares what the rank
observed with the reference model (problem.reference_scales).
"""

import pytest
import torch

from fsdp_amp_suite.conformance import checkpoints
from fsdp_amp_suite.conformance.checkpoints import PATTERN, SETTINGS, SPLIT
from fsdp_amp_suite.conformance.problem import (Problem, ScalerModel, build_scaler, equal_lists, placement_params,
                                                reference_scales, run_at,
                                       run_steps, sgd)

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("single rank")]

ALL_PLACEMENTS = placement_params()


# ------------------------------------------------------------------ the scale rules

def _trajectory(spec, placement, init_scale, growth_factor, backoff_factor, growth_interval, pattern):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
              growth_interval=growth_interval)
    opt = sgd(pb.params, lr=0.0)  # lr 0: params stay put, so grads never overflow by themselves
    return run_steps(s, pb, opt, pattern, bad_index=1)


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_growth_after_exactly_growth_interval_clean_steps(scaler, placement):
    scales = run_at(placement, _trajectory, scaler, placement, 128.0, 4.0, 0.5, 3, [False] * 7)[0]
    assert scales == [128.0, 128.0, 512.0, 512.0, 512.0, 2048.0, 2048.0]


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_scale_trajectory_matches_reference_model(scaler, placement):
    rng = torch.Generator().manual_seed(7)
    pattern = (torch.rand(40, generator=rng) < 0.3).tolist()
    pattern[10:14] = [False] * 4  # make sure a growth happens right after a backoff
    got = run_at(placement, _trajectory, scaler, placement, 1000.0, 3.0, 0.125, 3, pattern)[0]
    assert got == reference_scales(1000.0, 3.0, 0.125, 3, pattern)


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_growth_never_overflows_to_inf(scaler, placement):
    top = 2.0 ** 127  # float32 max is just under 2**128: one more growth would be inf
    got = run_at(placement, _trajectory, scaler, placement, top, 2.0, 0.5, 1, [False, False])[0]
    assert got == [top, top], "growth must be skipped when the grown scale is not finite"


# ------------------------------------------------------------------ update(new_scale)

def _new_scale(spec, placement, form):
    pb = Problem(placement)
    s = build_scaler(spec, pb, init_scale=256.0)
    opt = sgd(pb.params)
    pb.backward(s)
    s.step(opt)
    # a float, a 0-dim tensor, or the "1-element tensor" of torch's own AssertionError message (shape [1])
    new = {"float": 32.0, "tensor": torch.tensor(32.0, device=pb.scaler_device),
           "one_element": torch.tensor([32.0], device=pb.scaler_device)}[form]
    s.update(new)
    set_scale = s.get_scale()
    pb.zero_grad()
    pb.backward(s)
    grads_scaled = [p.grad.detach().cpu().clone() for p in pb.params]
    s.step(opt)
    s.update()
    return dict(set_scale=set_scale, scaled=grads_scaled, targets=[c.cpu() for c in pb.targets],
                grads=pb.grads())


@pytest.mark.parametrize("form", ["float", "tensor", "one_element"])
@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_update_with_new_scale(scaler, placement, form):
    out = run_at(placement, _new_scale, scaler, placement, form)[0]
    assert out["set_scale"] == 32.0
    assert equal_lists(out["scaled"], [c * 32 for c in out["targets"]]), "the next backward uses the new scale"
    assert equal_lists(out["grads"], out["targets"])



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
    out = run_at(placement, _resume, scaler, placement, pattern, 4)[0]  # saved 2 clean steps into an interval
    saved = out["saved"]
    assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= set(saved)
    assert float(saved["scale"]) == 32.0 and int(saved["_growth_tracker"]) == 2
    assert (float(saved["growth_factor"]), float(saved["backoff_factor"]),
            int(saved["growth_interval"])) == (2.0, 0.5, 3)
    assert out["resumed"] == out["uninterrupted"] == reference_scales(64.0, 2.0, 0.5, 3, pattern)
    assert equal_lists(out["resumed_params"], out["whole_params"])


# ------------------------------------------------------------------ checkpoints across scalers and torch versions

PEERS = ("torch_amp", "torch_sharded", "ours")  # the scalers whose checkpoints a user brings, or loads ours into
PEER_PLACEMENTS = [p for p in ALL_PLACEMENTS if p.values[0] in ("cpu", "cuda")]  # no race for a built-in peer


def _cross(spec, peer, placement, pattern, split, direction):
    """Train the first `split` steps with one scaler, checkpoint it through torch.save, resume the rest with
    the other (direction "loads": the peer saves, the scaler under test loads; "saves": the other way round).
    The resumed scaler's own state_dict() at the end is part of what it must get right."""
    import io

    pb = Problem(placement)
    first_spec, second_spec = (peer, spec) if direction == "loads" else (spec, peer)
    first = build_scaler(first_spec, pb, **SETTINGS)
    opt = sgd(pb.params)
    before = run_steps(first, pb, opt, pattern[:split])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    second = build_scaler(second_spec, pb)  # the defaults: every setting must come from the checkpoint
    second.load_state_dict(torch.load(buf, weights_only=True))
    after = run_steps(second, pb, opt, pattern[split:])
    end = second.state_dict()
    return dict(scales=before + after, params=pb.snapshot(), end={k: float(v) for k, v in end.items()})


def _end_state() -> dict:
    """The state_dict the contract model ends PATTERN with, every value a float."""
    model = ScalerModel(*SETTINGS.values())
    for bad in PATTERN:
        model.update(bad)
    return {"scale": model.scale, "growth_factor": model.growth_factor, "backoff_factor": model.backoff_factor,
            "growth_interval": float(model.growth_interval), "_growth_tracker": float(model.tracker)}


def _uninterrupted(placement, pattern):
    pb = Problem(placement)
    whole = build_scaler("torch_amp", pb, **SETTINGS)
    opt = sgd(pb.params)
    run_steps(whole, pb, opt, pattern)
    return pb.snapshot()


@pytest.mark.parametrize("direction", ["loads", "saves"])
@pytest.mark.parametrize("peer", PEERS)
@pytest.mark.parametrize("placement", PEER_PLACEMENTS)
def test_a_checkpoint_crosses_between_scalers_and_resumes_identically(scaler, placement, peer, direction):
    """torch.amp.GradScaler's, torch's ShardedGradScaler's and ours' state_dict load into the scaler under test,
    and its state_dict into theirs: the run resumes as if never interrupted."""
    out = run_at(placement, _cross, scaler, peer, placement, PATTERN, SPLIT, direction)[0]
    assert out["scales"] == reference_scales(*SETTINGS.values(), PATTERN)
    assert out["end"] == _end_state()
    assert equal_lists(out["params"], run_at(placement, _uninterrupted, placement, PATTERN)[0])


def _from_file(spec, placement, path, pattern, split):
    pb = Problem(placement)
    s = build_scaler(spec, pb)
    s.load_state_dict(torch.load(path, weights_only=True))
    scales = run_steps(s, pb, sgd(pb.params), pattern[split:])
    return dict(scales=scales, end={k: float(v) for k, v in s.state_dict().items()})


@pytest.mark.parametrize("path", checkpoints.files(), ids=lambda p: p.stem)
@pytest.mark.parametrize("placement", ["cpu"])
def test_a_checkpoint_saved_by_another_torch_loads_and_resumes(scaler, placement, path):
    """Checkpoints of each scaler saved by other torch versions, the oldest supported to the newest
    (fsdp_amp_suite/conformance/checkpoints, each file's name says which), load into the scaler under test on this torch
    and resume the schedule where it stopped."""
    out = run_at(placement, _from_file, scaler, placement, str(path), PATTERN, SPLIT)[0]
    assert out["scales"] == reference_scales(*SETTINGS.values(), PATTERN)[SPLIT:]
    assert out["end"] == _end_state()
