"""Property tests of the codec: whatever Python's own pickler takes under protocol 5 travels to a
worker and arrives equal to ``pickle.loads(pickle.dumps(x, protocol=5))``.

Runs in this process, through the pieces a stage's objects pass on the real path: the stage's
pickler (``controller.mesh.payload``), the controller's copies of the storages rank 0 lacks
(``controller.mesh.storages``), the parcel pickled as Monarch sends it, and a worker's
``WorkerStorages`` and ``open_parcel``. Entries and predictions travel by ``encode``/``decode``,
checked on the same objects.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.extra import pandas as hpd

from lightning_monarch.controller.mesh.payload import _ReferenceRecorder
from lightning_monarch.controller.mesh.storages import copies, lacking
from lightning_monarch.wire.codec import OUT_OF_BAND_BYTES, Parcel, Shipment, decode, encode, open_parcel, pack
from lightning_monarch.wire.specs import TrainerConfig
from lightning_monarch.worker.storages import WorkerStorages

#: The stage's Trainer flags where the value travels: one CPU worker, which needs no process group.
ONE_CPU_WORKER = TrainerConfig("cpu", 1, 1, "32-true", None, {}, {})
PROPERTIES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def through_a_worker(value: Any) -> Any:
    """``value`` as a worker opens it at a stage's start: packed by the stage's pickler, its
    storages sent in a message to rank 0, opened there."""
    parcel = pack(value, lambda *args, **kwargs: _ReferenceRecorder(*args, **kwargs))
    sent = pickle.loads(pickle.dumps(parcel))  # the parcel in a Monarch message: no sources
    storages = lacking([parcel], frozenset())
    worker = WorkerStorages()
    worker.receive(storages, copies(storages))
    worker.gather([sent], Shipment(), ONE_CPU_WORKER, writes=True)
    return open_parcel(sent, worker.take(sent))


def through_an_entry(value: Any) -> Any:
    """``value`` as the controller decodes it from rank 0's entries or a rank's predictions."""
    return decode(encode(value))


ROUTES: dict[str, Callable[[Any], Any]] = {"stage": through_a_worker, "entry": through_an_entry}


def reference(value: Any) -> Any:
    return pickle.loads(pickle.dumps(value, protocol=5))


class Same:
    """Asserts that what the codec brought equals what pickle's round trip brings: the same types
    and values (NaNs bit for bit), and the same sharing: two places that hold one object in one
    hold one in the other. Tensors that view one storage view one after the codec as in the
    original, as ``torch.save`` keeps them (pickle's round trip gives each its own copy)."""

    def __init__(self) -> None:
        self._pairs: dict[int, int] = {}
        self._storages: dict[int, int] = {}
        self._keep: list[Any] = []  # ids stay unique while both objects live

    def __call__(self, got: Any, want: Any, original: Any, path: str = "value") -> None:
        assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
        if isinstance(want, (int, float, complex, str, bool, type(None))):
            assert repr(got) == repr(want), f"{path}: {got!r} != {want!r}"
            return
        if id(want) in self._pairs:
            assert self._pairs[id(want)] == id(got), f"{path}: shared in one, not in the other"
            return
        assert id(got) not in self._pairs.values(), f"{path}: shared in one, not in the other"
        self._pairs[id(want)] = id(got)
        self._keep += [got, want]
        if isinstance(want, torch.Tensor):
            self._tensor(got, want, original, path)
        elif isinstance(want, np.ndarray):
            self._array(got, want, original, path)
        elif isinstance(want, (pd.DataFrame, pd.Series)):
            self._frame(got, want, path)
        elif isinstance(want, (bytes, bytearray)):
            assert got == want, path
        elif isinstance(want, memoryview):
            assert (got.tobytes(), got.readonly, got.format) == (want.tobytes(), want.readonly, want.format), path
        elif isinstance(want, (list, tuple)):
            assert len(got) == len(want), path
            for index, (a, b, c) in enumerate(zip(got, want, original, strict=True)):
                self(a, b, c, f"{path}[{index}]")
        elif isinstance(want, dict):
            assert list(got) == list(want), path
            for key in want:
                self(got[key], want[key], original[key], f"{path}[{key!r}]")
        else:
            self(vars(got), vars(want), vars(original), f"{path}.__dict__")

    def _tensor(self, got: torch.Tensor, want: torch.Tensor, original: torch.Tensor, path: str) -> None:
        assert (got.dtype, got.shape, got.requires_grad, got.layout) == (
            want.dtype,
            want.shape,
            want.requires_grad,
            want.layout,
        ), path
        if want.is_sparse:
            self(got._indices(), want._indices(), original._indices(), f"{path}._indices()")
            self(got._values(), want._values(), original._values(), f"{path}._values()")
            return
        assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset()), path
        if want.numel():  # a view of no element shares nothing
            self._same_storage(got.untyped_storage().data_ptr(), original.untyped_storage().data_ptr(), path)
        assert _bits(got) == _bits(want), f"{path}: other values"

    def _array(self, got: np.ndarray, want: np.ndarray, original: np.ndarray, path: str) -> None:
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert (got.flags.c_contiguous, got.flags.f_contiguous, got.flags.writeable) == (
            want.flags.c_contiguous,
            want.flags.f_contiguous,
            want.flags.writeable,
        ), path
        if want.dtype.hasobject:
            for index in np.ndindex(want.shape):
                self(got[index], want[index], original[index], f"{path}[{index}]")
        else:
            assert got.tobytes() == want.tobytes(), f"{path}: other values"

    def _frame(self, got: Any, want: Any, path: str) -> None:
        if isinstance(want, pd.DataFrame):
            pd.testing.assert_frame_equal(got, want, check_exact=True, obj=path)
        else:
            pd.testing.assert_series_equal(got, want, check_exact=True, obj=path)

    def _same_storage(self, got: int, original: int, path: str) -> None:
        if original in self._storages:
            assert self._storages[original] == got, f"{path}: views one storage in one, not in the other"
        else:
            assert got not in self._storages.values(), f"{path}: shares a storage in one, not in the other"
            self._storages[original] = got


