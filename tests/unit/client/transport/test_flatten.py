"""Turning a state dict into a skeleton and buffers, without pickling."""

from collections import OrderedDict

import pytest
import torch

from ckptd import protocol
from ckpt_client.transport.flatten import flatten_state_dict


def test_structure_and_plain_values_survive_and_tensors_are_referenced():
    state = OrderedDict(w=torch.ones(2), opt={"step": 3, "betas": (0.9, 0.99), "lr": [1e-3]},
                        name="run", blob=b"\x00\x01", none=None)
    skeleton, tensors = flatten_state_dict(state)
    rebuilt = protocol.unpack_value(skeleton)
    assert rebuilt["w"] == protocol.TensorRef(0) and len(tensors) == 1
    assert rebuilt["opt"] == {"step": 3, "betas": (0.9, 0.99), "lr": [1e-3]}
    assert (rebuilt["name"], rebuilt["blob"], rebuilt["none"]) == ("run", b"\x00\x01", None)


def test_parameters_are_saved_as_plain_detached_tensors():
    _, tensors = flatten_state_dict({"p": torch.nn.Parameter(torch.ones(3))})
    assert type(tensors[0]) is torch.Tensor and not tensors[0].requires_grad


@pytest.mark.parametrize("value, needle", [
    (object(), "state_dict.bad is a object"),
    (torch.ones(2).to_sparse(), "sparse"),
])
def test_values_that_would_need_pickling_are_refused_naming_the_key(value, needle):
    with pytest.raises(TypeError, match=needle):
        flatten_state_dict({"bad": value})
