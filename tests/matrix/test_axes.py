"""The matrix's cells: the full product over the FULL axes, every valid pair of the rest, readable ids."""
import itertools

import pytest

from fsdp_amp_suite.matrix import axes, implementations

pytestmark = pytest.mark.matrix


def test_full_axes_are_a_full_product():
    got = {tuple(getattr(c, a) for a in axes.FULL) for c in axes.cells()}
    assert got == set(itertools.product(*(axes.AXES[a] for a in axes.FULL)))


@pytest.mark.parametrize("impl", axes.AXES["impl"])
def test_every_valid_pair_is_covered_by_each_implementation(impl):
    assert not axes.missing_pairs(axes.cells(), impl)


@pytest.mark.parametrize("impl, mesh", [(i, m) for i in axes.AXES["impl"] for m in axes.AXES["mesh"][1:]
                                        if m in axes._allowed(i, "mesh")])
def test_every_valid_pair_is_covered_on_each_mesh(impl, mesh):
    cells = axes.cells()
    assert not axes.missing_mesh_pairs(cells, impl, mesh)
    mine = [c for c in cells if c.impl == impl and c.mesh == mesh]
    assert {(c.shape, c.world_size, c.model) for c in mine} == {((2, 2), 4, "small"), ((2, 4), 8, "small"),
                                                                 ((4, 2), 8, "small")}


@pytest.mark.parametrize("impl, mesh", [(i, m) for i in axes.AXES["impl"] for m in axes.AXES["mesh"][1:]
                                        if m in axes._allowed(i, "mesh")])
def test_each_eight_rank_shape_meets_every_value_in_few_cells(impl, mesh):
    """2x4 and 4x2 (world size 8: only on 8 GPUs) meet every value of the varied axes once; their pairs are the
    2x2 cells' job (the test above), so they cost few cells."""
    cells = axes.cells()
    for shape in axes.AXES["shape"][1:]:
        assert not axes.missing_mesh_values(cells, impl, mesh, shape)
        assert 0 < len([c for c in cells if (c.impl, c.mesh, c.shape) == (impl, mesh, shape)]) <= 4


def test_mesh_cells_are_added_and_only_where_the_implementation_has_the_mesh():
    """The 1d cells are the matrix without the mesh axis (ids and configs); each implementation gets cells on the
    meshes it has (fairscale: none; FSDP1: hsdp; FSDP2: hsdp and tp), and only those."""
    cells = axes.cells()
    assert [c for c in cells if c.mesh == "1d"] == axes.flat_cells()
    assert {(c.impl, c.mesh) for c in cells if c.mesh != "1d"} == {("fsdp1", "hsdp"), ("fsdp2", "hsdp"),
                                                                   ("fsdp2", "tp")}


def test_invalid_combinations_are_not_generated():
    assert {c.params for c in axes.cells() if c.impl == "fsdp2"} == {"orig"}
    assert {c.grads for c in axes.cells() if c.impl != "fsdp1"} == {"upcast"}
    assert all(axes.valid(vars(c)) for c in axes.cells())
    assert not [c for c in axes.cells() if c.grads == "keeplow" and (c.precision == "fp32" or c.optimizer == "adamw")]


def test_ids_are_unique_and_read_like_the_config():
    cells = axes.cells()
    assert len({c.id for c in cells}) == len(cells)
    c = axes.Cell("fsdp1", "offload", "fp16", "nested", 2, "orig", "reshard", "sgd", "keeplow", "clip")
    assert c.id == "fsdp1-offload-fp16-nested-ws2-orig-reshard-sgd-keeplow-clip"
    # the model, groups and mesh axes name only their other values: ids from before the axes stay valid
    assert (axes.Cell(*vars(c).values()).model == "small"
            and axes.Cell(**{**vars(c), "model": "wide"}).id == c.id + "-wide")
    assert axes.Cell(**{**vars(c), "groups": "nodecayfirst", "mesh": "hsdp"}).id == c.id + "-nodecayfirst-hsdp"
    assert axes.Cell(**{**vars(c), "mesh": "tp", "shape": (4, 2)}).id == c.id + "-tp-4x2"


