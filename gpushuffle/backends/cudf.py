"""cuDF backend: partition, pack, carry and reassemble on the GPU with pylibcudf.

Imported only when a collection's meta is a ``cudf.DataFrame`` (see
:func:`gpushuffle.backends.backend_for`), so the package works without cuDF.

Data path
---------
split
    The partition-id column is mapped to each row's rank with a device
    gather, and the rows are reordered by rank with one *stable* device sort
    (``pylibcudf.sorting.stable_sort_by_key``).  ``pylibcudf.partitioning.partition``
    would be a single scatter pass, but it leaves the order within a
    partition undefined, and gpushuffle promises rows in input order, as
    ``p2p`` does.  Offsets per rank come from a device ``lower_bound``: one
    small device -> host copy of ``nranks + 1`` integers per input partition.
slice
    ``pylibcudf.copying.slice``: views, no copy.
wire
    ``pylibcudf.contiguous_split.pack``: host metadata bytes plus one device
    buffer.  In distributed's ``cuda`` serializer family (UCX) the device
    buffer travels as a CUDA frame, device to device; in the ``dask`` family
    (TCP) it is copied to host memory first and back to the device on arrival.
    Unpacking (``unpack_from_memoryviews``) reads only host metadata.
host tier
    A device table moved off the GPU is kept packed: its metadata and a host
    copy of its device buffer.
assemble
    ``pylibcudf.concatenate.concatenate`` of the pieces in input order, then
    the ``cudf.DataFrame`` is rebuilt from ``meta``: names from meta, dtypes
    restored with ``_with_type_metadata`` (categories, decimals, structs),
    index columns set back as the index.  No device -> host copy happens to
    learn the schema.  Unlike the pandas backend, this concatenation holds
    the pieces and the output at once (about twice the output partition on
    the device).

The index travels as extra columns at the end of the table.  This module has
been type-checked against pylibcudf 26.10's stubs (``ci/typecheck_gpu.sh``)
but, at the time of writing, never run on a GPU: see the README's
"Validated on" table.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import cudf
import cupy
import numpy as np
import pylibcudf as plc
import rmm
from cudf.core.column import ColumnBase

from gpushuffle.backends.base import TableBackend, check_frame
from gpushuffle.backends.columns import assemble_columns

_INDEX_PREFIX = "__gpushuffle_index_"


@dataclass
class CudfTable:
    """Rows of a cuDF frame: device columns (meta's columns, then the index).

    On the device, ``table`` holds them; moved to host, ``packed`` holds the
    ``pack`` metadata and a host copy of the packed device buffer.
    """

    nrows: int
    nbytes: int
    table: plc.Table | None = None
    packed: tuple[bytes, np.ndarray] | None = None


class CudfBackend(TableBackend):
    name = "cudf"
    tier = "device"

    @classmethod
    def handles(cls, meta: Any) -> bool:
        return isinstance(meta, cudf.DataFrame)

    def validate(self, frame: Any, meta: Any, column: str, input_partition: int) -> None:
        check_frame(frame, meta, cudf.DataFrame, input_partition, column)

    def split(
        self,
        frame: Any,
        column: str,
        rank: np.ndarray,
        nranks: int,
        keep_index: bool,
    ) -> tuple[CudfTable, np.ndarray]:
        data = frame.drop(columns=[column])
        columns = [data._data[name].to_pylibcudf() for name in data._column_names]
        if keep_index:
            columns += [c.to_pylibcudf() for c in data.index._columns]
        table = plc.Table(columns)
        # rank[partition id] for every row, on the device.
        ranks = plc.Column.from_array(cupy.asarray(rank))
        partition_ids = frame._data[column].to_pylibcudf()
        keys = plc.copying.gather(
            plc.Table([ranks]), partition_ids, plc.copying.OutOfBoundsPolicy.DONT_CHECK
        )
        ordered = plc.sorting.stable_sort_by_key(
            table, keys, [plc.types.Order.ASCENDING], [plc.types.NullOrder.AFTER]
        )
        sorted_keys = plc.sorting.stable_sort(
            keys, [plc.types.Order.ASCENDING], [plc.types.NullOrder.AFTER]
        )
        needles = plc.Column.from_array(cupy.arange(nranks + 1, dtype=rank.dtype))
        bounds = plc.search.lower_bound(
            sorted_keys,
            plc.Table([needles]),
            [plc.types.Order.ASCENDING],
            [plc.types.NullOrder.AFTER],
        )
        offsets = cupy.asnumpy(cupy.asarray(ColumnBase.from_pylibcudf(bounds).values)).astype(
            np.int64
        )
        # Rows of rank ``nranks`` (outputs nobody asked for) lie past offsets[-1].
        nbytes = int(data.memory_usage(index=keep_index, deep=True).sum())
        nrows = int(offsets[-1])
        if nrows < len(frame):
            ordered = plc.copying.slice(ordered, [0, nrows])[0]
            nbytes = nbytes * nrows // max(len(frame), 1)
        return CudfTable(nrows=nrows, nbytes=nbytes, table=ordered), offsets

    def slice(self, table: CudfTable, start: int, stop: int) -> CudfTable:
        assert table.table is not None, "slice device tables"
        view = plc.copying.slice(table.table, [start, stop])[0]
        return CudfTable(
            nrows=stop - start,
            nbytes=table.nbytes * (stop - start) // max(table.nrows, 1),
            table=view,
        )

    def assemble(self, tables: Iterable[Any], nrows: int, meta: Any, keep_index: bool) -> Any:
        # Each fixed-width output column is allocated once and every piece
        # copied into it as the store brings it up, so the device holds the
        # output plus one piece (plus copies of variable-width columns),
        # not all pieces and their concatenation at once.
        columns = assemble_columns(_device_columns(tables), nrows, _PlcColumns())
        if columns is None:
            return self.empty(meta)
        return self._frame(plc.Table(columns), meta, keep_index)

    def _frame(self, table: plc.Table, meta: Any, keep_index: bool) -> Any:
        columns = table.columns()
        ndata = len(meta.columns)
        data = {
            name: ColumnBase.create(col, dtype)
            for name, col, dtype in zip(meta.columns, columns[:ndata], meta.dtypes, strict=True)
        }
        out = cudf.DataFrame._from_data(data)
        if keep_index:
            index_frame = cudf.DataFrame._from_data(
                {
                    f"{_INDEX_PREFIX}{i}": ColumnBase.create(col, dtype)
                    for i, (col, dtype) in enumerate(
                        zip(columns[ndata:], _index_dtypes(meta.index), strict=True)
                    )
                }
            )
            index = (
                cudf.MultiIndex.from_frame(index_frame, names=meta.index.names)
                if isinstance(meta.index, cudf.MultiIndex)
                else cudf.Index(index_frame.iloc[:, 0], name=meta.index.name)
            )
            out.index = index
        return out

    def empty(self, meta: Any) -> Any:
        return meta.copy()

    def nbytes(self, table: CudfTable) -> int:
        return table.nbytes

    def nrows(self, table: CudfTable) -> int:
        return table.nrows

    def to_host(self, table: CudfTable) -> CudfTable:
        assert table.table is not None
        metadata, device = plc.contiguous_split.pack(table.table).release()
        host = cupy.asnumpy(cupy.asarray(device).view(cupy.uint8))
        return CudfTable(table.nrows, table.nbytes, packed=(bytes(metadata), host))

    def to_device(self, table: CudfTable) -> CudfTable:
        assert table.packed is not None
        metadata, host = table.packed
        return _unpack(table.nrows, table.nbytes, metadata, rmm.DeviceBuffer.to_device(host))

    def serialize(
        self, table: CudfTable, *, device_frames: bool = False
    ) -> tuple[dict[str, Any], list[Any]]:
        header = {"nrows": table.nrows, "nbytes": table.nbytes}
        if table.packed is not None:
            metadata, host = table.packed
            return header, [metadata, host]
        assert table.table is not None
        metadata_view, device = plc.contiguous_split.pack(table.table).release()
        if device_frames:
            # UCX sends frames exposing __cuda_array_interface__ device to device.
            return header, [bytes(metadata_view), device]
        return header, [bytes(metadata_view), cupy.asnumpy(cupy.asarray(device))]

    def deserialize(self, header: dict[str, Any], frames: Sequence[Any]) -> CudfTable:
        metadata, data = frames
        if hasattr(data, "__cuda_array_interface__"):
            buffer = data  # received as an rmm.DeviceBuffer from the pool
        else:
            buffer = rmm.DeviceBuffer.to_device(memoryview(data).cast("B"))
        return _unpack(header["nrows"], header["nbytes"], bytes(metadata), buffer)


def _device_columns(tables: Iterable[CudfTable]) -> Iterator[Sequence[plc.Column]]:
    """Each non-empty table's columns, holding no table while the next is brought up."""
    for table in tables:
        if not table.nrows:
            continue
        assert table.table is not None, "pieces must be on the device"
        columns = table.table.columns()
        del table
        yield columns
        del columns


class _PlcColumns:
    """:class:`~gpushuffle.backends.columns.ColumnOps` for pylibcudf columns."""

    def size(self, column: plc.Column) -> int:
        return column.size()

    def null_count(self, column: plc.Column) -> int:
        return column.null_count()

    def fits(self, column: plc.Column, out: plc.Column) -> bool:
        return column.type() == out.type()

    def fixed_width(self, column: plc.Column) -> bool:
        return plc.traits.is_fixed_width(column.type())

    def allocate(self, like: plc.Column, nrows: int) -> plc.Column:
        # An initialized (all valid) mask: copy_range_in_place updates the
        # null count from the bits it overwrites, and pieces without a mask
        # are copied as valid.  finish() drops the mask if nothing is null.
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
        if not nulls:
            return out.with_mask(None, 0)
        return out.with_mask(out.null_mask(), nulls)


def _unpack(nrows: int, nbytes: int, metadata: bytes, device: Any) -> CudfTable:
    table = plc.contiguous_split.unpack_from_memoryviews(
        memoryview(metadata), plc.gpumemoryview(device)
    )
    return CudfTable(nrows=nrows, nbytes=nbytes, table=table)


def _index_dtypes(index: Any) -> list[Any]:
    if isinstance(index, cudf.MultiIndex):
        return list(index.dtypes)
    return [index.dtype]
