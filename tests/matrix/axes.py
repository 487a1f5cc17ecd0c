"""Every axis of the FSDP-vs-DDP matrix, in one table, and the cells generated from it.

The product of the FULL axes (implementation x offload x precision x wrapping x world size) is
generated whole, and multiplied by the scalers under test in conftest.py. The PAIRWISE axes are
covered in pairs: each cell of the full product gets one choice of them, picked greedily so that
every pair of values (of two pairwise axes, or of a pairwise and a full axis) occurs in some cell.
The whole product (x16) would cost 16x the run time for interactions of three or more settings.
The MODEL axis is covered pairwise too, in a second pass over those cells: the cheap model everywhere,
the wide one in as few cells as cover each of its pairs, so the other axes' choices (and the cells and
ids that existed before the axis) stay as they were.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import astuple, dataclass, fields

from tests.matrix import implementations
from tests.scalers import spec_id


# axis -> its values, as they appear in test ids (in this order); meaning in the comments
AXES = {
    "impl": ("fairscale", "fsdp1", "fsdp2"),   # fairscale FullyShardedDataParallel, torch FSDP1, torch fully_shard
    "offload": ("nooffload", "offload"),        # offload: params and grads on CPU (fairscale cpu_offload +
                                                # move_grads_to_cpu, FSDP1 CPUOffload, FSDP2 CPUOffloadPolicy)
    "precision": ("fp32", "fp16", "bf16"),     # param + reduce dtype (fairscale mixed_precision + compute_dtype)
    "wrapping": ("rootwrap", "nested"),        # root only; or every block wrapped, one block inside another
    "world_size": (1, 2, 4, 8),                # ids ws1 ... ws8; 8 only on a host with 8 GPUs
    "params": ("flat", "orig"),                # fairscale flatten_parameters / FSDP1 use_orig_params=False;
                                               # FSDP2 has one mode (orig)
    "reshard": ("reshard", "noreshard"),       # reshard after forward (FSDP1: FULL_SHARD vs SHARD_GRAD_OP)
    "optimizer": ("sgd", "adamw"),             # SGD + momentum (Adam hides scale errors); AdamW fused=True
    "grads": ("upcast", "keeplow"),            # grads the scaler and optimizer see: upcast to fp32, or kept in
                                               # the reduce dtype (FSDP1 keep_low_precision_grads; SGD then
                                               # runs without foreach, which rejects fp16 grads on fp32 params)
    "clip": ("noclip", "clip"),                # clip: unscale_, then the implementation's clip_grad_norm_
    "model": ("small", "wide"),                # small: 4 blocks, 10 params of up to 143 elements; wide: 314 params
                                               # (150 side by side) and one of 281600 elements, more than four
                                               # 65536-element chunks of CUDA's multi-tensor kernels (cell.py)
}
FULL = ("impl", "offload", "precision", "wrapping", "world_size")
PAIRWISE = ("params", "reshard", "optimizer", "grads", "clip")
MODEL = "model"  # pairwise, in a second pass; its first value is the default and is left out of ids
ONLY = {  # (implementation, axis) -> the values it has; others are invalid
    ("fsdp2", "params"): ("orig",),
    ("fsdp2", "grads"): ("upcast",),      # no keep_low_precision_grads in FSDP2
    ("fairscale", "grads"): ("upcast",),  # no such option (its no-offload mixed precision keeps them low anyway)
}
EXCLUDED = {  # pairs of values no cell has: {(axis, value), (axis, value)} -> why
    frozenset({("grads", "keeplow"), ("precision", "fp32")}): "fp32 grads are already full precision",
    frozenset({("grads", "keeplow"), ("optimizer", "adamw")}): "fused AdamW needs grads in its params' dtype",
}


def comparable(config: dict) -> bool:
    """Not generated: AdamW in fp16/bf16 at world size >= 4, or >= 2 with the wide model. There the two
    sides' low-precision reductions round differently (sum orders; the divide by the world size before
    or after the sum), and Adam turns a nearly cancelling grad of the other sign into a whole lr step:
    seen 0.011 on the H200 and 0.0012 on CPU (small model, world size 4), and 0.014 in one element of
    the wide model's 281600-element weight on the H200 (fsdp2, offload, fp16, world size 2, after the
    losses agreed to 2e-6 at every step), so no tolerance derived from the dtype holds. AdamW still
    meets every world size in fp32 and every precision at world size 1 (no reduction), and at world
    size 2 with the small model (bit-identical sums there)."""
    if config["optimizer"] != "adamw" or config["precision"] == "fp32":
        return True
    return config["world_size"] < (2 if config.get(MODEL) == "wide" else 4)


def valid(config: dict) -> bool:
    """A configuration the matrix generates: comparable, and no EXCLUDED pair of values."""
    return comparable(config) and not any(pair <= set(config.items()) for pair in EXCLUDED)


@dataclass(frozen=True)
class Cell:
    impl: str
    offload: str
    precision: str
    wrapping: str
    world_size: int
    params: str
    reshard: str
    optimizer: str
    grads: str
    clip: str
    model: str = AXES[MODEL][0]

    @property
    def id(self) -> str:
        return "-".join(f"ws{v}" if f.name == "world_size" else spec_id(str(v))
                        for f, v in zip(fields(self), astuple(self)) if not (f.name == MODEL and v == AXES[MODEL][0]))

    def __str__(self) -> str:
        return self.id


def _allowed(impl: str, axis: str) -> tuple:
    return ONLY.get((impl, axis), AXES[axis])


def cells(impls=AXES["impl"]) -> list[Cell]:
    """The full product of FULL axes (over the given implementations), pairwise over PAIRWISE.

    Each implementation covers every pair on its own (its cells may be the only ones a machine can
    run); among equally good choices the least used one wins, so the pairwise axes stay balanced.
    """
    out = []
    for impl in impls:
        uncovered = _valid_pairs(impl)
        used = collections.Counter()
        for core in itertools.product(*(AXES[a] if a != "impl" else (impl,) for a in FULL)):
            base = dict(zip(FULL, core))
            options = [extra for extra in itertools.product(*(_allowed(impl, a) for a in PAIRWISE))
                       if valid({**base, **dict(zip(PAIRWISE, extra))})]
            best = max(options, key=lambda extra: (len(_pairs({**base, **dict(zip(PAIRWISE, extra))}) & uncovered),
                                                   -used[extra]))
            used[best] += 1
            chosen = {**base, **dict(zip(PAIRWISE, best))}
            uncovered -= _pairs(chosen)
            out.append(chosen)
    return [Cell(**config) for config in _with_models(out)]


def _with_models(configs: list[dict]) -> list[dict]:
    """Each config gets the default model, except the fewest (greedy) that cover every (wide, value) pair."""
    configs = [{**c, MODEL: AXES[MODEL][0]} for c in configs]
    for model in AXES[MODEL][1:]:
        for impl in {c["impl"] for c in configs}:
            mine = [c for c in configs if c["impl"] == impl and valid({**c, MODEL: model})]
            uncovered = {pair for pair in _valid_pairs(impl) if (MODEL, model) in pair}
            while uncovered:
                # among equally good cells the smallest world size: more machines can run it
                best = max(mine, key=lambda c: (len(_pairs({**c, MODEL: model}) & uncovered), -c["world_size"]))
                uncovered -= _pairs({**best, MODEL: model})
                best[MODEL] = model
    return configs


def _valid_pairs(impl: str) -> set:
    axes = FULL + PAIRWISE + (MODEL,)
    values = {a: (impl,) if a == "impl" else _allowed(impl, a) for a in axes}
    return {((a, va), (b, vb)) for a, b in itertools.combinations(axes, 2) if not (a in FULL and b in FULL)
            for va in values[a] for vb in values[b] if frozenset({(a, va), (b, vb)}) not in EXCLUDED}


def _pairs(config: dict) -> set:
    axes = FULL + PAIRWISE + ((MODEL,) if MODEL in config else ())
    return {((a, config[a]), (b, config[b])) for a, b in itertools.combinations(axes, 2)
            if not (a in FULL and b in FULL)}


def missing_pairs(generated: list[Cell], impl: str) -> set:
    """Valid value pairs that no cell of this implementation covers (for the coverage test)."""
    have = set().union(*(_pairs(vars(c)) for c in generated if c.impl == impl))
    return _valid_pairs(impl) - have


def skip_reason(cell: Cell, n_gpus: int) -> str | None:
    """Why this machine cannot run the cell (n_gpus: CUDA devices visible), or None: what the matrix needs,
    then what the cell's implementation declares it needs (implementations.py)."""
    if cell.world_size == 8 and n_gpus < 8:
        return f"world size 8 runs only on a host with 8 GPUs (one per rank, NCCL); {n_gpus} visible"
    return implementations.record(cell.impl).needs(cell, n_gpus)


def cell_device_mode(cell: Cell, n_gpus: int) -> str:
    """The rank harness's device mode: gloo on CPU; NCCL with a GPU per rank; else gloo ranks sharing GPU 0."""
    if n_gpus == 0:
        return "cpu"
    return "cuda" if cell.world_size <= n_gpus else "cuda-shared"
