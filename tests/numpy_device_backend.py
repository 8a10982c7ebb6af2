"""TEST DOUBLE: a backend whose "device" tables are numpy arrays.

No GPU exists on CI machines, so this stands in for device memory to drive
the store's device tier: its tables are charged to the device tier, and
moving them to host or back copies them, like cuDF buffers to pinned host
memory.  As with cuDF, ``deserialize`` (of frames from the wire or from a
spill file) returns a table on the device.  It is used by tests only; for
whole shuffles on a cluster see ``device_stand_in.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from gpushuffle.backends.base import TableBackend


@dataclass
class FakeDeviceTable:
    values: np.ndarray
    on_device: bool = True

    def __len__(self) -> int:
        return len(self.values)


class NumpyDeviceBackend(TableBackend):
    name = "numpy-device-test-double"
    tier = "device"

    moves_to_host = 0
    moves_to_device = 0

    @classmethod
    def handles(cls, meta: Any) -> bool:
        return False

    def validate(self, frame: Any, meta: Any, column: str, input_partition: int) -> None:
        pass

    def split(self, frame, column, rank, nranks, keep_index):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def slice(self, table: FakeDeviceTable, start: int, stop: int) -> FakeDeviceTable:
        return FakeDeviceTable(table.values[start:stop], table.on_device)

    def assemble(self, tables: Iterable[Any], nrows: int, meta: Any, keep_index: bool) -> Any:
        out = np.empty(nrows, dtype=np.int64)
        position = 0
        for table in tables:
            assert table.on_device, "pieces must be brought back to the device before use"
            out[position : position + len(table)] = table.values
            position += len(table)
        return pd.DataFrame({"v": out})

    def empty(self, meta: Any) -> Any:
        return meta

    def nbytes(self, table: FakeDeviceTable) -> int:
        return int(table.values.nbytes)

    def nrows(self, table: FakeDeviceTable) -> int:
        return len(table)

    def to_host(self, table: FakeDeviceTable) -> FakeDeviceTable:
        assert table.on_device
        type(self).moves_to_host += 1
        return FakeDeviceTable(table.values.copy(), on_device=False)

    def to_device(self, table: FakeDeviceTable) -> FakeDeviceTable:
        assert not table.on_device
        type(self).moves_to_device += 1
        return FakeDeviceTable(table.values.copy(), on_device=True)

    def serialize(
        self, table: FakeDeviceTable, *, device_frames: bool = False
    ) -> tuple[dict[str, Any], list[Any]]:
        assert not table.on_device, "only host tables are written to disk"
        return {"n": len(table)}, [memoryview(np.ascontiguousarray(table.values)).cast("B")]

    def deserialize(self, header: dict[str, Any], frames: Sequence[Any]) -> FakeDeviceTable:
        # Like cuDF, whose deserialize copies the frames to the device.
        type(self).moves_to_device += 1
        return FakeDeviceTable(np.frombuffer(frames[0], dtype=np.int64).copy(), on_device=True)


# -- Device memory and column operations, for the bounded assemble ------------
# (gpushuffle.backends.columns.assemble_columns: the bounded unpack,
# measured here without a GPU).


class DeviceMemory:
    """Bytes of stand-in device arrays alive now, and their peak.

    An array counts from :meth:`empty` until it (and every view of it) is
    garbage collected, as an RMM allocation counts until its last owner goes.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.peak = 0

    def empty(self, n: int, dtype: Any) -> np.ndarray:
        array = np.empty(n, dtype)
        self.bytes += array.nbytes
        self.peak = max(self.peak, self.bytes)
        weakref.finalize(array, self._free, array.nbytes)
        return array

    def full(self, n: int, value: Any, dtype: Any) -> np.ndarray:
        array = self.empty(n, dtype)
        array[:] = value
        return array

    def _free(self, nbytes: int) -> None:
        self.bytes -= nbytes


class NumpyDeviceColumns:
    """``ColumnOps`` over numpy arrays held in a :class:`DeviceMemory`.

    Object arrays stand for variable-width columns (strings): they cannot be
    filled in place.  Numpy arrays hold no nulls.
    """

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory

    def size(self, column: np.ndarray) -> int:
        return len(column)

    def null_count(self, column: np.ndarray) -> int:
        return 0

    def fits(self, column: np.ndarray, out: np.ndarray) -> bool:
        return column.dtype == out.dtype

    def fixed_width(self, column: np.ndarray) -> bool:
        return not column.dtype.hasobject

    def allocate(self, like: np.ndarray, nrows: int) -> np.ndarray:
        return self.memory.empty(nrows, like.dtype)

    def copy_into(self, column: np.ndarray, out: np.ndarray, position: int) -> None:
        out[position : position + len(column)] = column

    def head(self, out: np.ndarray, nrows: int) -> np.ndarray:
        return out[:nrows]

    def copy(self, column: np.ndarray) -> np.ndarray:
        out = self.memory.empty(len(column), column.dtype)
        out[:] = column
        return out

    def concatenate(self, columns: Sequence[np.ndarray]) -> np.ndarray:
        dtype = np.result_type(*columns)
        out = self.memory.empty(sum(len(c) for c in columns), dtype)
        return np.concatenate(columns, out=out)

    def finish(self, out: np.ndarray, nulls: int) -> np.ndarray:
        return out
