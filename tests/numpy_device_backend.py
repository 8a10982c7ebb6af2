"""TEST DOUBLE: a backend whose "device" tables are numpy arrays.

No GPU exists on CI machines, so this stands in for device memory to drive
the store's device tier: its tables are charged to the device tier, and
moving them to host or back copies them, like cuDF buffers to pinned host
memory.  As with cuDF, ``deserialize`` (of frames from the wire or from a
spill file) returns a table on the device.  It is used by tests only; for
whole shuffles on a cluster see ``device_stand_in.py``.
"""

from __future__ import annotations

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
