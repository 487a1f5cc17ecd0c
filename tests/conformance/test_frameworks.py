"""The scaler inside the frameworks people train with: a plain loop, accelerate, Lightning, with and without FSDP.

Each framework trains the same model for STEPS steps through an overflow, saves its checkpoint, loads it into
fresh objects and trains RESUMED steps more, once with the scaler under test and once with
torch.amp.GradScaler (the oracle), in one fresh process per framework (accelerate and Lightning keep
process-wide state). Every loss, every scale after update() and the final params must be equal: both scalers
unscale with the same float32 inv_scale through the same kernel and skip the same steps, so there is no
rounding to tolerate. accelerate and Lightning are test dependencies (requirements-integrations.txt); where one
is missing its check skips and says so. Both run fp16 loss scaling on CPU too, but FSDP only on a GPU: the FSDP
variants (one rank, the harness's process group) skip elsewhere.
"""
import importlib.util
import os
import tempfile

import pytest
import torch

from fsdp_amp_suite.harness import Harness
from fsdp_amp_suite.versions import import_problem

pytestmark = [pytest.mark.conformance, pytest.mark.report_column("frameworks")]

STEPS, RESUMED, BATCH, WIDTH = 6, 4, 8, 16
OVERFLOW_BATCH = 2  # its inputs are 1e20: the loss and the grads overflow in any dtype, so that step must be skipped
SETTINGS = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
# name -> (the package it needs, the FSDP it wraps the model in: None, 1 or 2)
FRAMEWORKS = {"plain": (None, None), "accelerate": ("accelerate", None), "accelerate-fsdp1": ("accelerate", 1),
              "accelerate-fsdp2": ("accelerate", 2), "lightning": ("lightning", None),
              "lightning-fsdp": ("lightning", 1)}
NO_CPU_FSDP = ("accelerate and Lightning wrap a model in FSDP only on a GPU (accelerate: FSDP is a multi-GPU "
               "distributed type; Lightning: 'The strategy `fsdp` requires a GPU accelerator')")


def _data(device) -> torch.Tensor:
    x = torch.randn(STEPS + RESUMED, BATCH, WIDTH, generator=torch.Generator().manual_seed(0))
    x[OVERFLOW_BATCH] *= 1e20
    return x.to(device)


def _model(device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 4)).to(device)


def _loss(model, x) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def _scaler(spec, device):
    if spec == "oracle":
        return torch.amp.GradScaler(device, **SETTINGS)
    from fsdp_amp_suite.scalers import make_scaler
    return make_scaler(spec, device=device, **SETTINGS)


def _params(model) -> list:
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # FSDP2: DTensors
    return [p.detach().float().cpu() for p in full]


# ------------------------------------------------------------------ one run per framework: (losses, scales, params)

def _plain(spec, device, ckpt, fsdp):
    data, losses, scales = _data(device), [], []

    def train(model, opt, scaler, batches):
        for x in batches:
            with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
                loss = _loss(model, x)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
            scales.append(scaler.get_scale())

    model = _model(device)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _scaler(spec, device)
    train(model, opt, scaler, data[:STEPS])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, ckpt)
    state = torch.load(ckpt)
    model = _model(device)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _scaler(spec, device)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    scaler.load_state_dict(state["scaler"])
    train(model, opt, scaler, data[STEPS:])
    return losses, scales, _params(model)


