"""Turning a state dict into a skeleton and buffers, without pickling."""

import warnings
from collections import OrderedDict

import pytest
import torch

from ckptd import protocol
from ckpt_client.transport.flatten import buffers_of, describe, flatten_state_dict
from ckpt_client.transport.pool_copy import PoolCopier


def test_structure_and_plain_values_survive_and_tensors_are_referenced():
    state = OrderedDict(w=torch.ones(2), opt={"step": 3, "betas": (0.9, 0.99), "lr": [1e-3]},
                        name="run", blob=b"\x00\x01", none=None)
    skeleton, tensors, _, _ = flatten_state_dict(state)
    rebuilt = protocol.unpack_value(skeleton)
    assert rebuilt["w"] == protocol.TensorRef(0) and len(tensors) == 1
    assert rebuilt["opt"] == {"step": 3, "betas": (0.9, 0.99), "lr": [1e-3]}
    assert (rebuilt["name"], rebuilt["blob"], rebuilt["none"]) == ("run", b"\x00\x01", None)


def test_parameters_are_staged_as_they_are_and_their_copy_leaves_autograd_alone():
    """No detach per tensor: the walk hands over the parameter itself, and the copy into
    the pool (which runs without autograd) records nothing and leaves the pool plain."""
    param = torch.nn.Parameter(torch.arange(3, dtype=torch.float32))
    flat = flatten_state_dict({"p": param, "nested": [param * 2]})
    assert flat.tensors[0] is param and flat.tensors[1].requires_grad
    buffers = buffers_of(flat.layout)
    offsets, total = protocol.layout_extent([b[2] for b in buffers])
    pool = torch.zeros(total, dtype=torch.uint8)
    PoolCopier(pool).copy(0, offsets, buffers, flat.tensors, [0, 1], on_cpu=flat.on_cpu)
    assert not pool.requires_grad and pool.grad_fn is None
    staged = pool[offsets[1]:offsets[1] + 12].view(torch.float32)
    assert staged.tolist() == [0.0, 2.0, 4.0] and not staged.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64,
                                   torch.float64])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (4, 3)])
def test_buffers_made_from_the_layout_describe_each_tensor_as_it_is(dtype, shape):
    """The layout (dtype, shape) is what the walk reads instead of describing each tensor:
    the descriptions made from it are exactly each tensor's own, non-contiguous views
    and zero-size tensors included, and the walk sees whether every tensor is on the CPU."""
    base = torch.zeros(shape, dtype=dtype)
    tensors = [base, base.t() if base.dim() == 2 else base, base.expand(2, *shape)]
    flat = flatten_state_dict({"t": tensors})
    assert buffers_of(flat.layout) == [describe(t) for t in tensors] and flat.on_cpu


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # torch deprecates making them, not holding them
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize("make, needle", [
    (object, "state_dict.bad is a object"),
    (lambda: torch.ones(2).to_sparse(), "sparse"),
    (_quantized, "quantized"),
    (lambda: torch.zeros(2, dtype=torch.float8_e5m2fnuz), "dtype torch.float8_e5m2fnuz"),
])
def test_values_that_would_need_pickling_are_refused_naming_the_key(make, needle):
    with pytest.raises(TypeError, match=needle):
        flatten_state_dict({"bad": make()})


def test_subclasses_of_containers_and_leaves_take_the_slow_checks_and_still_flatten():
    """The walk tests exact types first; subclasses (namedtuple, dict subclasses) and
    refused tensor subclasses must fare exactly as before."""
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    class Plain(dict):
        pass

    state = Plain(pair=Pair(torch.zeros(1), 2), flag=True, nested=[OrderedDict(x=1.5)])
    skeleton, tensors, _, _ = flatten_state_dict(state)
    assert protocol.unpack_value(skeleton) == {"pair": (protocol.TensorRef(0), 2),
                                               "flag": True, "nested": [{"x": 1.5}]}
    assert len(tensors) == 1

    class Tagged(torch.Tensor):
        pass

    with pytest.raises(TypeError, match=r"state_dict\.deep\[1\]: tensor subclass Tagged"):
        flatten_state_dict({"deep": [1, torch.ones(2).as_subclass(Tagged)]})
