"""Where a scaler check puts the scale, the params (hence grads) and the loss: the placements table.

Plain data, below everything that names placements: the conformance suite parametrizes by it
(fsdp_amp_suite/conformance/problem.py), KNOWN_BUGS and the race rules name placements by its derived lists,
and a matrix cell translates itself into these terms (fsdp_amp_suite/matrix/axes.py Cell.check_param).
"""

# placement -> where the scaler's device, the params (hence grads) and the loss live
PLACEMENTS = {
    "cpu": dict(scaler="cpu", params=("cpu",), loss="cpu"),
    "cuda": dict(scaler="cuda", params=("cuda",), loss="cuda"),
    # FSDP CPU offload: compute (and loss, and scale) on the GPU, grads land on CPU
    "offload": dict(scaler="cuda", params=("cpu",), loss="cuda"),
    # fairscale issue #421's loss.to(model_device): a CUDA-device scaler whose first scaled loss is on CPU
    "cpu_loss": dict(scaler="cuda", params=("cpu",), loss="cpu"),
    # one model with grads on both devices: an inf on one device only must still be seen
    "mixed": dict(scaler="cuda", params=("cpu", "cuda"), loss="cuda"),
    # grads on both devices and the scale on CPU (its first scaled loss was on CPU)
    "mixed_cpu_scale": dict(scaler="cuda", params=("cpu", "cuda"), loss="cpu"),
}
CPU_PLACEMENTS = ["cpu"]
GPU_PLACEMENTS = ["cuda", "offload", "cpu_loss", "mixed"]  # the default set; mixed_cpu_scale is opt-in


def placements_where(holds) -> tuple:
    """The placements whose PLACEMENTS entry satisfies `holds`, in table order: the lists KNOWN_BUGS and the race
    rules name placements by are derived here, not typed."""
    return tuple(name for name, where in PLACEMENTS.items() if holds(where))


# the scale a lazily placed scaler makes lives with its first scaled loss
SCALE_ON_CPU = placements_where(lambda w: w["loss"] == "cpu")
CPU_GRADS = placements_where(lambda w: "cpu" in w["params"])
ONLY_CPU_GRADS = placements_where(lambda w: w["params"] == ("cpu",))
CPU_GRADS_CUDA_SCALE = placements_where(lambda w: "cpu" in w["params"] and w["loss"] == "cuda")
# grads on a device other than the scale's: copies of inv_scale or found_inf cross between CPU and CUDA
GRADS_OFF_SCALE_DEVICE = placements_where(lambda w: set(w["params"]) != {w["loss"]})
