"""Arrow-backed pandas arrays on gpushuffle's path: taken, and pickled.

:func:`take` gathers rows of an Arrow-backed array with one ``pyarrow``
take and none of pandas' per-call checks (a pass over the indices for their
maximum, another for negative values, a fresh boolean array): the split
takes every column with the same valid, non-negative positions.

Pickling, out of band, what pickle would copy: Arrow-backed pandas arrays,
cut to their rows, and numpy datetimes.

pandas pickles an Arrow-backed array (the default ``str`` dtype, ``ArrowDtype``
columns) through ``combine_chunks()``, which copies every byte, and pyarrow
pickles a sliced array with its parent's whole buffers.  A shard's string
columns would be copied once more on every send and spill, and a chunk of a
shard would carry the bytes of all its other chunks.

:class:`OutOfBandPickler` sends each chunk's buffers as views instead, cut to
the chunk's rows: the validity bitmap from the byte holding its first bit,
the values of fixed-width types, and for strings and binaries the offsets
plus only the data bytes they point to.  Offsets of a cut that does not
start at the first byte of its data are rebased into a new buffer (the only
copy, of the offsets alone); received buffers are never written to, as they
may be the sender's own memory (an in-process comm, a test).
Other Arrow types (nested, dictionary, booleans) fall back to pandas'
pickling.

Pickling by anyone else (distributed spilling or sending an output, the
client gathering it), in a process that imported gpushuffle's pandas
backend, without pandas' copies (:func:`register_pickling`): pandas'
Arrow-backed arrays of strings, binaries and fixed-width types keep their
chunks, instead of ``combine_chunks()``'s copy of every byte, and a chunk
that is a slice of a larger array is copied to its rows alone (pyarrow
would pickle the parent's buffers); its datetime and timedelta arrays send
an int64 view out of band.  Only arrays of at least
:data:`PICKLE_IN_PLACE_MIN_BYTES`.  The pickle names only pandas, numpy,
pyarrow and the standard library, unpickles anywhere (pandas' own
``__setstate__``), and gives the same values, an Arrow column in the chunks
it had.  ``gpushuffle.memory.pickle-without-copy: false`` gives pandas' way
back.

numpy pickles datetime64 and timedelta64 arrays in band (a copy into the
pickle, and another out of it): they go as an int64 view instead.

Pickles that only this process reads back (a spill file) take dtypes by
reference into a :class:`PickleMemo` instead of pickling them: a piece
spilled is one output partition's rows of a shard, and pickling a
categorical's dtype (its categories, an Index) once per piece cost more
than the piece's other fourteen columns together (measured: 113 us of a
420 us round trip for 5,000 rows of the benchmark's mixed columns).

Every ``PickleBuffer`` here wraps an Arrow buffer or a numpy array, never a
``memoryview``: CPython before 3.12.7 crashes (SIGSEGV) when the garbage
collector breaks a reference cycle holding a memoryview that a
``PickleBuffer``, or a memoryview made from one (the frames that
``PickleBuffer.raw()`` gives), still exports (cpython#77894, #122306).
Frames end up in such cycles whenever an exception's traceback holds them.
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import io
import operator
import pickle
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pandas.api.extensions import ExtensionDtype
from pandas.arrays import ArrowExtensionArray

from gpushuffle import config
from gpushuffle.engine import copies
from gpushuffle.engine.pool import watch_arrow_frees

#: Offsets' width of the variable-width types cut by their offsets.
_OFFSET_TYPES = {
    pa.string(): np.int32,
    pa.binary(): np.int32,
    pa.large_string(): np.int64,
    pa.large_binary(): np.int64,
}


def _fixed_width(type: pa.DataType) -> int | None:
    """Bytes per value of a fixed-width type with a plain values buffer, else None."""
    if pa.types.is_boolean(type) or pa.types.is_dictionary(type):
        return None
    try:
        bits = type.bit_width
    except ValueError:
        return None
    return bits // 8 if bits % 8 == 0 and type.num_buffers == 2 else None


def _cuttable(type: pa.DataType) -> bool:
    return type in _OFFSET_TYPES or _fixed_width(type) is not None


def _out_of_band(array: np.ndarray) -> pickle.PickleBuffer:
    # numpy's stubs do not declare the buffer protocol numpy implements.
    return pickle.PickleBuffer(cast(Any, array))


def _view(buffer: pa.Buffer, start: int, stop: int) -> pickle.PickleBuffer:
    # Never a PickleBuffer of a memoryview: see the module's docstring.
    return pickle.PickleBuffer(buffer.slice(start, stop - start))


#: Per thread, while :func:`dumps` runs: the ids of the out-of-band buffers
#: that make up Arrow chunks (see :func:`dumps`' ``chunk_buffers``).
_pickling = threading.local()


def _chunk_buffer(buffer: pickle.PickleBuffer) -> pickle.PickleBuffer:
    ids = getattr(_pickling, "chunk_ids", None)
    if ids is not None:
        ids.add(id(buffer))
    return buffer


def _reduce_array(array: pa.Array) -> tuple[Any, ...]:
    """The rebuild arguments of one chunk: its type, shape and cut buffers."""
    validity, *rest = array.buffers()
    if validity is not None and array.null_count == 0:
        # Nothing to say (a take can leave an all-valid bitmap): the chunk
        # goes without one, and starts at its first row, not mid-byte.
        validity = None
    # A bitmap is cut on a byte boundary: the chunk keeps the offset of its
    # first bit in that byte, and every other buffer starts at the same row.
    shift = array.offset % 8 if validity is not None else 0
    first = array.offset - shift
    length = len(array)
    rows = shift + length
    bitmap = (
        None
        if validity is None
        else _chunk_buffer(_view(validity, first // 8, (first + rows + 7) // 8))
    )
    offset_type = _OFFSET_TYPES.get(array.type)
    data_view: pickle.PickleBuffer | None = None
    if offset_type is not None:
        offsets_buffer, data = rest
        width = np.dtype(offset_type).itemsize
        offsets = np.frombuffer(offsets_buffer, offset_type, count=rows + 1, offset=first * width)
        base, end = int(offsets[0]), int(offsets[-1])
        if base:
            offsets = offsets - offsets.dtype.type(base)
            copies.count("serialize", offsets.nbytes)
        values = _chunk_buffer(_out_of_band(offsets))
        data_view = _chunk_buffer(_view(data if data is not None else pa.py_buffer(b""), base, end))
    else:
        itemsize = _fixed_width(array.type)
        assert itemsize is not None
        values = _chunk_buffer(_view(rest[0], first * itemsize, (first + rows) * itemsize))
    return (
        array.type,
        length,
        shift,
        array.null_count,
        bitmap,
        values,
        data_view is not None,
        data_view,
    )


def _rebuild_array(
    type: pa.DataType,
    length: int,
    shift: int,
    null_count: int,
    bitmap: Any,
    values: Any,
    variable_width: bool,
    data: Any,
) -> pa.Array:
    validity = None if bitmap is None else pa.py_buffer(bitmap)
    buffers = [validity, pa.py_buffer(values)]
    if variable_width:
        buffers.append(pa.py_buffer(data))
    return pa.Array.from_buffers(type, length, buffers, null_count, shift)


#: A take costs about as much as copying this many rows of strings: where
#: the runs are more than the column's rows over this, one take of the
#: whole column, concatenated, costs less than one take per run.
_ROWS_PER_RUN = 1024


class Positions:
    """Row positions to take from Arrow columns, made once and shared by
    every Arrow column of a split or a borrowed piece.

    A column of several chunks is taken chunk by chunk where the positions
    visit its chunks in order (the rows of one output partition, ascending):
    ``pyarrow``'s take of a ``ChunkedArray`` concatenates all of its chunks
    first, a copy of the whole column for every call, and a worker takes
    from each of its inputs once per output partition.  Shuffled frames are
    chunked that way: an output keeps the chunks it received.
    """

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self._whole: pa.Array | None = None
        #: Per chunk layout (the chunks' lengths): (chunk, positions in it)
        #: runs, or None where the positions go back and forth between chunks.
        self._runs: dict[tuple[int, ...], list[tuple[int, pa.Array]] | None] = {}

    def whole(self) -> pa.Array:
        if self._whole is None:
            self._whole = pa.array(self.rows)
        return self._whole

    def runs(self, lengths: tuple[int, ...]) -> list[tuple[int, pa.Array]] | None:
        """The positions as runs within one chunk each (positions relative to
        the chunk), or None if there would be more runs than chunks, or too
        many for the column's length (:data:`_ROWS_PER_RUN`)."""
        if lengths in self._runs:
            return self._runs[lengths]
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        rows = self.rows
        chunk = np.searchsorted(starts[1:], rows, side="right")
        cuts = np.flatnonzero(chunk[1:] != chunk[:-1]) + 1
        runs: list[tuple[int, pa.Array]] | None = None
        if len(cuts) < len(lengths) and (len(cuts) + 1) * _ROWS_PER_RUN <= starts[-1]:
            within = pa.array(rows - starts[chunk])  # slices of it cost no copy
            runs = []
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)], strict=True):
                if b > a:
                    runs.append((int(chunk[a]), within.slice(a, b - a)))
        self._runs[lengths] = runs
        return runs


