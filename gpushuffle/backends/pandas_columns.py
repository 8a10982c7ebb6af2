"""Columns of pandas frames as numpy and Arrow arrays: the takes, the pooled
blocks they go into and the concatenations that the split and the unpack
share."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
import pandas as pd
import pyarrow as pa
from pandas.api.types import union_categoricals

from gpushuffle.backends import arrow, flat
from gpushuffle.backends.dtypes import (
    _poolable,
    output_dtype,
)
from gpushuffle.engine.pool import HostBufferPool

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


def _numpy_parts(values: Sequence[Any]) -> list[tuple[np.ndarray, ...] | None]:
    """Per column, the numpy arrays a take or a copy works on: the column
    itself (numpy data), an extension array's flat buffers
    (:mod:`~gpushuffle.backends.flat`), or None for a column taken its own way
    (Arrow, object)."""
    return [(v,) if _poolable(v) else flat.flat(v, v.dtype) for v in values]


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
    sources = _numpy_parts(values)
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


def _scatter_rows(
    values: Sequence[Any],
    index: pd.Index | None,
    nrows: int,
    groups: Sequence[tuple[np.ndarray, np.ndarray]],
    pool: HostBufferPool,
) -> list[tuple[list[Any], np.ndarray | pd.Index | None]]:
    """:func:`_take_rows` for several groups at once, by scatter: ``groups``
    are each ``(rows, bounds)``, positions in an input of ``nrows`` rows.

    Each numpy column (and flat buffer of an extension array) is read once,
    in order, and each row written to its place: one sequential read and a
    sequential write per output partition, where a gather reads a cache line
    for about every value once a column outgrows the caches.  Rows of no
    group are written to one spare slot past the end.  The groups' columns
    are views of the arrays carved for the pass (one pooled block, or a few):
    they are freed together.
    Arrow and object columns are taken per group, as :func:`_take_rows` does.
    """
    sources = _numpy_parts(values)
    index_dtype = None if index is None else _index_dtype(index)
    places, starts = _places(nrows, [rows for rows, _ in groups])
    dtypes = [a.dtype for parts in sources if parts is not None for a in parts]
    if index_dtype is not None:
        dtypes.append(index_dtype)
    spare = 1  # the slot rows of no group are written to
    carved = iter(_carve(pool, sum(len(rows) for rows, _ in groups) + spare, dtypes, "split"))
    blocks: list[tuple[np.ndarray, ...] | None] = []
    for parts in sources:
        if parts is None:
            blocks.append(None)
            continue
        written = tuple(next(carved) for _ in parts)
        for source, block in zip(parts, written, strict=True):
            block[places] = source
        blocks.append(written)
    index_block = None if index_dtype is None else next(carved)
    if index_block is not None and not isinstance(index, pd.RangeIndex):
        assert index is not None
        index_block[places] = index.values
    del places
    return [
        _scattered_group(values, blocks, index, index_block, rows, bounds, start)
        for (rows, bounds), start in zip(groups, starts, strict=True)
    ]


def _copied_out(
    columns: Sequence[Any], index: np.ndarray | pd.Index | None, pool: HostBufferPool
) -> tuple[list[Any], np.ndarray | pd.Index | None]:
    """``columns`` and ``index`` with their numpy data (numpy columns, flat
    buffers of extension arrays, a plain index's values) copied into one
    pooled block; other columns as they are."""
    sources = _numpy_parts(columns)
    arrays = [a for parts in sources if parts is not None for a in parts]
    if isinstance(index, np.ndarray):
        arrays.append(index)
    n = len(arrays[0]) if arrays else 0
    carved = iter(_carve(pool, n, [a.dtype for a in arrays], "split"))
    copied: list[Any] = []
    for c, parts in zip(columns, sources, strict=True):
        if parts is None:
            copied.append(c)
            continue
        own = tuple(next(carved) for _ in parts)
        for source, target in zip(parts, own, strict=True):
            np.copyto(target, source)
        copied.append(own[0] if _poolable(c) else flat.unflat(own, c.dtype))
    if isinstance(index, np.ndarray):
        target = next(carved)
        np.copyto(target, index)
        return copied, target
    return copied, index


def _places(nrows: int, groups: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """Where each of ``nrows`` input rows goes when ``groups`` (positions,
    in output order) are laid end to end: its place, or one spare slot past
    the end for rows of no group; and where each group starts."""
    total = sum(len(rows) for rows in groups)
    places = np.full(nrows, total, dtype=np.intp)
    starts = np.cumsum([0, *(len(rows) for rows in groups)]).tolist()[:-1]
    for rows, start in zip(groups, starts, strict=True):
        places[rows] = np.arange(start, start + len(rows), dtype=np.intp)
    return places, starts


def _scattered_group(
    values: Sequence[Any],
    blocks: Sequence[tuple[np.ndarray, ...] | None],
    index: pd.Index | None,
    index_block: np.ndarray | None,
    rows: np.ndarray,
    bounds: np.ndarray,
    start: int,
) -> tuple[list[Any], np.ndarray | pd.Index | None]:
    """One group's columns and index out of the blocks :func:`_scatter_rows`
    wrote (views), Arrow and object columns taken."""
    stop = start + len(rows)
    arrow_rows: list[arrow.Positions] = []
    cuts = _output_cuts(bounds)
    columns: list[Any] = []
    for v, written in zip(values, blocks, strict=True):
        if written is None:
            columns.append(_take_column(v, rows, arrow_rows, cuts))
        elif _poolable(v):
            columns.append(written[0][start:stop])
        else:
            columns.append(flat.unflat(tuple(b[start:stop] for b in written), v.dtype))
    if isinstance(index, pd.RangeIndex):  # its values are computed
        assert index_block is not None
        taken = np.multiply(rows, index.step, out=index_block[start:stop])
        taken += index.start
        return columns, taken
    if index_block is not None:
        return columns, index_block[start:stop]
    return columns, None if index is None else index.take(rows)


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
    if all(type(i) is pd.Index and arrow.is_arrow(i.array) for i in indexes):
        # Arrow-backed (strings under pandas 3): appended, the output's index
        # would be views of every message its rows came in, and keep them
        # alive, numeric columns and all, as long as the output.
        chunks = [c for i in indexes for c in i.array._pa_array.iterchunks()]
        arrow_type = first.array._pa_array.type
        joined = pa.concat_arrays(chunks) if chunks else pa.array([], arrow_type)  # a copy
        return pd.Index(arrow.with_chunks(first.array, [joined]), name=first.name, copy=False)
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


def _own_large_chunks(
    values: Any, owned: bool | frozenset[int]
) -> tuple[Any, bool | frozenset[int], int]:
    """Arrow string ``values`` with each large chunk that is a view of memory
    not its own (a spill file's mapping, a message shared with other
    partitions) copied now, while its pages are there; the addresses of what
    is owned after; the bytes copied.

    :func:`_coalesce` keeps such a chunk as it is, so the copy made now is
    its only one.  Left as a view until the output is finished instead, a
    piece read back from disk would be held twice at the end: its pages,
    dropped once the piece was consumed (``store._drop_pages``) and read in
    again by the final combine, beside the combined copy.
    """
    if owned is True or not arrow.is_strings(values):
        return values, owned, 0
    base = owned if isinstance(owned, frozenset) else frozenset()
    chunks, addresses, copied = [], set(base), 0
    for chunk in values._pa_array.iterchunks():
        if len(chunk) >= _KEEP_CHUNK_ROWS and not arrow.made_of(chunk, base):
            copy = pa.concat_arrays([chunk])  # a copy, even of one chunk
            own = frozenset(b.address for b in copy.buffers() if b is not None)
            if arrow.made_of(copy, own):
                addresses.update(own)
                copied += copy.nbytes
                chunk = copy
        chunks.append(chunk)
    if not copied:
        return values, owned, 0
    return arrow.with_chunks(values, chunks), frozenset(addresses), copied


def _contiguous(values: Any) -> Any:
    """Arrow-backed ``values`` as one chunk: one copy of the string bytes."""
    chunked = getattr(values, "_pa_array", None)
    rebuild = getattr(values, "_from_pyarrow_array", None)
    if isinstance(chunked, pa.ChunkedArray) and chunked.num_chunks > 1 and rebuild is not None:
        return rebuild(chunked.combine_chunks())
    return values


def _same_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` is ``b`` or a numpy view of it (no copy was made)."""
    if a is b:
        return True
    return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.shares_memory(a, b)


def _compacted_rows(
    tables: Sequence[tuple[Sequence[Any], np.ndarray | pd.Index | None, frozenset[int]]],
    lengths: Sequence[int],
    pool: HostBufferPool,
) -> list[tuple[list[Any], np.ndarray | pd.Index | None]] | None:
    """``tables`` (columns, index and the addresses of the buffers that are
    allocations of their own, as ``PandasTable`` has them), views that share
    one received shard's buffers, copied together into memory of their own:
    one table each, of ``lengths`` rows.  None for an index it cannot copy
    whole (a MultiIndex, a CategoricalIndex): the shard then stays as it is.

    Numpy data (numpy columns, the flat buffers of extension arrays, a plain
    index) goes into one pooled block, Arrow chunks into one Arrow array;
    chunks that are allocations of their own (received cut at output
    partitions) are kept as they are: they hold nothing else.  The store
    uses it to let go of a shard half of whose rows were read
    (``ShardStore._compact_due_groups``).
    """
    indexes = [t[1] for t in tables]
    plain_index = all(isinstance(x, np.ndarray) and _poolable(x) for x in indexes)
    whole = (pd.MultiIndex, pd.CategoricalIndex)  # their levels or categories are views
    if not plain_index and any(x is not None and isinstance(x, whole) for x in indexes):
        return None
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    spans = list(itertools.pairwise(bounds))
    ncolumns = len(tables[0][0])
    parts = [[t[0][i] for t in tables] for i in range(ncolumns)]
    sources = [_flat_parts(column) for column in parts]
    dtypes = [a.dtype for s in sources if s is not None for a in s[0]]
    if plain_index:
        dtypes.append(cast(np.ndarray, indexes[0]).dtype)
    carved = iter(_carve(pool, bounds[-1], dtypes, "receive"))
    owned = [t[2] for t in tables]
    columns = [
        _compacted_column(column, flats, carved, spans, owned)
        for column, flats in zip(parts, sources, strict=True)
    ]
    if plain_index:
        target = next(carved)
        np.concatenate(cast(list[np.ndarray], indexes), out=target)
        new_indexes: list[Any] = [target[start:stop] for start, stop in spans]
    elif all(x is None for x in indexes):
        new_indexes = [None] * len(tables)
    else:
        new_indexes = _compacted_index(cast(list[pd.Index], indexes), spans, owned)
    return [([column[j] for column in columns], new_indexes[j]) for j in range(len(tables))]


def _flat_parts(parts: Sequence[Any]) -> list[tuple[np.ndarray, ...]] | None:
    """Each part's numpy arrays (itself, or its flat buffers), or None if
    some part has none (Arrow with nulls, strings, objects)."""
    flats = _numpy_parts(parts)
    if any(f is None for f in flats) or len({len(cast(tuple, f)) for f in flats}) != 1:
        return None
    return cast(list[tuple[np.ndarray, ...]], flats)


def _compacted_column(
    parts: Sequence[Any],
    flats: list[tuple[np.ndarray, ...]] | None,
    carved: Iterator[np.ndarray],
    spans: Sequence[tuple[int, int]],
    owned: Sequence[frozenset[int]],
) -> list[Any]:
    """One column of :func:`_compacted_rows`: a part per table, copied."""
    if flats is not None:
        own = []
        for k in range(len(flats[0])):
            target = next(carved)
            np.concatenate([f[k] for f in flats], out=target)
            own.append(target)
        dtype = _dtype_of_its_own(parts[0].dtype)
        out = []
        for part, (start, stop) in zip(parts, spans, strict=True):
            rows = tuple(o[start:stop] for o in own)
            out.append(rows[0] if _poolable(part) else flat.unflat(rows, dtype))
        return out
    if all(arrow.is_arrow(p) for p in parts):
        return _compacted_arrow(parts, owned)
    joined = (
        np.concatenate(parts)
        if all(isinstance(p, np.ndarray) for p in parts)
        else type(parts[0])._concat_same_type(parts)
    )
    return [joined[start:stop] for start, stop in spans]


def _compacted_index(
    indexes: Sequence[pd.Index], spans: Sequence[tuple[int, int]], owned: Sequence[frozenset[int]]
) -> list[pd.Index]:
    """The index of :func:`_compacted_rows` that is a ``pd.Index``: Arrow-backed
    (strings under pandas 3) as its columns are; otherwise appended (a copy)."""
    first = indexes[0]
    if arrow.is_arrow(first.array):
        arrays = _compacted_arrow([x.array for x in indexes], owned)
        return [pd.Index(a, name=first.name, copy=False) for a in arrays]
    joined = first.append(list(indexes[1:]))
    return [joined[start:stop] for start, stop in spans]


def _dtype_of_its_own(dtype: Any) -> Any:
    """``dtype``, a categorical's rebuilt: received, its categories (Arrow
    strings under pandas 3) are views of the message they came in, which
    would stay alive with every column of that dtype.  Pickled in band, they
    come back in memory of their own (categories are few, most often)."""
    if not isinstance(dtype, pd.CategoricalDtype):
        return dtype
    return pickle.loads(pickle.dumps(dtype, protocol=pickle.HIGHEST_PROTOCOL))


def _compacted_arrow(parts: Sequence[Any], owned: Sequence[frozenset[int]]) -> list[Any]:
    """Arrow-backed ``parts`` with every chunk that is a view of shared
    memory copied, all into one array; chunks made of ``owned[i]`` kept.
    A dictionary's values are copied too (``concat_arrays`` keeps the first
    chunk's, a view of the message)."""
    copy: list[pa.Array] = []
    for part, own in zip(parts, owned, strict=True):
        copy.extend(c for c in part._pa_array.iterchunks() if not arrow.made_of(c, own))
    joined = pa.concat_arrays(copy) if copy else None  # a copy, even of one chunk
    if isinstance(joined, pa.DictionaryArray):
        joined = pa.DictionaryArray.from_arrays(
            joined.indices, pa.concat_arrays([joined.dictionary]), ordered=joined.type.ordered
        )
    position = 0
    out = []
    for part, own in zip(parts, owned, strict=True):
        chunks = []
        for chunk in part._pa_array.iterchunks():
            if arrow.made_of(chunk, own):
                chunks.append(chunk)
            else:
                assert joined is not None
                chunks.append(joined.slice(position, len(chunk)))
                position += len(chunk)
        out.append(arrow.with_chunks(part, chunks))
    return out
