"""pandas backend: columns as numpy / extension arrays in host memory.

A table is a list of 1-d column arrays plus an optional index.  Splitting
sorts the partition ids once (stable) and takes each column once per
destination worker, into one pooled block per destination, so every column
of every shard is a contiguous array (which pickle protocol 5 sends out of
band without a copy) and what goes to another worker is freed once sent,
whatever the local shard keeps alive.  An output partition's numeric
columns are allocated once, in one pooled block, and each piece is copied
in and released before the next; a DataFrame is built around those arrays
without consolidating them into 2-d blocks (that would copy every byte a
second time).

The rows an input partition keeps on its own worker need not be copied at
all when the worker holds that partition anyway (a persisted frame, or one
that other tasks still need): the split then *borrows* them
(:class:`BorrowedRows`, the input and the rows' positions) and the unpack
gathers them straight into the output, a gather per column for each output
partition; where those get only a few rows each, the split copies them
instead (:data:`_BORROW_MIN_PIECE_ROWS`).  Whether the worker still holds the
input is read from pandas' copy-on-write references
(:meth:`PandasBackend.unshared_bytes`): once it lets go, the store charges
what the borrowed rows keep alive, and may spill them (copied out then).
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from pandas.api.types import union_categoricals
from pandas.core.dtypes.cast import find_common_type  # type: ignore[attr-defined]  # as p2p

from gpushuffle.backends import arrow, flat
from gpushuffle.backends.base import (
    OWN_FRAMES,
    TableBackend,
    check_frame,
    dtype_mismatch,
    refuse_pickle,
)
from gpushuffle.engine import copies
from gpushuffle.engine.pool import HostBufferPool, host_pool
from gpushuffle.errors import ShuffleInputError


@dataclass(slots=True)
class PandasTable:
    """Rows of a pandas frame: 1-d column arrays in ``meta``'s order, and an index.

    A plain index (a ``RangeIndex``, or a ``pd.Index`` of numpy data) is
    held as its numpy values, as the columns are; its name is meta's.  With
    many output partitions a shuffle holds tens of thousands of slices of
    small tables, and a ``pd.Index`` slice took 1.5 us to make (a numpy
    view 0.2 us) and added objects that Python's garbage collector walks on
    each full collection (the index, its cache, and the weak reference
    pandas' copy-on-write keeps of every view of an index), where it does
    not track a numpy view at all.
    """

    columns: Sequence[Any]
    index: np.ndarray | pd.Index | None
    #: Column labels, for error messages only (output names come from meta).
    names: tuple[Any, ...] = ()
    #: Addresses of the received buffers that are allocations of their own
    #: (see :func:`_standalone`): an Arrow chunk made of such buffers alone
    #: can become part of an output without keeping anything else alive.
    standalone: frozenset[int] = frozenset()

    def __len__(self) -> int:
        if self.columns:
            return len(self.columns[0])
        return 0 if self.index is None else len(self.index)

    def __reduce__(self) -> Any:
        # Shards travel through PandasBackend.serialize (pickle protocol 5,
        # buffers out of band); reaching plain pickle means a bypass.
        refuse_pickle(self)


def _nbytes(table: PandasTable) -> int:
    total = sum([int(c.nbytes) for c in table.columns])
    if table.index is not None:
        total += int(table.index.nbytes)
    return total


@dataclass(eq=False)
class _Source:
    """An input partition whose rows are borrowed, and its columns.

    ``frame`` is a shallow copy of the input made for the store: its blocks
    register with pandas' copy-on-write references, so another live frame
    sharing them (the worker's own copy of the input) is visible there.
    """

    frame: pd.DataFrame
    values: list[Any]
    index: pd.Index | None
    names: tuple[Any, ...]
    nrows: int
    row_bytes: float

    def unshared_bytes(self) -> int:
        """Bytes of the input that nothing but the store keeps alive now."""
        total = 0
        for block in self.frame._mgr.blocks:
            refs = getattr(block, "refs", None)
            if refs is None or not refs.has_reference():
                total += int(block.values.nbytes)
        index = self.index
        if index is not None and not isinstance(index, pd.RangeIndex):
            refs = getattr(index, "_references", None)
            if refs is None or not refs.has_reference():
                total += int(index.nbytes)
        return total


@dataclass(slots=True, eq=False)
class BorrowedRows:
    """Rows of an input partition by position, not copied (see the module docstring).

    ``rows`` are kept as int32 where the input allows (:func:`_kept_positions`)
    and widened once per piece where they are gathered
    (:func:`_gather_positions`).
    """

    source: _Source
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def __reduce__(self) -> Any:
        refuse_pickle(self)


#: Rows a borrowed group's output partitions get on average, at least.
#: Each borrowed piece costs a gather per column at unpack, from its own
#: input: with many output partitions and small inputs, pieces of a few rows
#: cost that call for every row (at 1,000 x 1,000 partitions of 50 rows,
#: 425 gathers per input instead of 17 for a copy at the split), while what
#: a copy of such a group keeps in memory is small, and charged to the store.
_BORROW_MIN_PIECE_ROWS = 256


def _kept_positions(rows: np.ndarray, nrows: int) -> np.ndarray:
    """``rows`` (positions in an input of ``nrows`` rows) to keep until the
    unpack: a copy, so the split's whole sort order is not held for them,
    and int32 where that holds every position: half the memory, for as long
    as the borrowed rows wait."""
    return rows.astype(np.int32 if nrows <= np.iinfo(np.int32).max else np.intp)


def _gather_positions(rows: np.ndarray) -> np.ndarray:
    """Kept positions as the index type numpy gathers with (``np.take``
    would convert them again for every column)."""
    return rows.astype(np.intp, copy=False)


def _worth_borrowing(counts: np.ndarray, first: int, last: int) -> bool:
    """Whether the group of ranks ``first`` to ``last - 1`` is worth borrowing
    (``counts``: rows per rank)."""
    pieces = int(np.count_nonzero(counts[first:last]))
    return pieces > 0 and int(counts[first:last].sum()) >= _BORROW_MIN_PIECE_ROWS * pieces


#: Whether this pandas always tracks which frames share a block (its
#: copy-on-write, the default from pandas 3 on): borrowing rows needs it.
BORROWS_FROM_INPUTS = int(pd.__version__.split(".")[0]) >= 3


def _borrowable(frame: pd.DataFrame) -> bool:
    """Whether pandas tracks which frames share ``frame``'s blocks (copy-on-write)."""
    return BORROWS_FROM_INPUTS and all(
        getattr(b, "refs", None) is not None for b in frame._mgr.blocks
    )


def _column_values(frame: pd.DataFrame, i: int) -> Any:
    """Column ``i``'s data: a read-only numpy view for numpy dtypes (as
    ``Series.to_numpy`` gives), else its extension array.

    Read from the block manager: ``frame.iloc[:, i]`` builds a Series through
    the indexing machinery, about 70 us a column, which with many small
    partitions was a fifth of a transfer task.
    """
    iget_values = getattr(frame._mgr, "iget_values", None)
    if iget_values is None:  # a manager without it: the public, slower way
        series = frame.iloc[:, i]
        return series.to_numpy() if isinstance(series.dtype, np.dtype) else series.array
    values = iget_values(i)
    if not isinstance(values.dtype, np.dtype):
        return values
    # Naive datetimes and timedeltas come as their arrays; asarray is their
    # numpy data, not a copy.  A view, so the block itself stays writeable.
    view = np.asarray(values).view()
    view.flags.writeable = False
    return view


def _dtypes(frame: pd.DataFrame) -> list[Any]:
    """``list(frame.dtypes)`` without building a Series (cached by pandas)."""
    get_dtypes = getattr(frame._mgr, "get_dtypes", None)
    return list(frame.dtypes if get_dtypes is None else get_dtypes())


def _poolable(values: Any) -> bool:
    return isinstance(values, np.ndarray) and not values.dtype.hasobject


#: Arrays carved from one block start on this boundary (cache lines; SIMD loads).
_ALIGN = 64


def _carve(pool: HostBufferPool, n: int, dtypes: Sequence[np.dtype], tag: str) -> list[np.ndarray]:
    """Arrays of ``n`` items, one per dtype, carved from pooled blocks.

    Arrays of one block live and die together: it goes back to the pool when
    the last of them (and of their views) is gone.  One block per shard or
    output instead of one per column means fewer, larger blocks, which the
    pool reuses more easily; where the pool has free blocks smaller than the
    whole, the arrays are spread over them (:meth:`HostBufferPool.empty_buffers`).
    """
    sizes = [-(-n * dtype.itemsize // _ALIGN) * _ALIGN for dtype in dtypes]
    buffers = pool.empty_buffers(sizes, tag=tag)
    return [
        buffer[: n * dtype.itemsize].view(dtype)
        for buffer, dtype in zip(buffers, dtypes, strict=True)
    ]


def _index_dtype(index: pd.Index) -> np.dtype | None:
    """The dtype to take a plain index into pooled memory with, or None."""
    if isinstance(index, pd.RangeIndex):
        return np.dtype(np.int64)
    if type(index) is pd.Index and _poolable(index.values):
        return index.values.dtype
    return None


def _take_rows(
    values: Sequence[Any],
    index: pd.Index | None,
    rows: np.ndarray,
    pool: HostBufferPool,
    bounds: np.ndarray | None = None,
) -> tuple[list[Any], np.ndarray | pd.Index | None]:
    """``rows`` of every column (and of ``index``), numpy data and the flat
    buffers of fixed-width extension arrays (:mod:`~gpushuffle.backends.flat`)
    into one pooled block.

    ``bounds`` (the first row of each output partition in ``rows``, and
    their end) cuts Arrow columns into chunks at output partitions (see
    :func:`_output_cuts`)."""
    # Per column: its numpy arrays to take from (one, or an extension
    # array's flat buffers), or None for a column taken by its own take.
    sources: list[tuple[np.ndarray, ...] | None] = [
        (v,) if _poolable(v) else flat.flat(v, v.dtype) for v in values
    ]
    index_dtype = None if index is None else _index_dtype(index)
    dtypes = [a.dtype for parts in sources if parts is not None for a in parts]
    if index_dtype is not None:
        dtypes.append(index_dtype)
    carved = iter(_carve(pool, len(rows), dtypes, "split"))
    columns: list[Any] = []
    arrow_rows: list[arrow.Positions] = []  # shared by every Arrow column
    cuts = None if bounds is None else _output_cuts(bounds)
    for v, parts in zip(values, sources, strict=True):
        if parts is None:
            columns.append(_take_column(v, rows, arrow_rows, cuts))
            continue
        # mode="clip" skips the bounds-check copy numpy makes with out=
        # and mode="raise"; ``rows`` are valid positions, none is clipped.
        taken = tuple(np.take(a, rows, out=next(carved), mode="clip") for a in parts)
        columns.append(taken[0] if _poolable(v) else flat.unflat(taken, v.dtype))
    if index is None:
        return columns, None
    if index_dtype is None:
        return columns, index.take(rows)
    out = next(carved)
    if isinstance(index, pd.RangeIndex):
        np.multiply(rows, index.step, out=out)
        out += index.start
    else:
        np.take(index.values, rows, out=out, mode="clip")
    return columns, out


def _take_column(
    values: Any,
    rows: np.ndarray,
    arrow_rows: list[arrow.Positions],
    cuts: list[int] | None = None,
    stage: str = "split",
) -> Any:
    """``values.take(rows)`` for valid non-negative ``rows``; ``arrow_rows``
    keeps ``rows`` as :class:`~gpushuffle.backends.arrow.Positions` for the
    next Arrow column; an Arrow result is cut into chunks at ``cuts``
    (:func:`_output_cuts`).  The caller counts the copy, under ``stage``."""
    if isinstance(values, np.ndarray):
        return np.take(values, rows, mode="clip")
    if arrow.is_arrow(values):
        if not arrow_rows:
            arrow_rows.append(arrow.Positions(rows))
        taken = arrow.take(values, arrow_rows[0], stage)
        chunked = taken._pa_array
        if not cuts or chunked.num_chunks != 1:
            return taken
        array = chunked.chunk(0)
        bounds = [0, *cuts, len(array)]
        pieces = [array.slice(a, b - a) for a, b in itertools.pairwise(bounds) if b > a]
        return arrow.with_chunks(taken, pieces)
    return values.take(rows)


def _output_cuts(bounds: np.ndarray) -> list[int]:
    """Where to cut a group's Arrow columns: at output partition boundaries
    (``bounds``: the first row of each output in the group, and their end),
    each chunk of at least ``_KEEP_CHUNK_ROWS`` rows but perhaps the last.

    The cuts are views, no copy.  The out-of-band pickler sends each chunk's
    buffers apart, so a receiver gets an output's rows in buffers of their
    own whenever that output has a chunk to itself, and keeps them as a
    chunk of the output (:func:`_coalesce`) instead of copying them.
    """
    cuts = [0]
    for bound in bounds[1:-1].tolist():
        if bound - cuts[-1] >= _KEEP_CHUNK_ROWS:
            cuts.append(bound)
    return cuts[1:]


def _index_rows(index: pd.Index, rows: np.ndarray) -> np.ndarray | pd.Index:
    """``index.take(rows)``: a plain index's as numpy values (see :class:`PandasTable`)."""
    if isinstance(index, pd.RangeIndex):
        return rows * index.step + index.start
    if _index_dtype(index) is not None:
        return np.take(index.values, rows, mode="clip")
    return index.take(rows)


def _as_index(index: np.ndarray | pd.Index) -> pd.Index:
    return pd.Index(index, copy=False) if isinstance(index, np.ndarray) else index


def _index_values(index: np.ndarray | pd.Index) -> np.ndarray:
    return index if isinstance(index, np.ndarray) else index.values


def _materialize(table: BorrowedRows) -> PandasTable:
    """The borrowed rows copied out of their input (before a spill)."""
    source = table.source
    rows = _gather_positions(table.rows)
    columns, index = _take_rows(source.values, source.index, rows, host_pool())
    copies.count("split", _nbytes(PandasTable(columns, index)))
    return PandasTable(columns, index, source.names)


def _concat_numpy(parts: list[np.ndarray], pool: HostBufferPool) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]
    dtype = np.result_type(*parts)
    if dtype.hasobject:
        return np.concatenate(parts)
    return np.concatenate(parts, out=pool.empty(sum(len(p) for p in parts), dtype, tag="unpack"))


def _concat_index(indexes: list[pd.Index], pool: HostBufferPool) -> pd.Index:
    first = indexes[0]
    if len(indexes) > 1 and all(
        type(i) is pd.Index and _poolable(i.values) and i.name == first.name for i in indexes
    ):
        values = _concat_numpy([i.values for i in indexes], pool)
        return pd.Index(values, name=first.name, copy=False)
    return first.append(indexes[1:]) if len(indexes) > 1 else first


def _concat_column(
    parts: list[Any], dtype: Any, pool: HostBufferPool, owned: Sequence[bool | frozenset[int]]
) -> tuple[Any, int]:
    """``parts`` as one array of ``dtype``, and the bytes that took copying.

    ``owned[i]`` says whether ``parts[i]`` holds memory of its own (True: a
    take into fresh memory), or which received buffers of it are
    allocations of their own (their addresses), rather than views.
    """
    first = parts[0]
    copied: int | None = None  # known already where Arrow chunks were coalesced
    same_type = all(type(p) is type(first) and p.dtype == first.dtype for p in parts)
    if all(isinstance(p, np.ndarray) for p in parts):
        out: Any = _concat_numpy(parts, pool)
    elif isinstance(dtype, pd.CategoricalDtype) or isinstance(first, pd.Categorical):
        out = union_categoricals([pd.Categorical(p) for p in parts])
        known = dtype.categories if isinstance(dtype, pd.CategoricalDtype) else None
        if known is not None and out.categories.isin(known).all():
            out = out.astype(dtype)
        return out, int(out.nbytes)
    elif same_type and all(arrow.is_arrow(p) for p in parts):
        out, copied = _coalesce(parts, owned)
    elif same_type:
        out = type(first)._concat_same_type(parts)
    else:
        out = pd.concat([pd.Series(p, copy=False) for p in parts], ignore_index=True).array
    if copied is None:
        out = _contiguous(out)
        copied = 0 if len(parts) == 1 and _same_memory(out, first) else int(out.nbytes)
    target = output_dtype(out.dtype, dtype)
    if out.dtype != target:
        if isinstance(out, np.ndarray) and not isinstance(target, np.dtype):
            out = pd.Series(out, copy=False).astype(target).array
        else:
            out = out.astype(target, copy=False)
        copied = int(out.nbytes)
    return out, copied


def output_dtype(actual: Any, expected: Any) -> Any:
    """The dtype of an output column whose rows came as ``actual``, where
    meta says ``expected``.

    Meta's where the cast keeps every value (int32 rows in an int64 column,
    object strings in a string column); otherwise the type both fit, as
    distributed's p2p gives (``find_common_type``, distributed issue 8183):
    NaN that a left or outer join brought into an int64 column stays NaN in
    float64, booleans with NaN stay object, and the output's dtype then
    differs from meta's, as with ``p2p`` and ``tasks``.
    """
    if actual == expected:
        return expected
    if isinstance(expected, pd.StringDtype) and (
        actual == np.dtype(object) or isinstance(actual, pd.StringDtype)
    ):
        return expected  # dask's meta often says string where rows are object
    if (
        isinstance(actual, np.dtype)
        and isinstance(expected, np.dtype)
        and np.can_cast(actual, expected, "safe")
    ):
        return expected
    return find_common_type([actual, expected])


#: An Arrow chunk of its own memory with at least this many rows stays a
#: chunk of the output: below it, per-chunk costs of later uses outweigh
#: the copy that joining it to its neighbours takes.  An output keeps at
#: most one chunk per input partition it borrows from; dask's ``tasks``
#: shuffle gives one chunk per input partition, whatever its size.
_KEEP_CHUNK_ROWS = 1 << 12


def _coalesce(parts: list[Any], owned: Sequence[bool | frozenset[int]]) -> tuple[Any, int]:
    """Arrow-backed ``parts`` as one array, and the bytes copied for it.

    A large chunk that owns its memory is kept as it is: rows taken from a
    borrowed input, or rows received in buffers of their own (the sender
    cuts its string columns at output partitions, :func:`_output_cuts`).
    Combining it would copy every byte again, into fresh pages.  Runs of
    the other chunks are combined into one chunk each: small ones would slow
    every later use (``nbytes``, hence distributed's ``sizeof`` of each
    output, ``take``, comparisons), and a view would keep the whole message
    or read buffer it came in alive after the store released it.
    """
    chunks: list[pa.Array] = []
    pending: list[pa.Array] = []
    copied = 0
    total = sum(part._pa_array.num_chunks for part in parts)

    def combine() -> None:
        nonlocal copied
        if len(pending) > 1 or (pending and total > 1):
            joined = pa.concat_arrays(pending)  # a copy, even of one chunk
            copied += joined.nbytes
            chunks.append(joined)
        else:
            chunks.extend(pending)  # the column's only chunk: kept, as it always was
        pending.clear()

    for part, own in zip(parts, owned, strict=True):
        for chunk in part._pa_array.iterchunks():
            if len(chunk) >= _KEEP_CHUNK_ROWS and (
                own is True or (isinstance(own, frozenset) and arrow.made_of(chunk, own))
            ):
                combine()
                chunks.append(chunk)
            elif len(chunk):
                pending.append(chunk)
    combine()
    return arrow.with_chunks(parts[0], chunks), copied


def _contiguous(values: Any) -> Any:
    """Arrow-backed ``values`` as one chunk: one copy of the string bytes."""
    chunked = getattr(values, "_pa_array", None)
    rebuild = getattr(values, "_from_pyarrow_array", None)
    if isinstance(chunked, pa.ChunkedArray) and chunked.num_chunks > 1 and rebuild is not None:
        return rebuild(chunked.combine_chunks())
    return values


def dtype_family(dtype: Any) -> str:
    """A coarse kind of data: dtypes of one family can be cast to each other."""
    if isinstance(dtype, pd.CategoricalDtype):
        return "category"
    if pd.api.types.is_bool_dtype(dtype) or pd.api.types.is_numeric_dtype(dtype):
        return "number"
    if isinstance(dtype, pd.DatetimeTZDtype):
        return f"datetime[{dtype.tz}]"
    if pd.api.types.is_datetime64_dtype(dtype):
        return "datetime"
    if pd.api.types.is_timedelta64_dtype(dtype):
        return "timedelta"
    if pd.api.types.is_string_dtype(dtype):
        return "object"
    return str(dtype)


def _compatible(actual: Any, expected: Any) -> bool:
    """Whether data of dtype ``actual`` can be cast to ``expected`` without loss.

    dask's meta is often loose (an int column that became float where a
    partition had nulls, object strings against string[pyarrow]); those are
    cast at unpack.  Different kinds of data (numbers against strings, naive
    against tz-aware timestamps) are an error in the input.
    """
    a, e = dtype_family(actual), dtype_family(expected)
    if a == e:
        return True
    # Strings and categories of strings stand for each other; object columns
    # may hold anything, including what meta describes.
    return {a, e} <= {"object", "category"} or a == "object" or e == "object"


def _plain_index(index: pd.Index) -> bool:
    # An Index of an extension dtype (string, nullable ints) is no numpy array.
    return (
        type(index) in (pd.Index, pd.RangeIndex)
        and isinstance(index.dtype, np.dtype)
        and _poolable(np.empty(0, index.dtype))
    )


def _fill_dtypes(dtype: Any) -> tuple[np.dtype, ...] | None:
    """The arrays an output column of ``dtype`` is filled into in place: plain
    numpy data as itself, fixed-width extension arrays as their flat buffers
    (:mod:`~gpushuffle.backends.flat`); None for the others."""
    if isinstance(dtype, np.dtype):
        return None if dtype.hasobject else (dtype,)
    return flat.flat_dtypes(dtype)


#: Pieces smaller than this are gathered and copied together.
_BATCH_BYTES = 256 << 10
_BATCH_PIECES = 256


class _ColumnBuilder:
    """One output column, filled piece by piece.

    Pieces are copied straight into ``outs``, pooled arrays of the output's
    length (one for numpy data, an extension array's flat buffers for the
    fixed-width ones), so each piece can be released once copied.  Pieces
    that do not fit (other dtypes, numpy data that would not cast safely, an
    Arrow piece with nulls) are collected and concatenated at the end,
    after what was filled until then.
    """

    def __init__(
        self,
        dtype: Any,
        pool: HostBufferPool,
        outs: tuple[np.ndarray, ...] | None,
        index: bool = False,
    ) -> None:
        self.dtype = dtype
        self.pool = pool
        self.index = index
        #: Filled as flat buffers of an extension dtype (else numpy data).
        self.extension = not isinstance(dtype, np.dtype)
        self.outs = outs
        self.position = 0
        self.copied = 0  # counted once, at the end (the counters take a lock)
        self.parts: list[Any] = []
        #: Per part: True for memory of its own (a take), else the addresses
        #: of the received buffers that are (PandasTable.standalone).
        self.owned: list[bool | frozenset[int]] = []

    @property
    def filling(self) -> bool:
        """Whether pieces still go straight into ``outs``."""
        return self.outs is not None

    def _fits(self, values: Any) -> tuple[np.ndarray, ...] | None:
        """``values`` as the arrays to copy into ``outs``, or None if it does not fit."""
        if self.extension:
            return flat.flat(values, self.dtype)
        if isinstance(values, np.ndarray) and (
            # can_cast costs ten times the comparison, once a column and piece
            values.dtype == self.dtype or np.can_cast(values.dtype, self.dtype, "safe")
        ):
            return (values,)
        return None

    def _filled(self) -> Any:
        """The rows filled so far, as an array of the column's dtype."""
        assert self.outs is not None
        outs = tuple(out[: self.position] for out in self.outs)
        return flat.unflat(outs, self.dtype) if self.extension else outs[0]

    def _stop_filling(self) -> None:
        if self.outs is not None and self.position:
            self.parts.append(self._filled())
            self.owned.append(True)
        self.outs = None

    def add(self, values: Any, owned: bool | frozenset[int] = False) -> None:
        n = len(values)
        parts = self._fits(values) if self.filling else None
        if parts is not None:
            assert self.outs is not None
            for out, part in zip(self.outs, parts, strict=True):
                out[self.position : self.position + n] = part
                self.copied += part.nbytes
        else:
            self._stop_filling()
            self.parts.append(values)
            self.owned.append(owned)
        self.position += n

    def add_taken(self, values: Any, rows: np.ndarray, arrow_rows: list[arrow.Positions]) -> None:
        """:meth:`add` ``values.take(rows)``, gathered straight into the output
        where it can be."""
        n = len(rows)
        parts: tuple[np.ndarray, ...] | None = None
        if self.filling:
            if self.extension:
                parts = flat.flat(values, self.dtype)
            elif type(values) is np.ndarray and values.dtype == self.dtype:
                parts = (values,)
        if parts is not None:
            assert self.outs is not None
            for out, part in zip(self.outs, parts, strict=True):
                np.take(part, rows, out=out[self.position : self.position + n], mode="clip")
                self.copied += n * part.itemsize
            self.position += n
            return
        taken = _take_column(values, rows, arrow_rows, stage="unpack")
        copies.count("unpack", int(taken.nbytes))
        self.add(taken, owned=True)

    def add_all(
        self, values: list[Any], owned: Sequence[bool | frozenset[int]] | None = None
    ) -> None:
        """:meth:`add` each of ``values``; those that fit in one copy per buffer."""
        if len(values) > 1 and self.filling:
            assert self.outs is not None
            if not self.extension and {(type(v), v.dtype) for v in values} == {
                (np.ndarray, self.dtype)
            }:
                # numpy data of the column's dtype, the common case: one
                # check for the batch (with many partitions a batch is
                # hundreds of pieces of a row or two, and per-piece checks
                # cost more than the copy).
                n = sum([len(v) for v in values])
                chunk = self.outs[0][self.position : self.position + n]
                np.concatenate(values, out=chunk)
                self.copied += chunk.nbytes
                self.position += n
                return
            fits = [self._fits(v) for v in values]
            fitting = [parts for parts in fits if parts is not None]
            if len(fitting) == len(values):
                n = sum(len(v) for v in values)
                for k, out in enumerate(self.outs):
                    chunk = out[self.position : self.position + n]
                    np.concatenate([parts[k] for parts in fitting], out=chunk, casting="safe")
                    self.copied += chunk.nbytes
                self.position += n
                return
        for i, v in enumerate(values):
            self.add(v, False if owned is None else owned[i])

    def finish(self) -> Any:
        copies.count("unpack", self.copied)
        if self.outs is not None:
            return self._filled()
        if self.index:
            out = _concat_index([pd.Index(p, copy=False) for p in self.parts], self.pool).values
            if len(self.parts) != 1 or not _same_memory(out, self.parts[0]):
                copies.count("unpack", int(out.nbytes))
            return out
        out, copied = _concat_column(self.parts, self.dtype, self.pool, self.owned)
        copies.count("unpack", copied)
        return out


def _same_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` is ``b`` or a numpy view of it (no copy was made)."""
    if a is b:
        return True
    return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.shares_memory(a, b)


def _check_picklable(name: Any, values: pd.Series, input_partition: int) -> None:
    """Pickle a sample of an object column: values that cannot travel fail here.

    Without this, an unpicklable value surfaces deep in distributed's comm
    as "Could not serialize object" at the barrier (distributed issue 8310).
    Only a sample is checked, so a rare bad value can still fail later.
    """
    sample = values.iloc[:16].tolist()
    try:
        pickle.dumps(sample, protocol=5)
    except Exception as e:
        raise ShuffleInputError(
            f"gpushuffle: column {name!r} of input partition {input_partition} holds values "
            f"that cannot be pickled to send to another worker ({type(e).__name__}: {e}). "
            "Convert them (for example to str) or drop the column before shuffling."
        ) from e


def _unpicklable(table: PandasTable, error: Exception) -> ShuffleInputError:
    """Name the column whose values cannot be pickled (distributed issue 8310)."""
    for position, values in enumerate(table.columns):
        try:
            pickle.dumps(values, protocol=5, buffer_callback=lambda _: None)
        except Exception as e:
            name = table.names[position] if position < len(table.names) else position
            return ShuffleInputError(
                f"gpushuffle: column {name!r} holds values that cannot "
                f"be pickled to send to another worker ({type(e).__name__}: {e}). Convert "
                "them (for example to str) or drop the column before shuffling."
            )
    return ShuffleInputError(f"gpushuffle: a shard could not be pickled: {error!r}")


def _standalone(frame: Any) -> bool:
    """Whether ``frame`` is the whole of an allocation of its own (a comm's
    receive buffer), not a view into a larger one: a read-back file mapping,
    the buffer a message's small frames share, or the sender's own memory
    over an in-process comm."""
    view = memoryview(frame)
    base = view.obj
    if isinstance(base, bytes | bytearray):
        return len(base) == view.nbytes
    if isinstance(base, np.ndarray):
        return base.base is None and base.nbytes == view.nbytes and view.c_contiguous
    return False


def _address(frame: Any) -> int:
    return int(pa.py_buffer(frame).address)


class PandasBackend(TableBackend):
    name = "pandas"
    borrows = True

    @classmethod
    def handles(cls, meta: Any) -> bool:
        return isinstance(meta, pd.DataFrame)

    def validate(self, frame: Any, meta: Any, column: str, input_partition: int) -> None:
        check_frame(frame, meta, pd.DataFrame, input_partition, column)
        dtypes = _dtypes(frame)
        for name, actual, expected in zip(meta.columns, dtypes, _dtypes(meta), strict=True):
            # The partition column is the shuffle's own (check_frame checks
            # it): dask's meta for it may say anything (set_index on a
            # derived datetime key says datetime64).
            if name != column and actual != expected and not _compatible(actual, expected):
                raise dtype_mismatch(name, input_partition, actual, expected)
        for i, dtype in enumerate(dtypes):
            if isinstance(dtype, np.dtype) and dtype.kind == "O":
                _check_picklable(frame.columns[i], frame.iloc[:, i], input_partition)

    def split(
        self,
        frame: pd.DataFrame,
        column: str,
        rank: np.ndarray,
        nranks: int,
        keep_index: bool,
    ) -> tuple[PandasTable, np.ndarray]:
        tables, offsets = self.split_groups(frame, column, rank, nranks, keep_index, [(0, nranks)])
        return self.materialize(tables[0]), offsets

    def split_groups(
        self,
        frame: pd.DataFrame,
        column: str,
        rank: np.ndarray,
        nranks: int,
        keep_index: bool,
        groups: Sequence[tuple[int, int]],
        borrow: int | None = None,
    ) -> tuple[list[PandasTable | BorrowedRows], np.ndarray]:
        keys = rank[frame[column].to_numpy()]
        # Radix sort for <= 16-bit keys: O(n), and stable, which keeps rows of
        # one output partition in their input order.
        order = np.argsort(keys, kind="stable")
        counts = np.bincount(keys, minlength=nranks + 1)
        offsets = np.zeros(nranks + 1, dtype=np.int64)
        np.cumsum(counts[:nranks], out=offsets[1:])
        # Rows of rank ``nranks`` belong to outputs nobody asked for: they sort
        # last and no group takes them.
        position = frame.columns.get_loc(column)
        names = tuple(c for i, c in enumerate(frame.columns) if i != position)
        values = [_column_values(frame, i) for i in range(frame.shape[1]) if i != position]
        index = frame.index if keep_index else None
        pool = host_pool()
        source = None
        if borrow is not None and _worth_borrowing(counts, *groups[borrow]) and _borrowable(frame):
            source = _Source(
                # The store's own shallow copy: it shares the input's blocks
                # (and ``values`` view them), so pandas' references tell
                # whether anything else still holds them.
                frame=frame.copy(deep=False),
                values=values,
                index=index,
                names=names,
                nrows=len(frame),
                row_bytes=_nbytes(PandasTable(values, index)) / max(len(frame), 1),
            )
        tables: list[PandasTable | BorrowedRows] = []
        copied = 0
        for group, (first, last) in enumerate(groups):
            rows = order[offsets[first] : offsets[last]]
            if group == borrow and source is not None:
                tables.append(BorrowedRows(source, _kept_positions(rows, source.nrows)))
                continue
            # Each group's numpy columns share one pooled block of their own.
            bounds = offsets[first : last + 1] - offsets[first]
            columns, taken = _take_rows(values, index, rows, pool, bounds)
            table = PandasTable(columns, taken, names)
            copied += _nbytes(table)
            tables.append(table)
        copies.count("split", copied)
        return tables, offsets

    def slice(
        self, table: PandasTable | BorrowedRows, start: int, stop: int
    ) -> PandasTable | BorrowedRows:
        if isinstance(table, BorrowedRows):
            return BorrowedRows(table.source, table.rows[start:stop])
        return PandasTable(
            # A tuple: once it holds only numpy views, the garbage collector
            # stops tracking it (a list it walks on every full collection).
            tuple([c[start:stop] for c in table.columns]),
            None if table.index is None else table.index[start:stop],
            table.names,
            table.standalone,
        )

    def assemble(
        self, tables: Iterable[PandasTable], nrows: int, meta: pd.DataFrame, keep_index: bool
    ) -> pd.DataFrame:
        pool = host_pool()
        dtypes = _dtypes(meta)
        ncolumns = len(dtypes)
        plain_index = keep_index and _plain_index(meta.index)
        if plain_index:
            dtypes.append(meta.index.dtype)
        # The output columns filled in place share one pooled block,
        # allocated once.
        fills = [_fill_dtypes(d) for d in dtypes]
        filled = iter(_carve(pool, nrows, [f for fs in fills if fs for f in fs], "unpack"))
        builders = [
            _ColumnBuilder(
                d,
                pool,
                None if fs is None else tuple(next(filled) for _ in fs),
                index=plain_index and i == ncolumns,
            )
            for i, (d, fs) in enumerate(zip(dtypes, fills, strict=True))
        ]
        columns = builders[:ncolumns]
        index_builder = builders[-1] if plain_index else None
        del builders
        indexes: list[pd.Index] = []
        # Small pieces are copied in batches (one call per column for many
        # pieces: with many partitions most pieces are a few rows), large
        # ones one at a time; either way at most _BATCH_BYTES of pieces is
        # held beyond the piece being copied.
        batch: list[PandasTable] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch_bytes
            if not batch:
                return
            standalone = [t.standalone for t in batch]
            for i, builder in enumerate(columns):
                builder.add_all([t.columns[i] for t in batch], standalone)
            if keep_index:
                if index_builder is not None:
                    index_builder.add_all([_index_values(t.index) for t in batch])  # type: ignore[arg-type]
                else:
                    indexes.extend(_as_index(t.index) for t in batch)  # type: ignore[arg-type]
            batch.clear()
            batch_bytes = 0

        for table in tables:
            if isinstance(table, BorrowedRows):
                flush()
                source, rows = table.source, _gather_positions(table.rows)
                arrow_rows: list[arrow.Positions] = []
                for i, builder in enumerate(columns):
                    builder.add_taken(source.values[i], rows, arrow_rows)
                if keep_index:
                    assert source.index is not None
                    if index_builder is not None:
                        index_builder.add(_index_values(_index_rows(source.index, rows)))
                    else:
                        indexes.append(_as_index(_index_rows(source.index, rows)))
                del table, source, rows
                continue
            assert not keep_index or table.index is not None
            batch.append(table)
            batch_bytes += _nbytes(table)
            if batch_bytes >= _BATCH_BYTES or len(batch) >= _BATCH_PIECES:
                flush()
            del table  # let the store release this piece before the next
        flush()
        arrays = [builder.finish() for builder in columns]
        if index_builder is not None:
            index = pd.Index(index_builder.finish(), name=meta.index.name, copy=False)
        elif keep_index:
            index = _concat_index(indexes, pool)
            if index.dtype != meta.index.dtype and not isinstance(index, pd.MultiIndex):
                index = index.astype(output_dtype(index.dtype, meta.index.dtype))
            index.names = meta.index.names
        else:
            index = pd.RangeIndex(nrows)
        # A dict of arrays with copy=False builds one block per column instead
        # of consolidating into 2-d blocks, which would copy everything again.
        df = pd.DataFrame(dict(enumerate(arrays)), index=index, copy=False)
        df.columns = meta.columns
        for i, (actual, expected) in enumerate(zip(_dtypes(df), dtypes[:ncolumns], strict=True)):
            if actual != expected and arrays[i].dtype == expected:
                # The constructor infers (pandas 3 turns object strings into
                # "str"); put meta's dtype back on such columns.
                df.isetitem(i, pd.Series(arrays[i], index=index, dtype=expected, copy=False))
        return df

    def empty(self, meta: pd.DataFrame) -> pd.DataFrame:
        return meta.copy()

    def nbytes(self, table: PandasTable | BorrowedRows) -> int:
        if isinstance(table, BorrowedRows):
            # What a copy of the rows would take (their share of the input).
            return int(table.source.row_bytes * len(table.rows))
        return _nbytes(table)

    def unshared_bytes(self, table: PandasTable | BorrowedRows) -> int | None:
        if isinstance(table, BorrowedRows):
            return table.source.unshared_bytes()
        return None

    def materialize(self, table: PandasTable | BorrowedRows) -> PandasTable:
        if isinstance(table, BorrowedRows):
            return _materialize(table)
        return table

    def nrows(self, table: PandasTable) -> int:
        return len(table)

    def serialize(
        self, table: PandasTable | BorrowedRows, *, device_frames: bool = False
    ) -> tuple[dict[str, Any], list[Any]]:
        table = self.materialize(table)
        buffers: list[pickle.PickleBuffer] = []
        chunk_buffers: list[int] = []
        try:
            # numpy arrays and Arrow buffers go out of band as views; only
            # object columns and small metadata are copied into the payload.
            payload = arrow.dumps((table.columns, table.index), buffers.append, chunk_buffers)
        except Exception as e:
            raise _unpicklable(table, e) from e
        copies.count("serialize", len(payload))
        header = {
            "npickle-buffers": len(buffers),
            # Frames (payload first) to receive into memory of their own:
            # Arrow chunks made of such frames are kept as they arrived.
            OWN_FRAMES: [1 + i for i in chunk_buffers],
        }
        return header, [payload, *(b.raw() for b in buffers)]

    def deserialize(self, header: dict[str, Any], frames: Sequence[Any]) -> PandasTable:
        columns, index = pickle.loads(frames[0], buffers=frames[1:])
        copies.count("deserialize", memoryview(frames[0]).nbytes)
        standalone = frozenset(_address(f) for f in frames[1:] if _standalone(f))
        return PandasTable(columns, index, standalone=standalone)