def take(values: ArrowExtensionArray, positions: Positions, stage: str = "split") -> Any:
    """``values.take(positions.rows)`` for valid non-negative positions, as
    one chunk (see :class:`Positions`).

    The caller counts the take's copy; joining the pieces of a chunked
    column is counted here, under ``stage``."""
    chunked = values._pa_array  # type: ignore[attr-defined]
    runs = None
    if chunked.num_chunks > 1:
        runs = positions.runs(tuple(len(c) for c in chunked.iterchunks()))
    if runs is None:
        taken = pc.take(chunked, positions.whole(), boundscheck=False)
        chunks = taken.chunks
    else:
        pieces = [pc.take(chunked.chunk(k), rows, boundscheck=False) for k, rows in runs]
        # One chunk, as pyarrow's take gives: the split cuts it at output
        # partitions, and an output keeps it whole.
        chunks = pieces
        if len(pieces) > 1:
            chunks = [pa.concat_arrays(pieces)]
            copies.count(stage, chunks[0].nbytes)
    return _rebuild_extension(type(values), _state(values), chunked.type, chunks)


def with_chunks(values: ArrowExtensionArray, chunks: list[pa.Array]) -> Any:
    """An array of ``values``' class and dtype made of ``chunks``."""
    chunked = values._pa_array  # type: ignore[attr-defined]
    return _rebuild_extension(type(values), _state(values), chunked.type, chunks)


