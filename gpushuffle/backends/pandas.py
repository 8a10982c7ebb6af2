"""pandas backend: columns as numpy / extension arrays in host memory.

A table is a list of 1-d column arrays plus an optional index.  Splitting
sorts the partition ids once (stable) and takes each column once per
destination worker, into one pooled block per destination, so every column
of every shard is a contiguous array (which pickle protocol 5 sends out of
band without a copy) and what goes to another worker is freed once sent,
whatever the local shard keeps alive.  Where most of a partition's rows go
to other workers (4 workers and more; or all of them stay, on one worker),
its fixed-width columns are scattered instead, every destination's rows in
one pass into one pooled block (``gpushuffle.split.reorder``,
:func:`_scatter_passes`): a gather reads a cache line for about every
value, a scatter streams.  A shard the engine holds back is then copied
out of that block (:meth:`PandasBackend.detached`).  An output partition's numeric
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

import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from gpushuffle import config
from gpushuffle.backends import arrow
from gpushuffle.backends.base import (
    OWN_FRAMES,
    TableBackend,
    check_frame,
    dtype_mismatch,
    refuse_pickle,
)
from gpushuffle.backends.dtypes import (
    _compatible,
    _dtypes,
    _fill_dtypes,
    _plain_index,
    output_dtype,
)
from gpushuffle.backends.pandas_columns import (
    _KEEP_CHUNK_ROWS,
    _as_index,
    _carve,
    _compacted_rows,
    _concat_index,
    _copied_out,
    _index_rows,
    _index_values,
    _scatter_rows,
    _take_rows,
)
from gpushuffle.backends.pandas_output import (
    _BATCH_BYTES,
    _BATCH_PIECES,
    _ColumnBuilder,
)
from gpushuffle.engine import copies
from gpushuffle.engine.pool import host_pool
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
    #: Whether the columns are views of blocks that other destinations' rows
    #: share (a scatter pass, :func:`_scatter_passes`): what keeps this
    #: table alive keeps theirs (see :meth:`PandasBackend.detached`).
    shared: bool = False

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


#: ``gpushuffle.split.reorder`` "auto" scatters a set of groups (written in
#: one pass over each column) where the partition has at least
#: :data:`_SCATTER_MIN_ROWS` rows and they hold at least this share of them.
#: Measured in the split itself on the 2-core VM (16 numeric columns, 40
#: outputs, ms per partition, gather / scatter): 4 workers (3/4 sent) 2.0 /
#: 1.2 at 20k rows, 3.7 / 2.8 at 60k, 19.6 / 15.1 at 300k, 106 / 52 at 1M;
#: 8 workers 25.9 / 16.8 at 300k (40 outputs throughout: more outputs mean
#: more write streams, with fewer rows each).  Half of the rows is not
#: enough: 2 workers
#: 0.9 / 1.1 at 20k, 2.4 / 2.7 at 60k, 13.8 / 13.0 at 300k, 53 / 45 at 1M
#: with the local half borrowed, and TPC-H lineitem's numeric columns (750k
#: rows, the local half copied) 38.8 / 41.4: the pass reads every row.
#: Below 3/4 by a margin: with 4 workers a partition sends 3/4 of its rows
#: give or take the keys' spread, and at exactly 0.75 half of the
#: benchmark's partitions were gathered.
_SCATTER_MIN_SHARE = 0.7
_SCATTER_MIN_ROWS = 1 << 14

_REORDERS = ("auto", "gather", "scatter")

#: Key of a spilled piece's header that holds its store's memo (in memory only).
_MEMO = "memo"


def _worth_scattering(rows: int, nrows: int) -> bool:
    """Whether "auto" scatters ``rows`` of a partition of ``nrows`` in one pass."""
    return nrows >= _SCATTER_MIN_ROWS and rows >= _SCATTER_MIN_SHARE * nrows


def _scatter_passes(
    groups: Sequence[tuple[int, int]],
    offsets: np.ndarray,
    local: int | None,
    borrowed: bool,
    nrows: int,
) -> list[list[int]]:
    """The groups to reorder by scatter, one list per pass (each pass writes
    its groups into one pooled block): the groups sent to other workers
    together, and the one staying on this worker (``local``) on its own,
    unless ``borrowed``, since the store keeps it after the others were
    sent.  ``gpushuffle.split.reorder`` decides which passes are made
    (:func:`_worth_scattering` for "auto"); the other groups are gathered."""
    mode = config.get("split.reorder")
    if mode not in _REORDERS:
        raise ValueError(
            f"gpushuffle.split.reorder: {mode!r} is not one of {', '.join(_REORDERS)}; "
            "use 'auto' (the default)"
        )
    if mode == "gather":
        return []
    passes = [[g for g in range(len(groups)) if g != local]]
    if local is not None and not borrowed:
        passes.append([local])
    chosen = []
    for groups_of_pass in passes:
        rows = sum(int(offsets[groups[g][1]] - offsets[groups[g][0]]) for g in groups_of_pass)
        if rows and (mode == "scatter" or _worth_scattering(rows, nrows)):
            chosen.append(groups_of_pass)
    return chosen


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


def _materialize(table: BorrowedRows) -> PandasTable:
    """The borrowed rows copied out of their input (before a spill)."""
    source = table.source
    rows = _gather_positions(table.rows)
    with copies.timed("split"):
        columns, index = _take_rows(source.values, source.index, rows, host_pool())
    copies.count("split", _nbytes(PandasTable(columns, index)))
    return PandasTable(columns, index, source.names)


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


def _columns_and_share(
    table: PandasTable | BorrowedRows,
) -> tuple[Sequence[Any], np.ndarray | pd.Index | None, float]:
    """A table's columns and index, and the share of them it holds (borrowed
    rows: their share of the input's rows)."""
    if isinstance(table, BorrowedRows):
        source = table.source
        return source.values, source.index, len(table.rows) / max(source.nrows, 1)
    return table.columns, table.index, 1.0


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
        local: int | None = None,
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
        tables: list[PandasTable | BorrowedRows | None] = [None] * len(groups)
        if borrow is not None:
            assert local in (None, borrow), (local, borrow)
            local = borrow
        for scattered in _scatter_passes(groups, offsets, local, source is not None, len(frame)):
            parts = [
                (order[offsets[a] : offsets[b]], offsets[a : b + 1] - offsets[a])
                for a, b in (groups[g] for g in scattered)
            ]
            for g, (columns, taken) in zip(
                scattered, _scatter_rows(values, index, len(frame), parts, pool), strict=True
            ):
                tables[g] = PandasTable(columns, taken, names, shared=len(scattered) > 1)
        for group, (first, last) in enumerate(groups):
            if tables[group] is not None:
                continue
            rows = order[offsets[first] : offsets[last]]
            if group == borrow and source is not None:
                tables[group] = BorrowedRows(source, _kept_positions(rows, source.nrows))
                continue
            # Each group's numpy columns share one pooled block of their own.
            bounds = offsets[first : last + 1] - offsets[first]
            columns, taken = _take_rows(values, index, rows, pool, bounds)
            tables[group] = PandasTable(columns, taken, names)
        copies.count("split", sum(_nbytes(t) for t in tables if isinstance(t, PandasTable)))
        return tables, offsets  # type: ignore[return-value]

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
            table.shared,
        )

    def detached(self, table: PandasTable | BorrowedRows) -> PandasTable | BorrowedRows:
        """``table`` with its numpy data copied into a block of its own where
        it shares one with other destinations' rows (:attr:`PandasTable.shared`);
        Arrow and object columns are the table's own already."""
        if not isinstance(table, PandasTable) or not table.shared:
            return table
        with copies.timed("split"):
            columns, index = _copied_out(table.columns, table.index, host_pool())
        copied = PandasTable(columns, index, table.names, table.standalone)
        copies.count("split", _nbytes(copied))
        return copied

    def compacted(self, tables: Sequence[Any]) -> list[Any] | None:
        if not tables or not all(isinstance(t, PandasTable) for t in tables):
            return None
        rows = _compacted_rows(
            [(t.columns, t.index, t.standalone) for t in tables],
            [len(t) for t in tables],
            host_pool(),
        )
        if rows is None:
            return None
        out = [
            PandasTable(tuple(columns), index, t.names, t.standalone)
            for (columns, index), t in zip(rows, tables, strict=True)
        ]
        copies.count("unpack", sum(_nbytes(t) for t in out))
        return out

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

    def concat_nbytes(self, table: PandasTable | BorrowedRows) -> int:
        # Columns of fixed width fill the output in place (_ColumnBuilder);
        # strings, objects and the like are concatenated at the end (but see
        # kept_nbytes).
        columns, index, share = _columns_and_share(table)
        total = sum(int(c.nbytes) for c in columns if _fill_dtypes(c.dtype) is None)
        if index is not None and not isinstance(index, np.ndarray) and not _plain_index(index):
            total += int(index.nbytes)
        return int(total * share)

    #: Pieces of at least _KEEP_CHUNK_ROWS rows keep their string chunks (the
    #: assembly copies them once, as each piece is added).
    keep_rows = _KEEP_CHUNK_ROWS

    def kept_nbytes(self, table: PandasTable | BorrowedRows) -> int:
        # Arrow strings: a piece's chunk of keep_rows rows or more is copied
        # (or taken) once as the piece is added and kept as a chunk of the
        # output (_own_large_chunks, _coalesce), not joined at the end.
        # Counted once only while those chunks pickle as they are: an output
        # that large is then spilled or sent by distributed, and pandas'
        # pickle combines an Arrow column's chunks, a second copy of every
        # string (ArrowExtensionArray.__getstate__: 1 GiB workers built hot
        # partitions within a rule that counted them once and were restarted
        # while distributed spilled them, 2026-12-06, docs/scaling.md).
        if not arrow.pickles_in_place():
            return 0
        columns, _, share = _columns_and_share(table)
        return int(share * sum(int(c.nbytes) for c in columns if arrow.is_strings(c)))

    def unshared_bytes(self, table: PandasTable | BorrowedRows) -> int | None:
        if isinstance(table, BorrowedRows):
            return table.source.unshared_bytes()
        return None

    def new_memo(self) -> arrow.PickleMemo | None:
        # Spilled pieces pickle their dtypes by number into it: a
        # categorical's categories once per store, not once per piece.  Not
        # for a subclass with a serialization of its own, which may not
        # take the memo (or read what it wrote without it).
        own = type(self)
        if own.serialize is not PandasBackend.serialize or (
            own.deserialize is not PandasBackend.deserialize
        ):
            return None
        return arrow.PickleMemo()

    def materialize(self, table: PandasTable | BorrowedRows) -> PandasTable:
        if isinstance(table, BorrowedRows):
            return _materialize(table)
        return table

    def nrows(self, table: PandasTable) -> int:
        return len(table)

    def serialize(
        self,
        table: PandasTable | BorrowedRows,
        *,
        device_frames: bool = False,
        memo: arrow.PickleMemo | None = None,
    ) -> tuple[dict[str, Any], list[Any]]:
        table = self.materialize(table)
        buffers: list[pickle.PickleBuffer] = []
        chunk_buffers: list[int] = []
        try:
            # numpy arrays and Arrow buffers go out of band as views; only
            # object columns and small metadata are copied into the payload.
            payload = arrow.dumps((table.columns, table.index), buffers.append, chunk_buffers, memo)
        except Exception as e:
            raise _unpicklable(table, e) from e
        copies.count("serialize", len(payload))
        header: dict[str, Any] = {
            "npickle-buffers": len(buffers),
            # Frames (payload first) to receive into memory of their own:
            # Arrow chunks made of such frames are kept as they arrived.
            OWN_FRAMES: [1 + i for i in chunk_buffers],
        }
        if memo is not None:
            header[_MEMO] = memo
        return header, [payload, *(b.raw() for b in buffers)]

    def deserialize(self, header: dict[str, Any], frames: Sequence[Any]) -> PandasTable:
        columns, index = arrow.loads(frames[0], frames[1:], header.get(_MEMO))
        copies.count("deserialize", memoryview(frames[0]).nbytes)
        standalone = frozenset(_address(f) for f in frames[1:] if _standalone(f))
        return PandasTable(columns, index, standalone=standalone)


# Outputs that distributed spills or sends are pickled without pandas' copies.
arrow.register_pickling()
