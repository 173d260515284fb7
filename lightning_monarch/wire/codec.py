"""How rank 0's entries and every rank's predictions travel to the controller, and a stage's objects
to the workers: one pickle per message, each CPU tensor as a view of its storage's raw bytes.

Shared by both sides: the workers encode entries and predictions (``worker.loop``,
``worker.actor``) and open the stage's parcels (``worker.stage``); the controller decodes the
former (``controller.mesh.worker_mesh``) and packs the stage's objects with cloudpickle and
:class:`TensorPickling` (``controller.mesh.payload``).

``torch.save`` does the same job, but it writes a zip archive and pickles each storage through a
nested legacy ``torch.save``: about 0.15 ms per message and per tensor on each side (most of what
a fetch of a few logged scalars cost the controller), and half this module's speed on a large
module's weights. This keeps what ``torch.save`` keeps (dtype, shape, strides, storage offset,
and storages shared between tensors, as a state dict's tied weights share theirs) and hands any
other tensor (on a device, sparse, quantized, requiring grad, subclassed) to torch's own pickling.

A :class:`Parcel` is a pickle whose large storages (and large ``bytes``, and the large buffers that
other objects' pickling hands over as ``pickle.PickleBuffer``: NumPy arrays, pandas columns) are
left out of it, out of band (pickle protocol 5), each named by a :class:`StorageKey`: the hash of
its bytes and its size.
Every worker gets the pickle; the storages travel apart, at most once from the controller, and not
at all where the workers already hold storages with those keys (``worker.storages``).
"""

from __future__ import annotations

import copyreg
import ctypes
import inspect
import io
import pickle
import warnings
from collections import ChainMap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import xxhash

from lightning_monarch.memory_files import Identity

#: Storages (and ``bytes``) of at least this many bytes travel out of band in a :class:`Parcel`;
#: smaller ones cost less inside the pickle than as a key of their own.
OUT_OF_BAND_BYTES = 1024


@dataclass(frozen=True)
class StorageKey:
    """What names a storage that travels out of band: the 128-bit xxHash (XXH3) of its bytes, and
    their number. Two storages with the same key hold the same bytes: a change of one bit, of the
    size or of the dtype's bytes makes another key."""

    digest: bytes
    nbytes: int


#: Where a parcel's out-of-band bytes are on the side that packed it: a storage's bytes (a flat
#: ``uint8`` tensor over it), or a ``bytes`` object.
Source = Union[torch.Tensor, bytes]


def storage_key(data: Union[Source, torch.UntypedStorage]) -> StorageKey:
    """The key of a storage or a :data:`Source`: hashed at memory speed (about 20 GB/s on one core
    of the development machine)."""
    view = as_memoryview(data)
    return StorageKey(xxhash.xxh3_128_digest(view), view.nbytes)


def as_memoryview(data: Union[Source, torch.UntypedStorage]) -> memoryview:
    """The bytes of ``data`` (a CPU storage, a :data:`Source`) without a copy, valid while ``data``
    lives. Not through NumPy: ``Tensor.numpy()`` makes the storage unresizable for good, and FSDP2
    frees the storages of the parameters it gathers by resizing them."""
    if isinstance(data, bytes):
        return memoryview(data)
    return memoryview(_raw(data)).cast("B")


def _raw(data: Union[torch.Tensor, torch.UntypedStorage]) -> Any:
    """A ``ctypes`` array over the bytes of a CPU storage, or of a flat ``uint8`` tensor over one."""
    nbytes = data.nbytes() if isinstance(data, torch.UntypedStorage) else data.numel()
    return (ctypes.c_ubyte * nbytes).from_address(data.data_ptr()) if nbytes else bytearray()


@dataclass(frozen=True)
class Parcel:
    """Objects pickled with their large storages out of band: ``data`` is the pickle, ``keys`` name
    the storages it leaves out, in the order :func:`open_parcel` takes them. Where it was packed,
    ``sources`` are their bytes (views of the packed objects' memory, never pickled). ``parts``:
    how many pickles ``data`` holds, one after the other, sharing one memo (:func:`pack`'s ``then``)."""

    data: bytes
    keys: tuple[StorageKey, ...] = ()
    sources: tuple[Source, ...] = field(default=(), compare=False, repr=False)
    parts: int = 1

    def __reduce__(self) -> Any:
        return Parcel, (self.data, self.keys, (), self.parts)

    @property
    def nbytes(self) -> int:
        """The size of the pickle and of the storages it names."""
        return len(self.data) + sum(key.nbytes for key in self.keys)

    def with_copied_sources(self) -> Parcel:
        """This parcel with copies of its sources, which no later write to the packed objects
        changes (``bytes`` are copied by no one)."""
        copies = tuple(source if isinstance(source, bytes) else source.clone() for source in self.sources)
        return Parcel(self.data, self.keys, copies, self.parts)