def made_of(chunk: pa.Array, addresses: frozenset[int]) -> bool:
    """Whether ``chunk`` (a string or binary array) is the whole of buffers
    that all start at one of ``addresses``: nothing of those buffers lies
    outside it, and no other memory is part of it."""
    offset_type = _OFFSET_TYPES.get(chunk.type)
    if offset_type is None or chunk.offset != 0:
        return False
    validity, offsets, data = chunk.buffers()
    width = np.dtype(offset_type).itemsize
    if offsets is None or offsets.size != (len(chunk) + 1) * width:
        return False
    end = int(np.frombuffer(offsets, offset_type)[-1])
    if data is None or data.size != end:
        return False
    if validity is not None and validity.size != (len(chunk) + 7) // 8:
        return False
    return all(b.address in addresses for b in (validity, offsets, data) if b is not None)


def is_strings(values: Any) -> bool:
    """Whether ``values`` is Arrow-backed strings or binary (offsets and data)."""
    return is_arrow(values) and values._pa_array.type in _OFFSET_TYPES


def is_arrow(values: Any) -> bool:
    """Whether ``values`` is a pandas array backed by a pyarrow ChunkedArray."""
    return isinstance(values, ArrowExtensionArray) and isinstance(
        getattr(values, "_pa_array", None), pa.ChunkedArray
    )


def _state(values: ArrowExtensionArray) -> dict[str, Any]:
    """What a pandas Arrow-backed array holds besides its data (its dtype)."""
    return {k: v for k, v in values.__dict__.items() if k not in ("_pa_array", "_cache")}


def _rebuild_extension(
    cls: Any, state: dict[str, Any], type: pa.DataType, chunks: list[pa.Array]
) -> Any:
    array = cls.__new__(cls)
    array.__dict__.update(state)
    array.__dict__["_pa_array"] = pa.chunked_array(chunks, type=type)
    array.__dict__.setdefault("_cache", {})
    return array


def _datetimes(buffer: Any, dtype: str) -> np.ndarray:
    return np.frombuffer(buffer, np.int64).view(dtype)


