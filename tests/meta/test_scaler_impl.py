"""DeviceSplitGradScaler itself, where it is more than the contract every scaler is judged on: its help() tells its
deliberate differences, update(new_scale) is validated as the constructor validates init_scale, and it pickles as
torch's scaler does."""
import math
import pickle

import pytest
import torch

from scaler_impl import DeviceSplitGradScaler


def test_help_shows_the_class_docstring_with_the_deliberate_differences():
    doc = DeviceSplitGradScaler.__doc__
    assert doc and doc is not torch.amp.GradScaler.__doc__
    assert "Where it differs from ``torch.amp.GradScaler`` on purpose" in doc and "update(new_scale=...)" in doc


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, torch.tensor(0.0), torch.tensor([math.inf])],
                         ids=["zero", "negative", "inf", "nan", "zero-tensor", "inf-tensor"])
def test_update_rejects_a_new_scale_the_constructor_would_reject(bad):
    scaler = DeviceSplitGradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"update\(new_scale=\.\.\.\) must be a finite number > 0, got"):
        scaler.update(new_scale=bad)
    assert scaler.get_scale() == 8.0  # nothing was changed
    scaler.update(new_scale=torch.tensor(2.0))
    assert scaler.get_scale() == 2.0


class _Group:  # a process group stand-in that pickles
    pass


def test_it_pickles_with_the_process_group_it_holds_where_the_group_pickles():
    scaler = DeviceSplitGradScaler("cpu", init_scale=4.0, process_group=_Group())
    copy = pickle.loads(pickle.dumps(scaler))
    assert isinstance(copy.process_group, _Group) and copy.get_scale() == 4.0


def test_a_group_that_does_not_pickle_fails_as_it_does_for_torchs_scaler():
    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle 'ProcessGroup' object")

    with pytest.raises(TypeError, match="cannot pickle 'ProcessGroup' object"):
        pickle.dumps(DeviceSplitGradScaler("cpu", process_group=Unpicklable()))
