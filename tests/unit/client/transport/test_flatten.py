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


def test_subclasses_of_containers_and_leaves_take_the_slow_checks_and_still_flatten():
    """The walk tests exact types first; subclasses (namedtuple, dict subclasses) and
    refused tensor subclasses must fare exactly as before."""
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    class Plain(dict):
        pass

    state = Plain(pair=Pair(torch.zeros(1), 2), flag=True, nested=[OrderedDict(x=1.5)])
    skeleton, tensors = flatten_state_dict(state)
    assert protocol.unpack_value(skeleton) == {"pair": (protocol.TensorRef(0), 2),
                                               "flag": True, "nested": [{"x": 1.5}]}
    assert len(tensors) == 1

    class Tagged(torch.Tensor):
        pass

    with pytest.raises(TypeError, match=r"state_dict\.deep\[1\]: tensor subclass Tagged"):
        flatten_state_dict({"deep": [1, torch.ones(2).as_subclass(Tagged)]})