class PickleMemo:
    """Objects that pickles read back by this process only refer to by
    number: pandas extension dtypes and numpy dtypes.

    Objects that pickle to the same bytes share one number: every received
    shard unpickles dtype objects of its own, and a memo keyed by identity
    would keep one of each for as long as the store lives.  (Equality would
    not do: an unordered ``CategoricalDtype`` equals one with its categories
    in another order, whose codes mean other values, and integer categories
    equal float ones.)  The memo keeps a copy of its own of each, unpickled
    from those bytes: a received categorical's categories are views of the
    message it came in, which the memo must not keep alive once its shard
    is spilled.  For the same reason the most recently seen objects are
    remembered by identity through weak references (numpy dtypes, which
    hold no data, are held): the pieces of one shard share their dtypes,
    and are pickled once.  A dtype over :data:`MAX_OBJECT_BYTES` pickled,
    or beyond :data:`MAX_BYTES` in all (many categoricals of many
    categories of their own), is pickled with each piece, as without a memo.
    Thread-safe.
    """

    #: Objects remembered by identity.
    RECENT = 256
    #: The largest dtype kept, and what all of them may take, pickled.
    MAX_OBJECT_BYTES = 64 << 10
    MAX_BYTES = 16 << 20

    def __init__(self) -> None:
        self._objects: list[Any] = []
        self._numbers: dict[bytes, int] = {}
        self._bytes = 0
        self._recent: collections.OrderedDict[int, tuple[Callable[[], Any], int | None]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._objects)

    def number(self, obj: Any) -> int | None:
        """``obj``'s number: that of an object seen before that pickles the
        same, else a new one; None for one too large to keep."""
        with self._lock:
            seen = self._recent.get(id(obj))
            if seen is not None and seen[0]() is obj:
                self._recent.move_to_end(id(obj))
                return seen[1]
            state = pickle.dumps(obj, protocol=5)
            number = self._numbers.get(state)
            if number is None and self._keeps(len(state)):
                self._objects.append(pickle.loads(state))
                self._bytes += len(state)
                number = self._numbers[state] = len(self._objects) - 1
            holder = _weakly(obj)
            if holder is not None:
                self._recent[id(obj)] = (holder, number)
                if len(self._recent) > self.RECENT:
                    self._recent.popitem(last=False)
            return number

    def _keeps(self, nbytes: int) -> bool:
        return nbytes <= self.MAX_OBJECT_BYTES and self._bytes + nbytes <= self.MAX_BYTES

    def __getitem__(self, number: int) -> Any:
        return self._objects[number]


def _weakly(obj: Any) -> Callable[[], Any] | None:
    """What gives ``obj`` back while it lives without keeping it alive (a
    numpy dtype, which holds no data and takes no weak reference: itself),
    else None."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return (lambda: obj) if isinstance(obj, np.dtype) else None


#: Per thread, while :func:`loads` reads a pickle made with a memo: that memo.
_unpickling = threading.local()


def _remembered(number: int) -> Any:
    """Unpickles an object pickled by number (see :class:`_MemoPickler`)."""
    memo = getattr(_unpickling, "memo", None)
    if memo is None:
        raise pickle.UnpicklingError(
            "gpushuffle: this pickle refers to a memo of dtypes; read it with "
            "gpushuffle.backends.arrow.loads and the memo it was written with"
        )
    return memo[number]


def loads(payload: Any, frames: Any, memo: PickleMemo | None = None) -> Any:
    """``pickle.loads(payload, buffers=frames)``, with the memo :func:`dumps` was given."""
    if memo is None:
        return pickle.loads(payload, buffers=frames)
    outer = getattr(_unpickling, "memo", None)
    _unpickling.memo = memo
    try:
        return pickle.loads(payload, buffers=frames)
    finally:
        _unpickling.memo = outer


class OutOfBandPickler(pickle.Pickler):
    """A protocol 5 pickler that sends Arrow-backed pandas arrays as cut views,
    and numpy datetimes out of band."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray:
            # numpy pickles datetime64 and timedelta64 arrays in band (their
            # dtype carries a unit): send their int64 view out of band.
            if obj.dtype.kind in "mM" and obj.ndim == 1 and obj.flags.c_contiguous:
                return (_datetimes, (_out_of_band(obj.view(np.int64)), obj.dtype.str))
            return NotImplemented
        if not isinstance(obj, ArrowExtensionArray):
            return NotImplemented
        chunked = obj._pa_array  # type: ignore[attr-defined]
        if not isinstance(chunked, pa.ChunkedArray) or not _cuttable(chunked.type):
            return NotImplemented
        chunks = [c for c in chunked.chunks if len(c)]
        # A nested call through pickle's own machinery: each chunk's
        # arguments are pickled like any other, buffers out of band.
        return (
            _rebuild_extension,
            (type(obj), _state(obj), chunked.type, [_ChunkReduce(c) for c in chunks]),
        )


