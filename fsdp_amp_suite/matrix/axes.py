"""Every axis of the FSDP-vs-DDP matrix, in one table, and the cells generated from it.

The product of the FULL axes (implementation x offload x precision x wrapping x world size) is
generated whole, and multiplied by the scalers under test in conftest.py. The PAIRWISE axes are
covered in pairs: each cell of the full product gets one choice of them, picked greedily so that
every pair of values (of two pairwise axes, or of a pairwise and a full axis) occurs in some cell.
The whole product (x16) would cost 16x the run time for interactions of three or more settings.
The MODEL and GROUPS axes are covered pairwise too, in later passes over those cells: the default value
everywhere, each other value in as few cells as cover each of its pairs, so the other axes' choices (and the
cells and ids that existed before the axis) stay as they were.
The MESH axis adds cells: its first value (1d) is every cell above; each other mesh gets its own cells, at
world size 4 (a 2x2 mesh), pairwise over every axis that varies there; then, at world size 8, a few cells per
SHAPE (2x4, 4x2) that meet every value of those axes once (mesh_cells).
"""
from __future__ import annotations

import collections
import itertools
import math
from dataclasses import astuple, dataclass, fields

from fsdp_amp_suite.matrix import implementations
from fsdp_amp_suite.scalers import spec_id


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
    "groups": ("halves", "decayfirst", "nodecayfirst"),  # the optimizer's two param groups: the first and the
                                               # second half of the params; or weights and biases (decay and
                                               # no decay: norms and biases, which TP replicates), either first
    "mesh": ("1d", "hsdp", "tp"),              # 1d: one flat group over the world; hsdp: a 2x2 (replicate,
                                               # shard) mesh, FSDP1 HYBRID_SHARD / FSDP2 on the 2D mesh; tp: a
                                               # 2x2 (dp, tp) mesh, a Colwise/Rowwise TP plan on tp, then FSDP2
                                               # over dp (cell.TP_PLAN)
    "shape": ((2, 2), (2, 4), (4, 2)),         # a mesh's (dim 0, dim 1) sizes, ids 2x2 ...: 2x2 at world size 4;
                                               # 2x4 and 4x2 at world size 8 (only with 8 GPUs). 1d cells: unused
    "overflow": ("injected", "climb", "reduction"),  # injected: the schedule of cell.py (values written into grads,
                                               # overflowing inputs); climb: the scale grows until the fp16 backward
                                               # overflows by itself, cycle after cycle; reduction: every rank's grads
                                               # finite, their fp16 sum overflows (natural_cells)
}
FULL = ("impl", "offload", "precision", "wrapping", "world_size")
PAIRWISE = ("params", "reshard", "optimizer", "grads", "clip")
MODEL = "model"  # pairwise, in a second pass; its first value is the default and is left out of ids
GROUPS = "groups"  # pairwise, in a third pass; likewise
MESH = "mesh"  # extra cells (mesh_cells); its first value is every other cell's, left out of ids
SHAPE = "shape"  # of the mesh cells; its first value (2x2: runs on CPU and on one GPU) is left out of ids
OVERFLOW = "overflow"  # extra cells (natural_cells); its first value is every other cell's, left out of ids
LATER = (MODEL, GROUPS)  # the axes of the later passes, in order
ONLY = {  # (implementation, axis) -> the values it has; others are invalid
    ("fsdp2", "params"): ("orig",),
    ("fsdp2", "grads"): ("upcast",),      # no keep_low_precision_grads in FSDP2
    ("fairscale", "grads"): ("upcast",),  # no such option (its no-offload mixed precision keeps them low anyway)
    ("fairscale", "mesh"): ("1d",),       # no hybrid sharding, no DTensor
    ("fsdp1", "mesh"): ("1d", "hsdp"),    # FSDP1 does not compose with DTensor tensor parallelism here
}
EXCLUDED = {  # pairs of values no cell has: {(axis, value), (axis, value)} -> why
    frozenset({("grads", "keeplow"), ("precision", "fp32")}): "fp32 grads are already full precision",
    frozenset({("grads", "keeplow"), ("optimizer", "adamw")}): "fused AdamW needs grads in its params' dtype",
    frozenset({("params", "flat"), ("groups", "decayfirst")}): "a flat param holds a unit's weights and biases in one",
    frozenset({("params", "flat"), ("groups", "nodecayfirst")}): "a flat param holds a unit's weights and biases "
                                                                 "in one",
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
    groups: str = AXES[GROUPS][0]
    mesh: str = AXES[MESH][0]
    shape: tuple = AXES[SHAPE][0]
    overflow: str = AXES[OVERFLOW][0]

    @property
    def id(self) -> str:
        return "-".join(_id_part(f.name, v) for f, v in zip(fields(self), astuple(self))
                        if not (f.name in (MODEL, GROUPS, MESH, SHAPE, OVERFLOW) and v == AXES[f.name][0]))

    def __str__(self) -> str:
        return self.id

    def placement(self, cuda: bool) -> str:
        """This cell in the conformance suite's placement terms (fsdp_amp_suite/placements.py)."""
        if not cuda:
            return "cpu"
        if self.offload != "offload":
            return "cuda"
        # an implementation that moves the loss to the params' device (fairscale issue #421's path) scales it on CPU
        return "cpu_loss" if implementations.record(self.impl).loss_on_param_device else "offload"

    def grad_dtype(self) -> str:
        """This cell in the conformance suite's dtype terms (problem.DTYPES): the grads its scaler gets."""
        low = {"fp16": "float16", "bf16": "bfloat16"}.get(self.precision)
        return low if low and implementations.record(self.impl).low_precision_grads(self) else "float32"

    def check_param(self, name: str, cuda: bool):
        """What a KNOWN_BUGS condition on `name` reads of this cell: its placement, its grads' dtype, or an axis
        (AttributeError for a name that is none of these: a typo in a condition fails loudly)."""
        if name == "placement":
            return self.placement(cuda)
        if name == "dtype":
            return self.grad_dtype()
        return getattr(self, name)


def _id_part(axis: str, value) -> str:
    if axis == "world_size":
        return f"ws{value}"
    return "x".join(map(str, value)) if axis == SHAPE else spec_id(str(value))


def _allowed(impl: str, axis: str) -> tuple:
    return ONLY.get((impl, axis), AXES[axis])


def cells(impls=AXES["impl"]) -> list[Cell]:
    """The 1d cells (flat_cells), then each implementation's cells on every other mesh it has (mesh_cells)."""
    return flat_cells(impls) + [c for impl in impls for c in mesh_cells(impl)]


def flat_cells(impls=AXES["impl"]) -> list[Cell]:
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
    for axis in LATER:
        out = _later_pass(out, axis)
    return [Cell(**config) for config in out]


def _later_pass(configs: list[dict], axis: str) -> list[dict]:
    """Each config gets the axis's default, except the fewest (greedy) that cover every (value, other) pair of
    its other values. A config is changed only once, and only while every pair it covers with the default stays
    covered by another config."""
    done = LATER[:LATER.index(axis)]
    default = AXES[axis][0]
    configs = [{**c, axis: default} for c in configs]
    for value in AXES[axis][1:]:
        for impl in {c["impl"] for c in configs}:
            mine = [c for c in configs if c["impl"] == impl]
            with_default = collections.Counter(p for c in mine for p in _pairs(c) if (axis, default) in p)
            uncovered = {pair for pair in _valid_pairs(impl, done + (axis,)) if (axis, value) in pair}
            while uncovered:
                free = [c for c in mine if c[axis] == default and valid({**c, axis: value})
                        and all(with_default[p] > 1 for p in _pairs(c) if (axis, default) in p)]
                # among equally good cells the smallest world size: more machines can run it
                best = max(free, key=lambda c: (len(_pairs({**c, axis: value}) & uncovered), -c["world_size"]),
                           default=None)
                if best is None or not _pairs({**best, axis: value}) & uncovered:
                    raise AssertionError(f"no {impl} cell can take {axis}={value} for the pairs {sorted(uncovered)}")
                with_default.subtract(p for p in _pairs(best) if (axis, default) in p)
                uncovered -= _pairs({**best, axis: value})
                best[axis] = value
    return configs


MESH_VARIED = tuple(a for a in FULL + PAIRWISE + (GROUPS,) if a not in ("impl", "world_size"))  # axes a mesh cell
                                                                                                # varies


def _mesh_options(impl: str, mesh: str, shape: tuple) -> list[dict]:
    """Every valid config of the implementation on that mesh and shape (its world size), the small model."""
    fixed = dict(impl=impl, world_size=math.prod(shape), model=AXES[MODEL][0], mesh=mesh, shape=shape)
    options = (dict(fixed, **dict(zip(MESH_VARIED, values)))
               for values in itertools.product(*(_allowed(impl, a) for a in MESH_VARIED)))
    return [c for c in options if valid(c)]


def mesh_cells(impl: str) -> list[Cell]:
    """The implementation's cells on each mesh but 1d (greedy: the valid config covering most of what is left):
    on the 2x2 shape every valid pair of values of the varied axes; on each other shape (world size 8) every
    value once, so the shape meets each value (its pairs with the rest are covered at 2x2, which more
    machines run)."""
    out = []
    for mesh in _allowed(impl, MESH)[1:]:
        for shape in AXES[SHAPE]:
            covers = _mesh_pairs if shape == AXES[SHAPE][0] else _mesh_values
            options = _mesh_options(impl, mesh, shape)
            uncovered = set().union(*(covers(c) for c in options))
            while uncovered:
                best = max(options, key=lambda c: len(covers(c) & uncovered))
                uncovered -= covers(best)
                out.append(Cell(**best))
    return out


# overflow kind -> the (offload, world size, mesh) it runs at, for every implementation that has the mesh. fp16, nested,
# SGD, upcast grads, no clip: the overflow is the variable. climb at world size 1 and 2 (a tp mesh: dp 2): there
# FSDP divides by 2 before an fp16 sum of 2, so no sum exceeds its largest term and every overflow is born in a
# rank's backward, on the ranks whose shard holds it. reduction at world size 4 (1d and hsdp): FSDP divides by 2
# before and after an fp16 sum of 4 (FSDP1 _get_gradient_predivide_factor, FSDP2 _get_gradient_divide_factors,
# fairscale alike), so a sum can reach twice its largest term: with every rank's data the same, each overflow is
# born in the reduction (in HSDP's replicate all-reduce), on the ranks that own the element.
NATURAL = {
    "climb": (("nooffload", 1, "1d"), ("offload", 1, "1d"), ("nooffload", 2, "1d"), ("offload", 2, "1d"),
              ("nooffload", 4, "tp")),
    "reduction": (("nooffload", 4, "1d"), ("nooffload", 4, "hsdp")),
}


def natural_cells(impls=AXES["impl"]) -> list[Cell]:
    """The cells whose overflows training makes by itself (NATURAL), for each implementation on the meshes it has."""
    out = []
    for kind, configs in NATURAL.items():
        for impl in impls:
            for offload, world_size, mesh in configs:
                if mesh in _allowed(impl, MESH):
                    params = "flat" if impl == "fairscale" else "orig"  # fairscale: mixed precision needs flat
                    out.append(Cell(impl, offload, "fp16", "nested", world_size, params, "reshard", "sgd", "upcast",
                                    "noclip", mesh=mesh, overflow=kind))
    return out


def _mesh_pairs(config: dict) -> set:
    return {((a, config[a]), (b, config[b])) for a, b in itertools.combinations(MESH_VARIED, 2)}


def _mesh_values(config: dict) -> set:
    return {(a, config[a]) for a in MESH_VARIED}


def _valid_pairs(impl: str, later=LATER) -> set:
    axes = FULL + PAIRWISE + later
    values = {a: (impl,) if a == "impl" else _allowed(impl, a) for a in axes}
    return {((a, va), (b, vb)) for a, b in itertools.combinations(axes, 2) if _paired(a, b)
            for va in values[a] for vb in values[b] if frozenset({(a, va), (b, vb)}) not in EXCLUDED}


def _paired(a: str, b: str) -> bool:
    """Two axes whose pairs of values must meet: not two FULL axes (their product is whole), and not two LATER
    axes (each later axis changes few cells; the wide model's cells cannot take every param-group order)."""
    return not (a in FULL and b in FULL) and not (a in LATER and b in LATER)


def _pairs(config: dict) -> set:
    axes = FULL + PAIRWISE + tuple(a for a in LATER if a in config)
    return {((a, config[a]), (b, config[b])) for a, b in itertools.combinations(axes, 2) if _paired(a, b)}


def missing_pairs(generated: list[Cell], impl: str) -> set:
    """Valid value pairs that no 1d cell of this implementation covers (for the coverage test)."""
    have = set().union(*(_pairs(vars(c)) for c in generated if c.impl == impl and c.mesh == AXES[MESH][0]))
    return _valid_pairs(impl) - have


def missing_mesh_pairs(generated: list[Cell], impl: str, mesh: str) -> set:
    """Valid value pairs of the varied axes that no 2x2 cell of this implementation on this mesh covers."""
    shape = AXES[SHAPE][0]
    valid_pairs = set().union(*(_mesh_pairs(c) for c in _mesh_options(impl, mesh, shape)))
    have = set().union(*(_mesh_pairs(vars(c)) for c in generated
                         if c.impl == impl and c.mesh == mesh and c.shape == shape))
    return valid_pairs - have


def missing_mesh_values(generated: list[Cell], impl: str, mesh: str, shape: tuple) -> set:
    """Valid values of the varied axes that no cell of this implementation on this mesh and shape has."""
    valid_values = set().union(*(_mesh_values(c) for c in _mesh_options(impl, mesh, shape)))
    have = set().union(*(_mesh_values(vars(c)) for c in generated
                         if c.impl == impl and c.mesh == mesh and c.shape == shape))
    return valid_values - have


def skip_reason(cell: Cell, n_gpus: int) -> str | None:
    """Why this machine cannot run the cell (n_gpus: CUDA devices visible), or None: what the matrix needs,
    then what the cell's implementation declares it needs (implementations.py)."""
    if cell.world_size == 8 and n_gpus < 8:
        return f"world size 8 runs only on a host with 8 GPUs (one per rank, NCCL); {n_gpus} visible"
    impl = implementations.record(cell.impl)
    if cell.mesh not in impl.meshes:
        return (f"{cell.impl} does not declare the {cell.mesh} mesh (it declares {', '.join(impl.meshes)}: "
                f"implementations.declare(meshes=...))")
    return impl.needs(cell, n_gpus)


def cell_device_mode(cell: Cell, n_gpus: int) -> str:
    """The rank harness's device mode: gloo on CPU; NCCL with a GPU per rank; else gloo ranks sharing GPU 0."""
    if n_gpus == 0:
        return "cpu"
    return "cuda" if cell.world_size <= n_gpus else "cuda-shared"