@dataclass(frozen=True)
class Shipment:
    """How the storages of a stage's parcels that rank 0 does not hold travel from the controller,
    once: in one memory file of the controller's (``memory_files``), each at its page-aligned
    ``offsets``, which a worker on the controller's host opens by ``path`` and maps, or, without
    one, in a message to rank 0 before the stage starts. What a rank still lacks then comes from
    rank 0 over the workers' process group (``worker.storages``)."""

    path: Optional[str] = None
    identity: Identity = (0, 0)
    offsets: dict[StorageKey, int] = field(default_factory=dict)


def encode(value: Any) -> bytes:
    """``value`` pickled for :func:`decode`, every storage inside the pickle."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(value)
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    """The value :func:`encode` pickled; its tensors share no memory with ``data``."""
    return _Unpickler(io.BytesIO(data)).load()


def pack(
    value: Any,
    pickler: Callable[..., pickle.Pickler] = lambda *args, **kwargs: _Pickler(*args, **kwargs),
    then: Optional[Callable[[], Any]] = None,
) -> Parcel:
    """``value`` as a :class:`Parcel`, with the bytes of the storages it leaves out as its sources.
    ``pickler`` makes the pickler (with :class:`TensorPickling`), given the file, the protocol
    and the ``buffer_callback``. ``then`` gives a second value once ``value`` is pickled (what the
    pickler saw decides it), pickled after it with the same memo: what the two share stays shared."""
    sources: list[Source] = []
    instance: Any = None

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        # taken out at once: the pickler drops a buffer once it is saved, and a later buffer (a
        # NumPy array's) may then get its ``id``, and must not get its source
        source = instance.buffer_sources.pop(id(buffer), None)
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND_BYTES:
            return True  # inside the pickle
        sources.append(_foreign_source(raw) if source is None else source)
        return False

    file = io.BytesIO()
    instance = pickler(file, protocol=5, buffer_callback=out_of_band)
    instance.bytes_out_of_band = True
    instance.dump(value)
    if then is not None:
        instance.dump(then())
    # the memo holds the storages' buffers: let them go now, not when the garbage collector breaks
    # the pickler's cycles, which would find the memoryviews under those buffers still exported
    instance.clear_memo()
    keys = tuple(storage_key(source) for source in sources)
    return Parcel(file.getvalue(), keys, tuple(sources), parts=1 if then is None else 2)


def _foreign_source(raw: memoryview) -> torch.Tensor:
    """The source of a buffer that another object's pickling made (a NumPy array's, a pandas
    column's, any ``__reduce_ex__`` that returns a ``pickle.PickleBuffer``): a flat ``uint8``
    tensor over its bytes, without a copy, which keeps the object alive. A read-only buffer is
    only read here, so torch's warning about tensors over one does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(raw, dtype=torch.uint8)


def open_parcel(parcel: Parcel, storages: Sequence[torch.UntypedStorage]) -> Any:
    """The value packed in ``parcel`` (a tuple of its parts where it has more than one), with
    ``storages`` (one per key, in order) as its out-of-band storages: its tensors are views of them."""
    unpickler = _Unpickler(io.BytesIO(parcel.data), storages)
    parts = tuple(unpickler.load() for _ in range(parcel.parts))
    return parts[0] if parcel.parts == 1 else parts