#: What a :class:`PickleMemo` holds.
_DTYPES = (np.dtype, ExtensionDtype)


class _MemoPickler(OutOfBandPickler):
    """:class:`OutOfBandPickler` with dtypes pickled by number into a
    :class:`PickleMemo`.  In ``reducer_override``, not ``persistent_id``:
    pickle asks that of every object (a piece's ints and strings too), and
    the calls cost more than the dtypes saved."""

    def __init__(self, file: Any, buffer_callback: Any, memo: PickleMemo) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._memo_of_dtypes = memo

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _DTYPES):
            number = self._memo_of_dtypes.number(obj)
            if number is not None:
                return (_remembered, (number,))
        return super().reducer_override(obj)


def _pickler(file: Any, buffer_callback: Any, memo: PickleMemo | None) -> pickle.Pickler:
    if memo is None:
        return OutOfBandPickler(file, protocol=5, buffer_callback=buffer_callback)
    return _MemoPickler(file, buffer_callback, memo)


class _ChunkReduce:
    """Stands for one chunk while pickling; unpickles as a ``pa.Array``."""

    __slots__ = ("array",)

    def __init__(self, array: pa.Array) -> None:
        self.array = array

    def __reduce__(self) -> Any:
        return (_rebuild_array, _reduce_array(self.array))


def dumps(
    obj: Any,
    buffer_callback: Any,
    chunk_buffers: list[int] | None = None,
    memo: PickleMemo | None = None,
) -> bytes:
    """``pickle.dumps(obj, protocol=5, buffer_callback=...)`` with cut Arrow arrays.

    ``chunk_buffers``, if given, receives the positions (among the buffers
    handed to ``buffer_callback``) of those that make up Arrow chunks: a
    receiver that gives each of them memory of its own can keep such a chunk
    as it arrived (:func:`made_of`).  With ``memo``, dtypes are pickled by
    number into it: only :func:`loads` with the same memo reads it back.
    """
    out = io.BytesIO()
    if chunk_buffers is None:
        _pickler(out, buffer_callback, memo).dump(obj)
        return out.getvalue()
    count = 0

    def callback(buffer: pickle.PickleBuffer) -> Any:
        nonlocal count
        if id(buffer) in ids:
            chunk_buffers.append(count)
        count += 1
        return buffer_callback(buffer)

    ids: set[int] = set()
    _pickling.chunk_ids = ids
    try:
        _pickler(out, callback, memo).dump(obj)
    finally:
        _pickling.chunk_ids = None
    return out.getvalue()


#: Arrays smaller than this pickle pandas' way: an Arrow column combined into
#: one chunk, datetimes in band; copies too small to matter.
PICKLE_IN_PLACE_MIN_BYTES = 1 << 20

#: How pickle rebuilds an object of a class without calling ``__init__``
#: (``cls.__new__(cls)``, then ``__setstate__``), as for pandas' own arrays.
_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]

#: Bytes a chunk's buffers may hold beyond its rows and still count as whole
#: (pyarrow's ``nbytes`` leaves out a string array's last offset).
_WHOLE_CHUNK_SLACK = 1024


def pickles_in_place() -> bool:
    """Whether large pandas arrays pickle without pandas' copies
    (``gpushuffle.memory.pickle-without-copy``): Arrow columns as the chunks
    they are, datetimes out of band."""
    return bool(config.get("memory.pickle-without-copy"))


