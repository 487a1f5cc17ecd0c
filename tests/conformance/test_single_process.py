"""The GradScaler contract on one rank, through steps: clean and overflowing steps, every param group and
device checked, gradient accumulation, unscale_ then clip, two optimizers, sparse grads.

Each test builds an exact toy problem (problem.py), runs the scaler under test on a rank of the
pool (world_size 1) and compares what the rank observed with what the contract says. The scale's own
rules are in test_scale_rules.py; settings, the disabled scaler and misuse in test_api.py.
"""
import math

import pytest
import torch

from fsdp_amp_suite.conformance.problem import (DTYPES, INF_VALUES, Problem, build_scaler, equal_lists,
                                                placement_params,
                                       reference_sgd_run, run_at, sgd)

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("single rank")]

ALL_PLACEMENTS = placement_params()


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
    out = run_at(placement, _clean_steps, scaler, placement, dtype, 2)[0]
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
    out = run_at(placement, _overflow_then_clean, scaler, placement, dtype, where, value)[0]
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
    assert run_at(placement, _inf_on_two_devices, scaler, placement)[0] == dict(stepped=False, scale=64.0)


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
    out = run_at(placement, _param_groups, scaler, placement, bad)[0]
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
    grads, want = run_at(placement, _accumulate, scaler, placement, 3)[0]
    assert equal_lists(grads, want), "each micro-batch's loss must be scaled by the same scale"


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
    out = run_at(placement, _unscale_clip_step, scaler, placement, 0.5)[0]
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
    out = run_at(placement, _two_optimizers, scaler, placement, bad_opts)[0]
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
    out = run_at(placement, _sparse, scaler, placement, bad)[0]
    if bad:
        assert torch.equal(out["after"], out["before"]) and out["scale"] == 128.0
    else:
        assert torch.equal(out["grad"], out["ref_grad"]) and torch.equal(out["after"], out["ref"])
        assert out["scale"] == 256.0