def _bits(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1).contiguous()
    return bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def check(value: Any, route: str) -> None:
    Same()(ROUTES[route](value), reference(value), value)


class PickleBufferUser:
    """An object whose pickling hands its bytes to the pickler as a ``PickleBuffer``, as Python's
    documentation shows for zero-copy pickling (``ZeroCopyByteArray``)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: int) -> Any:
        return type(self)._rebuild, (pickle.PickleBuffer(self.data),)

    @classmethod
    def _rebuild(cls, buffer: Any) -> PickleBufferUser:
        return cls(bytes(memoryview(buffer)))


class MemoryviewUser(PickleBufferUser):
    """Holds a ``memoryview`` (which itself cannot be pickled) of its bytes, and pickles it as a buffer."""

    def __init__(self, data: Any) -> None:
        super().__init__(memoryview(data))

    @classmethod
    def _rebuild(cls, buffer: Any) -> MemoryviewUser:
        return cls(bytearray(memoryview(buffer)))


class Reduced:
    """An object with its own ``__reduce_ex__``: arguments, state and list items."""

    def __init__(self, name: str, scale: Any = None) -> None:
        self.name, self.scale, self.items = name, scale, []

    def __reduce_ex__(self, protocol: int) -> Any:
        return Reduced, (self.name,), {"scale": self.scale}, iter(self.items)

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)


# -- the objects ------------------------------------------------------------------------------------

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)
plain_dtypes = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(),
    hnp.unsigned_integer_dtypes(),
    hnp.floating_dtypes(),
    hnp.complex_number_dtypes(),
    hnp.datetime64_dtypes(),
    hnp.timedelta64_dtypes(),
    hnp.byte_string_dtypes(),
    hnp.unicode_string_dtypes(),
)
structured_dtypes = hnp.array_dtypes(subtype_strategy=plain_dtypes, min_size=1, max_size=4)


@st.composite
def numpy_arrays(draw: Any) -> np.ndarray:
    """Arrays of every dtype (structured too), 0-d to 3-d, with views: sliced, transposed,
    Fortran-ordered, read-only; some large enough to travel out of band."""
    dtype = draw(st.one_of(plain_dtypes, structured_dtypes))
    shape = (draw(st.integers(OUT_OF_BAND_BYTES // 4, 3000)),) if draw(st.booleans()) else draw(shapes)
    array = draw(hnp.arrays(dtype, shape))
    view = draw(st.sampled_from(["whole", "sliced", "transposed", "fortran", "readonly"]))
    if view == "sliced" and array.ndim:
        array = array[:: draw(st.integers(1, 3))]
    elif view == "transposed":
        array = array.T
    elif view == "fortran":
        array = np.asfortranarray(array)
    elif view == "readonly":
        array.flags.writeable = False
    return array


object_arrays = st.lists(st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=20).map(
    lambda items: np.array(items, dtype=object)
)


@st.composite
def frames(draw: Any) -> Any:
    """DataFrames with mixed columns (numbers, strings, booleans, datetimes, categories), and Series."""
    rows = draw(st.integers(0, 400))
    frame = draw(
        hpd.data_frames(
            [
                hpd.column("f", dtype=float),
                hpd.column("i", dtype=np.int64),
                hpd.column("b", dtype=bool),
                hpd.column("s", elements=st.text(max_size=4)),
                hpd.column("t", dtype="datetime64[ns]"),
            ],
            index=hpd.range_indexes(min_size=rows, max_size=rows),
        )
    )
    frame["c"] = pd.Categorical(frame["s"])
    return frame if draw(st.booleans()) else frame[draw(st.sampled_from(list(frame.columns)))]


tensor_dtypes = st.sampled_from(
    [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.complex64]
)


@st.composite
def tensors(draw: Any) -> Any:
    """Tensors and tensors that share a storage: views, transposes, offsets, parameters that
    require grad, sparse ones; some large enough to travel out of band."""
    dtype = draw(tensor_dtypes)
    rows, columns = draw(st.integers(0, 40)), draw(st.integers(0, 40))
    base = (torch.randn(rows, columns, dtype=torch.float64) * 10).to(dtype)
    kind = draw(st.sampled_from(["plain", "views", "transposed", "parameter", "grad", "sparse"]))
    if kind == "views":
        return {"base": base, "rows": base[1:], "t": base.t(), "flat": base.reshape(-1)[3:]}
    if kind == "transposed":
        return base.t()
    if kind in ("parameter", "grad") and (dtype.is_floating_point or dtype.is_complex):
        return torch.nn.Parameter(base) if kind == "parameter" else base.clone().requires_grad_()
    if kind == "sparse":
        return base.to_sparse()
    return base


buffer_users = st.binary(min_size=0, max_size=3 * OUT_OF_BAND_BYTES).flatmap(
    lambda data: st.sampled_from(
        [data, bytearray(data), PickleBufferUser(data), PickleBufferUser(bytearray(data)), MemoryviewUser(data)]
    )
)

leaves = st.one_of(
    numpy_arrays(),
    object_arrays,
    frames(),
    tensors(),
    buffer_users,
    st.integers(),
    st.text(max_size=8),
    st.floats(allow_nan=True),
)


@st.composite
def nested(draw: Any) -> Any:
    """Lists, tuples, dicts and ``Reduced`` objects over a pool of leaves, each leaf possibly held
    in several places (shared references)."""
    pool = draw(st.lists(leaves, min_size=1, max_size=4))
    picks = st.sampled_from(pool)
    tree = st.recursive(
        picks,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(st.text(max_size=3), children, max_size=4),
            st.tuples(st.text(max_size=3), children, st.lists(children, max_size=3)).map(_reduced),
        ),
        max_leaves=8,
    )
    return draw(tree)


def _reduced(parts: tuple[str, Any, list[Any]]) -> Reduced:
    reduced = Reduced(parts[0], parts[1])
    reduced.extend(parts[2])
    return reduced


# -- the properties ---------------------------------------------------------------------------------

routes = pytest.mark.parametrize("route", sorted(ROUTES))


@routes
@PROPERTIES
@given(numpy_arrays())
def test_numpy_arrays_of_every_dtype_and_layout(route: str, array: np.ndarray) -> None:
    check(array, route)


@routes
@PROPERTIES
@given(object_arrays)
def test_numpy_object_arrays(route: str, array: np.ndarray) -> None:
    check(array, route)


@routes
@PROPERTIES
@given(frames())
def test_pandas_frames_and_series_with_mixed_columns(route: str, frame: Any) -> None:
    check(frame, route)


@routes
@PROPERTIES
@given(buffer_users)
def test_bytes_and_objects_that_pickle_with_buffers(route: str, value: Any) -> None:
    check(value, route)


@routes
@PROPERTIES
@given(tensors())
def test_tensors_views_and_parameters(route: str, value: Any) -> None:
    check(value, route)


@routes
@PROPERTIES
@given(nested())
def test_nested_containers_with_shared_references(route: str, value: Any) -> None:
    check(value, route)


def test_a_large_array_travels_out_of_band_once_and_arrives_writable() -> None:
    """A NumPy array's buffer is left out of the pickle, as a storage is, and named once however
    often the array is held; the worker's array is its own."""
    array = np.arange(4096, dtype=np.float64)
    parcel = pack({"a": array, "again": array, "copy": array.copy()})
    assert isinstance(parcel, Parcel) and len(parcel.data) < OUT_OF_BAND_BYTES
    assert len(parcel.keys) == 2 and parcel.keys[0] == parcel.keys[1]  # equal bytes, two arrays
    back = through_a_worker({"a": array, "again": array, "copy": array.copy()})
    assert back["a"] is back["again"] and back["a"] is not back["copy"]
    back["a"][0] = -1.0
    assert array[0] == 0.0 and back["copy"][0] == 0.0


@routes
def test_an_array_pickled_after_a_tensor_arrives_with_its_own_bytes(route: str) -> None:
    """Found by the property above: a reduced object's items (a tensor) are pickled before its
    state (an array). The pickler drops the storage's buffer once it is saved, and the array's
    buffer may then take its ``id``; the array must still travel with its own bytes."""
    for dtype in (np.float64, np.uint8):
        check(_reduced(("", np.zeros(2048, dtype=dtype), [torch.randn(9, 15, dtype=torch.float64)])), route)
