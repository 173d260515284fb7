"""How rank 0's entries and every rank's predictions travel to the controller, and the stage's
payload to the workers: one pickle per message, each CPU tensor as a view of its storage's raw bytes.

Shared by both sides: the workers encode entries and predictions (``worker.loop``,
``worker.actor``) and decode the payload (``worker.stage``); the controller decodes the former
(``controller.mesh``) and pickles the payload with cloudpickle and :class:`TensorPickling`
(``controller.payload``).

``torch.save`` does the same job, but it writes a zip archive and pickles each storage through a
nested legacy ``torch.save``: about 0.15 ms per message and per tensor on each side (most of what
a fetch of a few logged scalars cost the controller), and half this module's speed on a large
module's weights. This keeps what ``torch.save`` keeps (dtype, shape, strides, storage offset,
and storages shared between tensors, as a state dict's tied weights share theirs) and hands any
other tensor (on a device, sparse, quantized, requiring grad, subclassed) to torch's own pickling.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections import ChainMap
from typing import Any

import torch


def encode(value: Any) -> bytes:
    """``value`` pickled for :func:`decode`."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(value)
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    """The value :func:`encode` (or a pickler with :class:`TensorPickling`) pickled; its tensors
    share no memory with ``data``."""
    return _Unpickler(io.BytesIO(data)).load()


def _tensor(
    storage: torch.UntypedStorage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    plain = (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.__dict__
    )
    if not plain:
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _tensor, (
        tensor.untyped_storage(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


class TensorPickling:
    """Mixed into a pickler (``pickle``'s, or cloudpickle's for the stage's payload): each plain
    tensor travels as its storage (raw bytes, once per storage) and its view of it, for
    :func:`decode`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # read by the pickler's own __init__
        self.dispatch_table: Any = ChainMap(
            {torch.Tensor: _reduce_tensor}, getattr(super(), "dispatch_table", copyreg.dispatch_table)
        )
        super().__init__(*args, **kwargs)
        self._storages: dict[tuple[int, int], int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not torch.UntypedStorage or obj.device.type != "cpu":
            return None
        key = (obj.data_ptr(), obj.nbytes())
        if key in self._storages:
            return self._storages[key]
        if obj.nbytes():
            self._storages[key] = len(self._storages)
        return pickle.PickleBuffer(torch.empty(0, dtype=torch.uint8).set_(obj).numpy().data)


class _Pickler(TensorPickling, pickle.Pickler):
    pass


class _Unpickler(pickle.Unpickler):
    """Rebuilds each storage from its bytes the first time, and shares it the times after."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._storages: list[torch.UntypedStorage] = []

    def persistent_load(self, pid: Any) -> torch.UntypedStorage:
        if isinstance(pid, int):
            return self._storages[pid]
        if not len(pid):
            return torch.UntypedStorage(0)
        storage = torch.frombuffer(pid, dtype=torch.uint8).untyped_storage()
        self._storages.append(storage)
        return storage