def _accelerate(spec, device, ckpt, fsdp):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    data, losses, scales = _data(device), [], []
    if fsdp:  # accelerate's launcher variables for the harness's one rank, whose process group is up
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")

    def prepared():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp) if fsdp else None
        accelerator = Accelerator(mixed_precision="fp16", cpu=device == "cpu", fsdp_plugin=plugin)
        assert bool(fsdp) == (accelerator.distributed_type == "FSDP"), accelerator.distributed_type
        accelerator.scaler = _scaler(spec, device)  # accelerate has no argument for it: set before prepare()
        model = _model(device)
        if fsdp == 1:  # FSDP1 flattens the params: the optimizer is made on the prepared model (accelerate's guide)
            model = accelerator.prepare(model)
            return accelerator, model, accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        return accelerator, model, opt

    def train(accelerator, model, opt, batches):
        for x in batches:
            with accelerator.autocast():
                loss = _loss(model, x)
            accelerator.backward(loss)
            opt.step()  # AcceleratedOptimizer: scaler.step(opt), scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
            scales.append(accelerator.scaler.get_scale())

    accelerator, model, opt = prepared()
    train(accelerator, model, opt, data[:STEPS])
    accelerator.save_state(ckpt)
    accelerator, model, opt = prepared()
    accelerator.load_state(ckpt)
    train(accelerator, model, opt, data[STEPS:])
    return losses, scales, _params(model)


def _lightning(spec, device, ckpt, fsdp):
    import lightning as L
    from lightning.pytorch.plugins import FSDPPrecision, MixedPrecision
    from lightning.pytorch.strategies import FSDPStrategy

    losses, scales = [], []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model(device)

        def training_step(self, batch, batch_idx):
            return _loss(self.model, batch[0])

        def on_train_batch_end(self, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())
            scales.append(self.trainer.precision_plugin.scaler.get_scale())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def precision():
        if not fsdp:
            return MixedPrecision("16-mixed", device, scaler=_scaler(spec, device))
        plugin = FSDPPrecision("16-mixed")  # FSDPPrecision(scaler=...) raises in 2.6.6: it reads self.precision unset
        plugin.scaler = _scaler(spec, device)
        return plugin

    def trainer(steps):
        return L.Trainer(accelerator=device, devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         strategy=FSDPStrategy() if fsdp else "auto", plugins=[precision()],
                         use_distributed_sampler=False)  # FSDP's DistributedSampler would shuffle the overflow rows

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_data("cpu").flatten(0, 1)), batch_size=BATCH)
    first = trainer(STEPS)
    first.fit(Module(), loader)
    first.save_checkpoint(ckpt)
    module, resumed = Module(), trainer(STEPS + RESUMED)
    resumed.fit(module, loader, ckpt_path=ckpt)  # restores the scaler's state_dict through the precision plugin
    return losses, scales, _params(module.model)


RUNS = {"plain": _plain, "accelerate": _accelerate, "lightning": _lightning}


def _both(framework, spec, device):
    """The scaler under test's run and the oracle's, in this (fresh) process."""
    import warnings

    warnings.filterwarnings("ignore")
    run, fsdp = RUNS[framework.split("-")[0]], FRAMEWORKS[framework][1]
    with tempfile.TemporaryDirectory() as tmp:
        return {who: run(who, device, os.path.join(tmp, who), fsdp) for who in (spec, "oracle")}


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_training_in_a_framework_matches_torchs_scaler_through_an_overflow_and_a_resume(scaler, framework):
    package, fsdp = FRAMEWORKS[framework]
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"needs {package} (a test dependency): pip install -r requirements-integrations.txt")
    broken = package and import_problem(package)
    if broken:
        pytest.skip(broken)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if fsdp and device == "cpu":
        pytest.skip(NO_CPU_FSDP)
    with Harness(isolate=True) as harness:
        out = harness.run(_both, framework, scaler, device, world_size=1, device=device, timeout=240)[0]
    (losses, scales, params), (want_losses, want_scales, want_params) = out[scaler], out["oracle"]
    before = [SETTINGS["init_scale"]] + want_scales[:-1]
    assert any(b < a for a, b in zip(before, want_scales)) and any(b > a for a, b in zip(before, want_scales)), \
        f"the oracle's run neither backed off nor grew: it proves nothing (scales {want_scales})"
    assert scales == want_scales, f"{framework}: scale after each update(): {scales}, torch's scaler: {want_scales}"
    assert list(map(repr, losses)) == list(map(repr, want_losses)), \
        f"{framework}: losses {losses}, torch's scaler: {want_losses}"  # repr: the overflowing step's NaN equals NaN
    assert all(torch.equal(p, q) for p, q in zip(params, want_params)), f"{framework}: the final params differ"
