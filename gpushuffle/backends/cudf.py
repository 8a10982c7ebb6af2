"""cuDF backend: partition, pack, carry and reassemble on the GPU with pylibcudf.

Imported only when a collection's meta is a ``cudf.DataFrame`` (see
:func:`gpushuffle.backends.backend_for`), so the package works without cuDF.

Tables and tiers
----------------
A :class:`CudfTable` is either *on the device* (``parts``: pylibcudf tables)
or *packed on the host* (``packed``: ``pack`` metadata and a host copy of the
packed data, per part).  Part 0 holds the rows: meta's columns, then the index
columns unless the shuffle ignores the index.  Each categorical column adds
one part: its categories, which travel with its codes, because partitions may
carry categories that differ from each other and from meta's (dask_cudf's
meta often has unknown categories).

=================  ===================================  =====================
call               takes                                returns
=================  ===================================  =====================
``split``          a cuDF frame                         a device table
``slice``          a device table                       a device table (view)
``to_host``        a device table                       a packed table
``to_device``      a packed table                       a device table
``serialize``      either                               header and frames
``deserialize``    frames (wire or spill file)          a device table
``assemble``       device tables                        a cuDF frame
=================  ===================================  =====================

Data path
---------
split
    The partition-id column is mapped to each row's rank with a device
    gather; one *stable* sort of the ranks gives the order, and one gather
    reorders the rows.  ``pylibcudf.partitioning.partition`` would be a single
    scatter pass, but it leaves the order within a partition undefined, and
    gpushuffle promises rows in input order, as ``p2p`` does.  Offsets per
    rank come from a device ``lower_bound``: one small device -> host copy of
    ``nranks + 1`` integers per input partition.
wire
    In distributed's ``cuda`` serializer family (UCX) each part is packed
    (``pylibcudf.contiguous_split.pack``) and its device buffer travels as a
    CUDA frame, device to device.  In the ``dask`` family (TCP) and when a
    table moves to host memory, each part is packed straight into host memory
    through a bounded device staging buffer (``ChunkedPack.pack_to_host``), so
    moving a table off a full device never allocates a device copy of it.
    Unpacking (``unpack_from_memoryviews``) reads only host metadata.
assemble
    Output columns of fixed width are allocated once and each piece is copied
    into place (``copy_range_in_place``), cast to meta's type first where the
    data's type differs (dask's meta is often loose); variable-width columns
    (strings, lists, structs) are copied out of each piece and concatenated
    at the end.  The store releases a piece as soon as the next is asked
    for, so an unpack holds the output plus one piece, plus the copies of
    variable-width columns: :func:`gpushuffle.backends.columns.assemble_columns`,
    whose bound CI measures with numpy stand-in columns.  Categorical columns
    are concatenated at the end over the union of the pieces' categories in
    order of appearance (as ``union_categoricals`` does for pandas), and
    given meta's categories when those are known and cover every value.
    The frame is rebuilt like meta (``_from_columns_like_self``: column
    labels, their names and dtype, the index and its names), so no device ->
    host copy happens to learn a schema.

The module has been type-checked against pylibcudf 26.10's stubs
(``ci/typecheck_gpu.sh``); see the README's "Validated on" table for what has
run on a GPU.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import cudf
import numpy as np
import pandas as pd
import pylibcudf as plc
import rmm
from cudf.core.column import ColumnBase
from cudf.core.column.utils import access_columns
from cudf.utils.dtypes import PYLIBCUDF_TO_SUPPORTED_NUMPY_TYPES, dtype_to_pylibcudf_type

from gpushuffle.backends.base import TableBackend, check_frame, dtype_mismatch, refuse_pickle
from gpushuffle.backends.columns import assemble_columns
from gpushuffle.backends.dtypes import dtype_family
from gpushuffle.engine import copies
from gpushuffle.errors import ShuffleInputError

#: Device staging buffer of ChunkedPack when packing into host memory.
STAGING_BYTES = 64 << 20
_MIN_STAGING_BYTES = 1 << 20  # ChunkedPack's minimum
_UNKNOWN_CATEGORIES = "__UNKNOWN_CATEGORIES__"  # dask's marker in meta


@dataclass(eq=False)
class CudfTable:
    """Rows of a cuDF frame, on the device (``parts``) or packed on the host.

    ``parts[0]`` holds the rows (meta's columns, then the index); one more
    part per categorical column holds its categories.  A table without
    columns (only the key was shuffled, without the index) has an empty
    ``parts[0]`` and only ``nrows``.
    """

    nrows: int
    nbytes: int
    parts: list[plc.Table] | None = None
    packed: list[tuple[bytes, Any]] | None = None
    #: The cuDF dtype of each categorical column's categories (``parts[1:]``):
    #: pylibcudf types lack timezones, decimal precision and struct field
    #: names, which the output's categories must have.
    category_dtypes: tuple[Any, ...] = ()

    def __reduce__(self) -> Any:
        # A pylibcudf table pickles its raw device address.
        refuse_pickle(self)

    @property
    def rows(self) -> plc.Table:
        assert self.parts is not None, "a device table was expected, not a packed one"
        return self.parts[0]


def _family(dtype: Any) -> str:
    if isinstance(dtype, cudf.CategoricalDtype):
        return "category"
    if isinstance(dtype, cudf.core.dtypes.DecimalDtype):
        return "decimal"
    if isinstance(dtype, cudf.ListDtype | cudf.StructDtype | cudf.IntervalDtype | pd.ArrowDtype):
        # Nested types are not cast: they must match exactly.
        return f"exactly {dtype}"
    return dtype_family(dtype)


def _column_dtypes(frame: Any, keep_index: bool) -> list[Any]:
    dtypes = [column.dtype for column in frame._columns]
    if keep_index:
        dtypes += [column.dtype for column in frame.index._columns]
    return dtypes


class CudfBackend(TableBackend):
    name = "cudf"
    tier = "device"

    def __init__(self) -> None:
        # Categories of meta's categorical columns, read once per meta.
        self._known_categories: dict[int, dict[int, Any]] = {}

    @classmethod
    def handles(cls, meta: Any) -> bool:
        return isinstance(meta, cudf.DataFrame)

    def validate(self, frame: Any, meta: Any, column: str, input_partition: int) -> None:
        check_frame(frame, meta, cudf.DataFrame, input_partition, column)
        for name, actual, expected in zip(
            meta._column_names,
            _column_dtypes(frame, False),
            _column_dtypes(meta, False),
            strict=True,
        ):
            # The partition column is the shuffle's own (check_frame checks
            # it): dask's meta for it may say anything (issue 33).
            if name != column and actual != expected and _family(actual) != _family(expected):
                raise dtype_mismatch(name, input_partition, actual, expected)

    # -- transfer -----------------------------------------------------------

    def split(
        self,
        frame: Any,
        column: str,
        rank: np.ndarray,
        nranks: int,
        keep_index: bool,
    ) -> tuple[CudfTable, np.ndarray]:
        tables, offsets = self.split_groups(frame, column, rank, nranks, keep_index, [(0, nranks)])
        return tables[0], offsets

    def split_groups(
        self,
        frame: Any,
        column: str,
        rank: np.ndarray,
        nranks: int,
        keep_index: bool,
        groups: Sequence[tuple[int, int]],
        borrow: int | None = None,
        local: int | None = None,
    ) -> tuple[list[CudfTable], np.ndarray]:
        """One gather per group of ranks, so that each destination's rows are
        device buffers of their own: the local shard kept in the store does
        not keep the other workers' rows alive once they were sent."""
        inputs = [c for name, c in frame._column_labels_and_values if name != column]
        if keep_index:
            inputs += list(frame.index._columns)
        categories = [c.categories for c in inputs if isinstance(c.dtype, cudf.CategoricalDtype)]
        category_dtypes = tuple(c.dtype for c in categories)
        key = frame._data[column]
        tables = []
        # Spill-safe reads (cudf's own pattern, core/_internals/sorting.py):
        # with cuDF spilling on, the columns' buffers stay on the device, and
        # spill-locked, while their pointers are in use.
        with access_columns(key, *inputs, *categories, mode="read", scope="internal") as held:
            columns = [c.plc_column for c in held[1 : 1 + len(inputs)]]
            # Categories travel with each table: a copy of their own, not a
            # view of the input's (which may spill or go).
            category_parts = [plc.Table([c.plc_column.copy()]) for c in held[1 + len(inputs) :]]
            # rank[partition id] for every row, on the device.
            keys = plc.copying.gather(
                plc.Table([plc.Column.from_array(rank)]),
                held[0].plc_column,
                plc.copying.OutOfBoundsPolicy.DONT_CHECK,
            )
            order = plc.sorting.stable_sorted_order(
                keys, [plc.types.Order.ASCENDING], [plc.types.NullOrder.AFTER]
            )
            sorted_keys = plc.copying.gather(keys, order, plc.copying.OutOfBoundsPolicy.DONT_CHECK)
            bounds = plc.search.lower_bound(
                sorted_keys,
                plc.Table([plc.Column.from_array(np.arange(nranks + 1, dtype=rank.dtype))]),
                [plc.types.Order.ASCENDING],
                [plc.types.NullOrder.AFTER],
            )
            # nranks + 1 integers to the host, as cudf's Frame.searchsorted
            # reads lower_bound's result (core/frame.py).
            offsets = _host_int64(bounds)
            for first, last in groups:
                start, stop = int(offsets[first]), int(offsets[last])
                rows, nbytes = _gather_rows(columns, order, start, stop)
                copies.count("split", nbytes)
                nbytes += sum(int(p.columns()[0].device_buffer_size()) for p in category_parts)
                tables.append(
                    CudfTable(
                        nrows=stop - start,
                        nbytes=nbytes,
                        parts=[rows, *category_parts],
                        category_dtypes=category_dtypes,
                    )
                )
        return tables, offsets

    def slice(self, table: CudfTable, start: int, stop: int) -> CudfTable:
        assert table.parts is not None, "slice device tables"
        rows = table.rows
        view = plc.copying.slice(rows, [start, stop])[0] if rows.num_columns() else rows
        return CudfTable(
            nrows=stop - start,
            nbytes=table.nbytes * (stop - start) // max(table.nrows, 1),
            # Categories are shared by every slice of a table.
            parts=[view, *table.parts[1:]],
            category_dtypes=table.category_dtypes,
        )

    # -- tiers and the wire --------------------------------------------------

    def to_host(self, table: CudfTable) -> CudfTable:
        assert table.parts is not None, "to_host takes a device table"
        return CudfTable(
            table.nrows,
            table.nbytes,
            packed=[_pack_to_host(p, table.nbytes) for p in table.parts],
            category_dtypes=table.category_dtypes,
        )

    def to_device(self, table: CudfTable) -> CudfTable:
        assert table.packed is not None, "to_device takes a table packed on the host"
        parts = [_unpack(metadata, _to_device(data)) for metadata, data in table.packed]
        return CudfTable(
            table.nrows, table.nbytes, parts=parts, category_dtypes=table.category_dtypes
        )

    def serialize(
        self, table: CudfTable, *, device_frames: bool = False, memo: Any = None
    ) -> tuple[dict[str, Any], list[Any]]:
        if table.packed is not None:
            packed = table.packed
        else:
            assert table.parts is not None
            if device_frames:
                # UCX sends frames exposing __cuda_array_interface__ device to device.
                packed = [_pack_on_device(p) for p in table.parts]
            else:
                packed = [_pack_to_host(p, table.nbytes) for p in table.parts]
            copies.count("serialize", table.nbytes)
        frames: list[Any] = []
        for metadata, data in packed:
            frames += [metadata, data]
        header: dict[str, Any] = {
            "nrows": table.nrows,
            "nbytes": table.nbytes,
            "nparts": len(packed),
        }
        if table.category_dtypes:
            # Host metadata, like pack's: dtypes pickle (cuDF's own
            # serialization of a dtype pickles its categories' dtype too).
            header["category_dtypes"] = pickle.dumps(table.category_dtypes, protocol=5)
        return header, frames

    def deserialize(self, header: dict[str, Any], frames: Sequence[Any]) -> CudfTable:
        # Frames from UCX arrive as device buffers (rmm.DeviceBuffer from the
        # current resource); from TCP or a spill file as host memory.  Either
        # way the table comes back on the device.
        parts = [
            _unpack(bytes(frames[2 * i]), _to_device(frames[2 * i + 1]))
            for i in range(header["nparts"])
        ]
        if not any(hasattr(f, "__cuda_array_interface__") for f in frames[1::2]):
            copies.count("deserialize", header["nbytes"])  # host -> device
        dtypes = header.get("category_dtypes")
        return CudfTable(
            nrows=header["nrows"],
            nbytes=header["nbytes"],
            parts=parts,
            category_dtypes=pickle.loads(dtypes) if dtypes else (),
        )

    # -- unpack -------------------------------------------------------------

    def assemble(self, tables: Iterable[Any], nrows: int, meta: Any, keep_index: bool) -> Any:
        known = self._categories_of(meta, keep_index)
        dtypes = _column_dtypes(meta, keep_index)
        categorical = [i for i, d in enumerate(dtypes) if isinstance(d, cudf.CategoricalDtype)]
        plain = [i for i in range(len(dtypes)) if i not in categorical]
        types = {i: dtype_to_pylibcudf_type(dtypes[i]) for i in plain}
        labels = [*meta._column_names, *(meta.index.names if keep_index else [])]
        # Categorical pieces: codes (copied out of the piece) and categories.
        coded: dict[int, list[tuple[plc.Column, plc.Table, Any]]] = {i: [] for i in categorical}

        def pieces() -> Iterator[list[plc.Column]]:
            for table in tables:
                assert table.parts is not None, "assemble takes device tables"
                columns = table.rows.columns()
                for i, categories, dtype in zip(
                    categorical, table.parts[1:], table.category_dtypes, strict=True
                ):
                    coded[i].append((columns[i].copy(), categories, dtype))
                yield [_cast(columns[i], types[i], labels[i]) for i in plain]
                del table, columns  # let the store release this piece before the next

        built = dict(zip(plain, assemble_columns(pieces(), nrows, _PLC_COLUMNS) or [], strict=True))
        copies.count("unpack", sum(int(c.device_buffer_size()) for c in built.values()))
        columns = [
            _categorical(coded[i], dtypes[i], known.get(i))
            if i in coded
            else ColumnBase.create(built[i], dtypes[i])
            for i in range(len(dtypes))
        ]
        if not columns:
            return cudf.DataFrame(index=cudf.RangeIndex(nrows))
        ndata = len(meta._column_names)
        if not keep_index:
            return meta._from_columns_like_self(columns[:ndata])
        return meta._from_columns_like_self(
            columns[ndata:] + columns[:ndata], index_names=list(meta.index.names)
        )

    def _categories_of(self, meta: Any, keep_index: bool) -> dict[int, Any]:
        """Known categories of meta's categorical columns, by table position."""
        key = id(meta)
        if key not in self._known_categories:
            known = {}
            for i, dtype in enumerate(_column_dtypes(meta, keep_index)):
                if isinstance(dtype, cudf.CategoricalDtype):
                    categories = dtype.categories
                    # One small copy of meta's categories, once per meta.
                    if _UNKNOWN_CATEGORIES not in categories.to_pandas():
                        known[i] = categories._column
            self._known_categories = {key: known}
        return self._known_categories[key]

    def empty(self, meta: Any) -> Any:
        return meta.copy()

    def nbytes(self, table: CudfTable) -> int:
        return table.nbytes

    def nrows(self, table: CudfTable) -> int:
        return table.nrows

    def merge(
        self,
        left: Any,
        right: Any,
        *,
        how: str,
        left_on: Any,
        right_on: Any,
        left_index: bool,
        right_index: bool,
        suffixes: tuple[str, str],
        indicator: bool,
        meta: Any,
    ) -> Any:
        # One cuDF hash join of the two assembled device frames.  "leftsemi"
        # is a cuDF join type of its own (pandas needs the right side's
        # duplicates dropped first); cuDF raises for indicator=True.
        out = left.merge(
            right,
            how=how,
            left_on=left_on,
            right_on=right_on,
            left_index=left_index,
            right_index=right_index,
            suffixes=suffixes,
            indicator=indicator,
        )
        if list(out.columns) != list(meta.columns):
            out = out[list(meta.columns)]
        return out


class _PlcColumns:
    """:class:`~gpushuffle.backends.columns.ColumnOps` over pylibcudf columns."""

    def size(self, column: plc.Column) -> int:
        return column.size()

    def null_count(self, column: plc.Column) -> int:
        return column.null_count()

    def fits(self, column: plc.Column, out: plc.Column) -> bool:
        return column.type() == out.type()

    def fixed_width(self, column: plc.Column) -> bool:
        return plc.traits.is_fixed_width(column.type())

    def allocate(self, like: plc.Column, nrows: int) -> plc.Column:
        # With a validity mask: any piece may hold nulls (dropped in finish()
        # when none did).
        return plc.column_factories.make_fixed_width_column(
            like.type(), nrows, plc.types.MaskState.ALL_VALID
        )

    def copy_into(self, column: plc.Column, out: plc.Column, position: int) -> None:
        plc.copying.copy_range_in_place(column, out, 0, column.size(), position)

    def head(self, out: plc.Column, nrows: int) -> plc.Column:
        return plc.copying.slice(out, [0, nrows])[0]

    def copy(self, column: plc.Column) -> plc.Column:
        return column.copy()

    def concatenate(self, columns: Sequence[plc.Column]) -> plc.Column:
        return plc.concatenate.concatenate(list(columns))

    def finish(self, out: plc.Column, nulls: int) -> plc.Column:
        return out if nulls else out.with_mask(None, 0)


_PLC_COLUMNS = _PlcColumns()


def _cast(column: plc.Column, type: plc.DataType, label: Any) -> plc.Column:
    """``column`` as meta's type, where that keeps every value (dask's meta is
    often loose: int data, float meta).

    Where it would not (float data where meta says int: NaN and fractions
    have no integer), the pandas backend keeps the data's type, as p2p does;
    an output column here is allocated once in meta's type, so the shuffle
    fails instead, naming the column, rather than losing values.
    """
    if column.type() == type or not plc.traits.is_fixed_width(type):
        return column
    if not _keeps_values(column.type(), type):
        raise ShuffleInputError(
            f"gpushuffle: column {label!r} arrived as {_type_name(column.type())} where the "
            f"collection's meta says {_type_name(type)}, and the cast would lose values "
            "(NaN or fractions into integers, fewer decimal places, or a narrower type). "
            "Fix the meta (`map_partitions(..., meta=...)`) or cast the data (`astype`) "
            "before shuffling."
        )
    return plc.unary.cast(column, type)


_DECIMALS = {
    plc.TypeId.DECIMAL32: 32,
    plc.TypeId.DECIMAL64: 64,
    plc.TypeId.DECIMAL128: 128,
}


def _keeps_values(source: plc.DataType, target: plc.DataType) -> bool:
    """Whether every value of ``source`` has one in ``target``: numpy's safe
    casts; decimals only to the same scale in storage as wide or wider
    (libcudf truncates to fewer decimal places, and more of them leave fewer
    digits before the point); nothing else between decimals and other types."""
    if source.id() in _DECIMALS or target.id() in _DECIMALS:
        return (
            source.id() in _DECIMALS
            and target.id() in _DECIMALS
            and source.scale() == target.scale()
            and _DECIMALS[target.id()] >= _DECIMALS[source.id()]
        )
    before = PYLIBCUDF_TO_SUPPORTED_NUMPY_TYPES.get(source.id())
    after = PYLIBCUDF_TO_SUPPORTED_NUMPY_TYPES.get(target.id())
    return before is not None and after is not None and bool(np.can_cast(before, after, "safe"))


def _type_name(type: plc.DataType) -> str:
    numpy_type = PYLIBCUDF_TO_SUPPORTED_NUMPY_TYPES.get(type.id())
    if numpy_type is not None:
        return str(numpy_type)
    return f"{type.id().name} (scale {type.scale()})" if type.id() in _DECIMALS else type.id().name


def _categorical(
    pieces: list[tuple[plc.Column, plc.Table, Any]], meta_dtype: Any, known: Any
) -> ColumnBase:
    """Codes over the union of the pieces' categories (then meta's, if known).

    The categories are rebuilt with the dtype they had in their input
    partition (``ColumnBase.create``, cuDF's factory for a pylibcudf column
    of a known dtype), never inferred from pylibcudf's type.
    """
    columns = []
    for piece_codes, piece_categories, categories_dtype in pieces:
        piece_dtype = cudf.CategoricalDtype(
            categories=ColumnBase.create(piece_categories.columns()[0], categories_dtype),
            ordered=meta_dtype.ordered,
        )
        columns.append(ColumnBase.create(piece_codes, piece_dtype))
    present = [c.categories for c in columns if len(c.categories)]
    if present:
        with access_columns(*present, mode="read", scope="internal") as held:
            union = plc.stream_compaction.stable_distinct(
                plc.Table([plc.concatenate.concatenate([c.plc_column for c in held])]),
                [0],
                plc.stream_compaction.DuplicateKeepOption.KEEP_FIRST,
                plc.types.NullEquality.EQUAL,
                plc.types.NanEquality.ALL_EQUAL,
            )
        categories = ColumnBase.create(union.columns()[0], present[0].dtype)
    else:
        categories = columns[0].categories
    dtype = cudf.CategoricalDtype(categories=categories, ordered=meta_dtype.ordered)
    codes_type = dtype_to_pylibcudf_type(dtype)
    remapped = [column._set_categories(categories, is_unique=True) for column in columns]
    with access_columns(*remapped, mode="read", scope="internal") as held:
        codes = [
            c.plc_column
            if c.plc_column.type() == codes_type
            else plc.unary.cast(c.plc_column, codes_type)
            for c in held
        ]
        # A column of its own, not a view of the last piece's buffers.
        whole = codes[0].copy() if len(codes) == 1 else plc.concatenate.concatenate(codes)
    out = ColumnBase.create(whole, dtype)
    if known is not None and bool(
        cudf.Index._from_column(categories).isin(cudf.Index._from_column(known)).all()
    ):
        # meta's categories cover every value: the output gets meta's dtype.
        out = out._set_categories(known, is_unique=True, ordered=bool(meta_dtype.ordered))
    return out


def _host_int64(column: plc.Column) -> np.ndarray:
    """A small integer column as a host int64 array (cudf's Frame.searchsorted:
    ``ColumnBase.create(plc.unary.cast(col, INT64), int64).values``, then
    cupy's ``get``)."""
    as_int64 = plc.unary.cast(column, plc.DataType(plc.TypeId.INT64))
    return ColumnBase.create(as_int64, np.dtype("int64")).values.get()


def _gather_rows(
    columns: list[plc.Column], order: plc.Column, start: int, stop: int
) -> tuple[plc.Table, int]:
    """Rows ``order[start:stop]`` of ``columns``, in buffers of their own."""
    if not columns:
        return plc.Table([]), 0
    positions = plc.copying.slice(order, [start, stop])[0]
    rows = plc.copying.gather(
        plc.Table(columns), positions, plc.copying.OutOfBoundsPolicy.DONT_CHECK
    )
    return rows, sum(int(c.device_buffer_size()) for c in rows.columns())


def _staging_bytes(nbytes: int) -> int:
    return max(_MIN_STAGING_BYTES, min(STAGING_BYTES, nbytes))


def _pack_to_host(part: plc.Table, nbytes: int) -> tuple[bytes, Any]:
    """Pack ``part`` into host memory through a bounded device staging buffer."""
    if not part.num_columns():
        return b"", np.empty(0, np.uint8)
    size = _staging_bytes(nbytes)
    packer = plc.contiguous_split.ChunkedPack.create(part, size)
    metadata, data = packer.pack_to_host(rmm.DeviceBuffer(size=size))
    return bytes(metadata), data


def _pack_on_device(part: plc.Table) -> tuple[bytes, Any]:
    if not part.num_columns():
        return b"", np.empty(0, np.uint8)
    if not part.num_rows():
        # Rows of none: the host path's metadata and an empty host frame,
        # rather than a device buffer of nothing to send.
        return _pack_to_host(part, 0)
    metadata, device = plc.contiguous_split.pack(part).release()
    return bytes(metadata), device


def _to_device(data: Any) -> Any:
    if hasattr(data, "__cuda_array_interface__"):
        return data
    return rmm.DeviceBuffer.to_device(memoryview(data).cast("B"))


def _unpack(metadata: bytes, device: Any) -> plc.Table:
    if not metadata:
        return plc.Table([])
    return plc.contiguous_split.unpack_from_memoryviews(
        memoryview(metadata), plc.gpumemoryview(device)
    )