def test_the_wide_model_meets_every_value_of_every_axis_in_few_cells():
    """Pairwise coverage includes the model axis (test above); the wide model costs ~3x a small cell, so it
    gets only the cells its pairs need, and the other axes' choices are those of the matrix without it."""
    cells = axes.cells()
    wide = [c for c in cells if c.model == "wide"]
    assert 0 < len(wide) <= len(cells) // 8
    assert {vars(c)[a] for c in wide for a in ("world_size",)} == set(axes.AXES["world_size"])


def test_each_param_group_order_meets_every_value_in_few_cells():
    """The groups axis changes few 1d cells (the others keep the halves they had), never a flat-params one."""
    flat = axes.flat_cells()
    changed = [c for c in flat if c.groups != "halves"]
    assert 0 < len(changed) <= len(flat) // 4 and all(c.params == "orig" for c in changed)
    assert {c.groups for c in changed} == {"decayfirst", "nodecayfirst"}


def test_a_plugged_implementation_replaces_the_axis():
    cells = axes.cells(["mypkg.wrappers:make"])
    assert {c.impl for c in cells} == {"mypkg.wrappers:make"} and cells[0].id.startswith("mypkg.wrappers-make-")


@implementations.declare(needs=lambda cell, n_gpus: None if n_gpus else "needs a GPU: their wrapper pins memory",
                         loss_on_param_device=True)
def their_declared_wrapper(module, settings):
    return implementations.fsdp1(module, settings)


def their_plain_wrapper(module, settings):
    return implementations.fsdp1(module, settings)


def test_an_implementation_is_one_record_a_plugged_factory_can_declare_too():
    """What the matrix knows of an implementation (what it needs of the machine, where its loss is scaled, the
    grads its scaler gets) is its record: the built-ins' and a plugged factory's declarations, or defaults."""
    declared, plain = f"{__name__}:their_declared_wrapper", f"{__name__}:their_plain_wrapper"
    cell = next(c for c in axes.cells([declared]) if c.world_size == 1)
    assert axes.skip_reason(cell, n_gpus=0) == "needs a GPU: their wrapper pins memory"
    assert axes.skip_reason(cell, n_gpus=1) is None
    assert implementations.record(declared).loss_on_param_device
    plain_record = implementations.record(plain)
    assert plain_record.needs(cell, 0) is None and not plain_record.loss_on_param_device
    assert (implementations.record("fairscale").loss_on_param_device
            and not implementations.record("fsdp1").loss_on_param_device)
    offload = next(c for c in axes.cells(["fsdp1"]) if c.offload == "offload")
    assert "FSDP1 CPUOffload needs an accelerator" in axes.skip_reason(offload, n_gpus=0)
    # meshes: a factory that declares none builds only 1d cells; the others skip, naming the declaration
    hsdp = next(c for c in axes.cells([plain]) if c.mesh == "hsdp")
    assert "does not declare the hsdp mesh" in axes.skip_reason(hsdp, n_gpus=0)
    assert implementations.record("fsdp2").meshes == ("1d", "hsdp", "tp")


def test_natural_cells_are_added_per_implementation_on_its_meshes_with_readable_ids():
    """The overflow axis: its first value (injected) is every other cell's and stays out of ids; the natural cells
    run where axes.NATURAL says an overflow can be born where the kind needs it (see its comment)."""
    natural = axes.natural_cells()
    assert {c.overflow for c in axes.cells()} == {"injected"}
    assert {c.overflow for c in natural} == {"climb", "reduction"}
    assert {(c.impl, c.mesh) for c in natural} == {("fairscale", "1d"), ("fsdp1", "1d"), ("fsdp1", "hsdp"),
                                                   ("fsdp2", "1d"), ("fsdp2", "hsdp"), ("fsdp2", "tp")}
    assert all(c.world_size == 4 for c in natural if c.overflow == "reduction")
    assert all(c.world_size <= 2 or c.mesh == "tp" for c in natural if c.overflow == "climb")
    assert all(c.precision == "fp16" and c.optimizer == "sgd" and axes.valid(vars(c)) for c in natural)
    ids = [c.id for c in axes.cells() + natural]
    assert len(set(ids)) == len(ids)
    assert next(c for c in natural if c.impl == "fsdp2" and c.mesh == "hsdp").id == \
        "fsdp2-nooffload-fp16-nested-ws4-orig-reshard-sgd-upcast-noclip-hsdp-reduction"