def open_where_packed(parcel: Parcel) -> Any:
    """The value packed in ``parcel``, opened on the side that packed it, as a worker opens it, with
    views of the parcel's sources as its out-of-band storages (no copy of them is made): to find,
    before any worker starts, an object that pickles but cannot be read back."""
    storages = [
        (source if isinstance(source, torch.Tensor) else _foreign_source(memoryview(source))).untyped_storage()
        for source in parcel.sources
    ]
    return open_parcel(parcel, storages)


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
    :func:`decode` or :func:`open_parcel`. In :func:`pack`, large ``bytes`` travel as buffers too."""

    #: Set by :func:`pack`: ``bytes`` of :data:`OUT_OF_BAND_BYTES` and more become buffers, which
    #: the pickler's ``buffer_callback`` leaves out of band.
    bytes_out_of_band = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # read by the pickler's own __init__
        self.dispatch_table: Any = ChainMap(
            {torch.Tensor: _reduce_tensor}, getattr(super(), "dispatch_table", copyreg.dispatch_table)
        )
        super().__init__(*args, **kwargs)
        self._storages: dict[tuple[int, int], int] = {}
        #: The source of every buffer this pickler made, by the buffer's ``id`` (for :func:`pack`).
        self.buffer_sources: dict[int, Source] = {}

    def persistent_id(self, obj: Any) -> Any:
        if self.bytes_out_of_band and type(obj) is bytes and len(obj) >= OUT_OF_BAND_BYTES:
            return ("bytes", self._buffer(obj, obj))
        if type(obj) is not torch.UntypedStorage or obj.device.type != "cpu":
            return None
        key = (obj.data_ptr(), obj.nbytes())
        if key in self._storages:
            return self._storages[key]
        if obj.nbytes():
            self._storages[key] = len(self._storages)
        flat = torch.empty(0, dtype=torch.uint8).set_(obj)
        return self._buffer(_raw(flat), flat)

    def _buffer(self, data: Any, source: Source) -> pickle.PickleBuffer:
        buffer = pickle.PickleBuffer(data)
        self.buffer_sources[id(buffer)] = source
        return buffer


class _Pickler(TensorPickling, pickle.Pickler):
    pass


def reduce_without_new(obj: Any, protocol: int) -> Optional[tuple[Any, ...]]:
    """How to pickle ``obj`` when its class's ``__new__`` demands arguments and the class gives
    pickle none (no ``__getnewargs__``, no reduction of its own): pickle's default way, which calls
    ``cls.__new__(cls)`` when it reads the object back, would fail there (a scientific library's
    condition class validates its arguments in ``__new__``). The object is then made blank, without
    its class's ``__new__``, and given its state, as ``copyreg`` would if it could. ``None`` for any
    other object. Runs on the controller, for the stage's payload."""
    cls = type(obj)
    wants = _NEW_WANTS_ARGUMENTS.get(cls)
    if wants is None:
        wants = _NEW_WANTS_ARGUMENTS[cls] = _new_wants_arguments(cls)
    if not wants:
        return None
    return (_made_blank, (cls,), *obj.__reduce_ex__(protocol)[2:])


#: Whether pickle's default way cannot rebuild instances of a class (:func:`reduce_without_new`), by class.
_NEW_WANTS_ARGUMENTS: dict[type, bool] = {}


def _new_wants_arguments(cls: type) -> bool:
    if issubclass(cls, type) or cls.__new__ is object.__new__:
        return False
    if cls.__reduce_ex__ is not object.__reduce_ex__ or cls.__reduce__ is not object.__reduce__:
        return False
    if hasattr(cls, "__getnewargs_ex__") or hasattr(cls, "__getnewargs__"):
        return False
    try:
        inspect.signature(cls.__new__).bind(cls)
        return False
    except TypeError:
        pass
    except ValueError:  # no signature to read: a builtin's
        return False
    try:
        object.__new__(cls)  # a layout that object's ``__new__`` makes: no builtin base but object
    except TypeError:
        return False
    return True


def made_with_abstract_methods(make: Callable[..., Any], abstract: frozenset[str], *args: Any) -> Any:
    """An abstract class that cloudpickle sends by value (defined in a notebook or a function),
    made with cloudpickle's ``make(*args)`` and given the abstract methods it has where it was
    packed. Runs on the workers, as they open a parcel: cloudpickle makes the class from its bases
    alone, so every abstract method of theirs is abstract in it until its attributes are set, and
    its state leaves out an empty ``__abstractmethods__`` (the same object as ``abc.ABC``'s). A
    class whose attributes stand for its bases' abstract properties (a PINA problem's
    ``conditions``) could then not be instantiated, by its own state's objects least of all."""
    cls = make(*args)
    cls.__abstractmethods__ = abstract
    return cls


def _made_blank(cls: type) -> Any:
    """An instance of ``cls`` made without its ``__new__`` and ``__init__``, for its state to fill.
    Runs on the workers, as they open a parcel (:func:`reduce_without_new`)."""
    return object.__new__(cls)


class _Unpickler(pickle.Unpickler):
    """Rebuilds each storage from its bytes (or takes it out of band) the first time, and shares it
    the times after."""

    def __init__(self, file: io.BytesIO, out_of_band: Sequence[torch.UntypedStorage] = ()) -> None:
        # pickle takes each out-of-band buffer as an object with the buffer protocol (a
        # ``bytes`` one through ``memoryview``): a view of the storage, mapped back to it here
        arrays = [_raw(storage) for storage in out_of_band]
        for array, storage in zip(arrays, out_of_band, strict=True):
            # a NumPy array rebuilt over the buffer keeps it, which keeps its storage alive
            array.storage = storage
        super().__init__(file, buffers=arrays)
        self._out_of_band = {id(array): storage for array, storage in zip(arrays, out_of_band, strict=True)}
        self._storages: list[torch.UntypedStorage] = []

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, int):
            return self._storages[pid]
        if isinstance(pid, tuple):  # ("bytes", its buffer)
            return bytes(pid[1])
        if id(pid) in self._out_of_band:
            storage = self._out_of_band[id(pid)]
        elif not len(pid):
            return torch.UntypedStorage(0)
        else:
            storage = torch.frombuffer(pid, dtype=torch.uint8).untyped_storage()
        self._storages.append(storage)
        return storage