def _pickled_in_place(chunked: Any) -> bool:
    """Whether an Arrow column pickles chunk by chunk: the setting is on, it
    is large, and of a type whose chunks have buffers of their own (strings,
    binaries, fixed width; not dictionaries, whose chunks share one, which
    pickle would write once per chunk, nor nested types)."""
    return (
        isinstance(chunked, pa.ChunkedArray)
        and _cuttable(chunked.type)
        and chunked.nbytes >= PICKLE_IN_PLACE_MIN_BYTES
        and pickles_in_place()
    )


def _whole(chunk: pa.Array) -> bool:
    """Whether ``chunk``'s buffers hold only its rows (not a slice)."""
    return chunk.get_total_buffer_size() <= chunk.nbytes + _WHOLE_CHUNK_SLACK


def _reduce_extension(values: ArrowExtensionArray) -> tuple[Any, ...]:
    """pandas' reduction of ``values`` (``copyreg.__newobj__`` and the state
    its ``__setstate__`` reads) with the chunks as they are, where it
    pickles in place (:func:`_pickled_in_place`); otherwise pandas' own
    ``__getstate__``, which combines them.  A chunk that is a slice is copied
    to its rows alone: pyarrow pickles a slice with its parent's whole
    buffers (ARROW-10739), which is why pandas combines every chunk."""
    chunked = values._pa_array  # type: ignore[attr-defined]
    if chunked.nbytes >= PICKLE_IN_PLACE_MIN_BYTES:
        # Most often distributed spilling it: what pyarrow frees as it is
        # dropped goes back at once, not under its read-back
        # (pool.HostBufferPool.watch_arrow_frees).  Never at pickling's cost.
        with contextlib.suppress(Exception):
            watch_arrow_frees(values)
    if not _pickled_in_place(chunked):
        return (_NEWOBJ, (type(values),), values.__getstate__())
    state = dict(values.__dict__)
    state["_cache"] = {}
    given = chunked.chunks  # new wrappers on every access: read once
    chunks = [c if _whole(c) else pa.concat_arrays([c]) for c in given]
    if any(new is not old for new, old in zip(chunks, given, strict=True)):
        state["_pa_array"] = pa.chunked_array(chunks, type=chunked.type)
    return (_NEWOBJ, (type(values),), state)


class _Int64View:
    """Stands for a datetime64 or timedelta64 ndarray while pickling; unpickles
    as that array, a view of int64 values that numpy pickled out of band
    (it pickles datetimes in band: their dtype carries a unit)."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def __reduce__(self) -> Any:
        return (operator.methodcaller("view", self.values.dtype), (self.values.view(np.int64),))


def _reduce_datetimes(values: Any) -> Any:
    """pandas' own reduction of a DatetimeArray or TimedeltaArray, its ndarray
    in the state pickled as :class:`_Int64View` where it is large and
    contiguous (pandas' block of several datetime columns is 2-D)."""
    reduced = values.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    if len(reduced) != 3 or not isinstance(reduced[2], tuple) or not pickles_in_place():
        return reduced
    # copy.copy and copy.deepcopy read copyreg's table too, and a shallow
    # copy hands the state to __setstate__ as it is, where the view would be
    # no ndarray: only a pickle gets it.
    if sys._getframe(1).f_globals.get("__name__") == "copy":
        return reduced
    func, args, state = reduced
    return (func, args, tuple(_int64_view(item) for item in state))


def _int64_view(item: Any) -> Any:
    if (
        isinstance(item, np.ndarray)
        and item.dtype.kind in "mM"
        and item.nbytes >= PICKLE_IN_PLACE_MIN_BYTES
        and (item.flags.c_contiguous or item.flags.f_contiguous)
    ):
        return _Int64View(item)
    return item


def register_pickling() -> None:
    """Reduce pandas' Arrow-backed arrays with :func:`_reduce_extension`, and
    its datetime and timedelta arrays with :func:`_reduce_datetimes`, in
    this process (pickle and ``copy`` consult ``copyreg``'s table by exact
    class: every subclass pandas defines is listed too)."""
    from pandas.arrays import DatetimeArray, TimedeltaArray

    reducers: list[tuple[type, Any]] = [
        (ArrowExtensionArray, _reduce_extension),
        (DatetimeArray, _reduce_datetimes),
        (TimedeltaArray, _reduce_datetimes),
    ]
    for cls, reduce in reducers:
        classes = [cls]
        for each in classes:
            classes.extend(each.__subclasses__())
            copyreg.pickle(each, reduce)
