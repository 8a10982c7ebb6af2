"""TEST DOUBLE: a device backend for whole shuffles on machines without a GPU.

CI has no GPU, so the cuDF backend cannot run there.  This backend shuffles
pandas frames but behaves like :class:`gpushuffle.backends.cudf.CudfBackend`
wherever that decides correctness:

- its tables live on the "device" tier: received shards are charged there and
  moved device -> host -> disk when the device budget is full;
- a table is either *on the device* (a live table) or *packed on the host*
  (a header and host frames, as ``pack`` + a host copy makes it); ``slice``
  and ``assemble`` accept device tables only, ``to_host`` takes a device
  table, ``to_device`` a packed one;
- ``serialize`` accepts either and ``deserialize`` returns a table *on the
  device* (cuDF copies received or spilled frames straight to the device);
- its tables refuse plain pickling, as a pylibcudf table effectively must
  (its state is a raw device address): only ``serialize`` can carry them.

Counters (per process) tell tests which of these calls happened.  Use
:func:`stand_in_device` to route pandas frames to it on a cluster.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gpushuffle.backends import register_backend, unregister_backend
from gpushuffle.backends.base import refuse_pickle
from gpushuffle.backends.pandas import PandasBackend, PandasTable

NAME = "device-stand-in"
calls: Counter[str] = Counter()


@dataclass(eq=False)
class StandInTable:
    nrows: int
    nbytes: int
    #: On the device: the rows.  Packed on the host: None.
    table: PandasTable | None = None
    #: Packed on the host: a header and host frames.
    packed: tuple[dict[str, Any], list[bytes]] | None = None

    def __reduce__(self) -> Any:
        refuse_pickle(self)


class DeviceStandInBackend(PandasBackend):
    name = NAME
    tier = "device"
    borrows = False  # as cuDF: device tables are copied by the split

    def split(self, frame, column, rank, nranks, keep_index):  # type: ignore[no-untyped-def]
        table, offsets = super().split(frame, column, rank, nranks, keep_index)
        return StandInTable(len(table), super().nbytes(table), table=table), offsets

    def split_groups(
        self, frame, column, rank, nranks, keep_index, groups, borrow=None, local=None
    ):  # type: ignore[no-untyped-def]
        # The local group stays out of the others' buffers (a scatter
        # writes the groups sent into one block per column).
        tables, offsets = super().split_groups(
            frame, column, rank, nranks, keep_index, groups, local=local
        )
        nbytes = super().nbytes
        return [StandInTable(len(t), nbytes(t), table=t) for t in tables], offsets

    def concat_nbytes(self, table: StandInTable) -> int:
        # As the cuDF backend (TableBackend's default): every byte counted twice.
        return self.nbytes(table)

    # ... and no piece keeps bytes as it is added (TableBackend's default).
    keep_rows = 0

    def kept_nbytes(self, table: StandInTable) -> int:
        return 0

    def slice(self, table: StandInTable, start: int, stop: int) -> StandInTable:
        assert table.table is not None, "slice takes device tables (as pylibcudf)"
        view = super().slice(table.table, start, stop)
        return StandInTable(stop - start, super().nbytes(view), table=view)

    def assemble(self, tables: Iterable[Any], nrows: int, meta: Any, keep_index: bool) -> Any:
        def on_device() -> Iterator[PandasTable]:
            for table in tables:
                assert table.table is not None, "assemble takes device tables only"
                yield table.table

        calls["assemble"] += 1
        return super().assemble(on_device(), nrows, meta, keep_index)

    def nbytes(self, table: StandInTable) -> int:
        return table.nbytes

    def nrows(self, table: StandInTable) -> int:
        return table.nrows

    def to_host(self, table: StandInTable) -> StandInTable:
        assert table.table is not None, "to_host takes a device table"
        calls["to_host"] += 1
        header, frames = super().serialize(table.table)
        return StandInTable(
            table.nrows, table.nbytes, packed=(header, [bytes(memoryview(f)) for f in frames])
        )

    def to_device(self, table: StandInTable) -> StandInTable:
        assert table.packed is not None, "to_device takes a table packed on the host"
        calls["to_device"] += 1
        header, frames = table.packed
        return StandInTable(table.nrows, table.nbytes, table=super().deserialize(header, frames))

    def serialize(
        self, table: StandInTable, *, device_frames: bool = False
    ) -> tuple[dict[str, Any], list[Any]]:
        calls["serialize"] += 1
        if table.packed is not None:
            header, frames = table.packed
        else:
            assert table.table is not None
            header, frames = super().serialize(table.table)
        return {"nrows": table.nrows, "nbytes": table.nbytes, "pandas": header}, list(frames)

    def deserialize(self, header: dict[str, Any], frames: Sequence[Any]) -> StandInTable:
        calls["deserialize"] += 1
        # Like cuDF: whatever the frames' origin (the wire, a spill file),
        # the table comes back on the device.
        table = super().deserialize(header["pandas"], frames)
        return StandInTable(header["nrows"], header["nbytes"], table=table)


def enable(dask_worker: Any = None) -> None:
    """Route pandas frames in this process to the stand-in (before pandas)."""
    register_backend(DeviceStandInBackend, first=True)


def disable(dask_worker: Any = None) -> None:
    unregister_backend(NAME)


def counts(dask_worker: Any = None) -> dict[str, int]:
    return dict(calls)


@contextlib.contextmanager
def stand_in_device(client: Any = None) -> Iterator[None]:
    """Shuffles of pandas frames use the stand-in, here and on ``client``'s workers."""
    enable()
    if client is not None:
        client.run(enable)
    try:
        yield
    finally:
        disable()
        if client is not None:
            client.run(disable)
