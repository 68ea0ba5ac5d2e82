"""pipeload.dcp.flatten against DCP's own flatten_state_dict: the same keys in the same order, the same
values (the same objects), the same mappings, the same error on a duplicated key."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten

from pipeload.dcp.flatten import flatten_state_dict


class _Opaque:
    pass


def _cases():
    t = torch.arange(4.0)
    p = torch.nn.Parameter(torch.ones(2))
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 3)).sum().backward()
    optim.step()
    yield "module and optimizer", {"model": model.state_dict(), "optim": optim.state_dict(), "step": 3}
    yield "ordered dict, int keys", OrderedDict([(1, t), ("b", OrderedDict([(2, p), (3, "s")]))])
    yield "lists", {"ints": [1, 2, 3], "tensors": [t, t + 1], "nested": [[1, 2], [t]], "mixed": [1, "a", t],
                    "dicts": [{"a": t}, 5], "deep": [[[1]], [[t]]], "plain_nested": [[1], [2, [3]]]}
    yield "tuples and objects", {"tup": (t, 1), "obj": _Opaque(), "none": None, "f": 1.5, "b": True,
                                 "bytes": b"x", "dtype": torch.float16, "size": torch.Size([2, 3])}
    yield "empty", {"e": {}, "l": [], "top": {"x": {}}}
    yield "empty top", {}


@pytest.mark.parametrize("name,sd", list(_cases()), ids=[n for n, _ in _cases()])
def test_same_as_dcp(name, sd):
    ours, expect = flatten_state_dict(sd), dcp_flatten(sd)
    assert list(ours[0]) == list(expect[0]), name
    assert all(ours[0][k] is expect[0][k] for k in expect[0]), name
    assert ours[1] == expect[1] and list(ours[1]) == list(expect[1]), name


def test_a_subclassed_mapping_and_a_tensor_subclass():
    class Sub(torch.Tensor):
        pass

    class MyDict(dict):
        pass

    sd = {"m": MyDict(a=torch.ones(1).as_subclass(Sub), b=[torch.zeros(1).as_subclass(Sub)])}
    ours, expect = flatten_state_dict(sd), dcp_flatten(sd)
    assert list(ours[0]) == list(expect[0]) == ["m.a", "m.b.0"]
    assert ours[1] == expect[1]


def test_a_duplicated_key_raises_as_dcp_does():
    sd = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    with pytest.raises(ValueError) as dcp_error:
        dcp_flatten(sd)
    with pytest.raises(ValueError) as ours:
        flatten_state_dict(sd)
    assert str(ours.value) == str(dcp_error.value)
