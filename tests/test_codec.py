"""The codec that carries rank 0's entries and the predictions to the controller keeps what
``torch.save`` keeps: values, dtypes, shapes, strides, offsets, and storages shared between tensors.

Runs in this process: it is the same code on both sides.
"""

from __future__ import annotations

import abc
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_monarch.controller.mesh.payload import pack_for_workers
from lightning_monarch.wire.codec import decode, encode
from lightning_monarch.wire.protocol import Entry, LoggerCall


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(0.25),
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.randn(4, 3).t(),
        torch.arange(10.0)[3:7],
        torch.randn(5, dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.randn(3, dtype=torch.complex64),
        torch.empty(0, 4),
        torch.nn.Parameter(torch.randn(3)),
        torch.randn(2, requires_grad=True),
        torch.randn(3).to_sparse(),
    ],
    ids=["scalar", "int", "transposed", "offset", "bf16", "bool", "complex", "empty", "parameter", "grad", "sparse"],
)
def test_a_tensor_comes_back_as_torch_save_brings_it(tensor: torch.Tensor) -> None:
    back = decode(encode(tensor))
    if tensor.is_sparse:
        assert back.is_sparse and torch.equal(back.to_dense(), tensor.to_dense())
    else:
        _same(back, tensor)


def test_tensors_that_share_a_storage_share_it_after() -> None:
    weight = torch.randn(100, 1000)
    state = {"embed.weight": weight, "head.weight": weight.detach(), "rows": weight[1:].t(), "other": torch.randn(2)}
    back = decode(encode(state))
    for key, tensor in state.items():
        _same(back[key], tensor)
    storages = {key: tensor.untyped_storage().data_ptr() for key, tensor in back.items()}
    assert storages["embed.weight"] == storages["head.weight"] == storages["rows"] != storages["other"]
    assert len(encode(state)) < 1.1 * weight.nbytes  # the shared storage travels once


def test_decoded_tensors_are_writable_and_independent_of_the_message() -> None:
    message = encode([torch.ones(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch.frombuffer's warning about a read-only buffer
        (tensor,) = decode(message)
    tensor.add_(1)
    assert torch.equal(decode(message)[0], torch.ones(3))


def test_entries_travel_whole() -> None:
    entries = [
        Entry(
            "module.training_step",
            result={"loss": torch.tensor(1.5)},
            logger_calls=[LoggerCall(0, "log_metrics", ({"loss": torch.tensor(1.5)},), {"step": 3})],
            views={"callback_metrics": {"loss": torch.tensor(1.5)}},
        ),
        Entry(None),
    ]
    back = decode(encode(entries))
    assert [entry.gate for entry in back] == ["module.training_step", None]
    assert back[0].logger_calls[0].args[0]["loss"].item() == 1.5
    assert back[0].views == {"callback_metrics": {"loss": torch.tensor(1.5)}}


class _Problem(abc.ABC):
    """As PINA's problems are: abstract properties that a subclass gives as class attributes."""

    @property
    @abc.abstractmethod
    def conditions(self) -> dict: ...


def _notebook_problem() -> _Problem:
    """A problem class made where it is used, as a notebook makes it: cloudpickle sends it by value.
    Its conditions refer back to the problem, so the class's state holds an instance of it."""

    class Problem(_Problem):
        conditions: dict = {}

    problem = Problem()
    Problem.conditions["x"] = {"problem": problem}
    return problem


def test_an_abstract_class_sent_by_value_is_made_concrete_in_a_fresh_process(tmp_path: Path) -> None:
    parcel = pack_for_workers({"LightningModule": _notebook_problem()}, None)
    (tmp_path / "parcel").write_bytes(parcel.data)
    opened = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from lightning_monarch.wire.codec import Parcel, open_parcel;"
            " (problem,) = open_parcel(Parcel(open(sys.argv[1], 'rb').read()), []);"
            " print(problem.conditions['x']['problem'] is problem)",
            str(tmp_path / "parcel"),
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert opened.stdout.strip() == "True", opened.stderr
