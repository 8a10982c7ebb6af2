"""The tiered store on its own: budgets, moves between tiers, bounded reads."""

from __future__ import annotations

import asyncio
import errno
import os
import pickle
import tracemalloc

import dask
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from numpy_device_backend import (
    DeviceMemory,
    FakeDeviceTable,
    NumpyDeviceBackend,
    NumpyDeviceColumns,
)
from pandas_versions import borrows

from gpushuffle._distributed import ShuffleClosedError
from gpushuffle.backends import register_backend
from gpushuffle.backends.columns import assemble_columns
from gpushuffle.backends.pandas import PandasBackend, PandasTable
from gpushuffle.engine.memory import TierUsage, WorkerMemory
from gpushuffle.engine.store import ShardStore
from gpushuffle.errors import ShuffleDiskFullError, ShuffleMemoryError
from gpushuffle.transport import Shard

register_backend(NumpyDeviceBackend)

ROWS = 1000  # per shard: 8,000 bytes of int64


def make_memory(device=None, host=None, disk=True) -> WorkerMemory:
    return WorkerMemory(
        device=TierUsage(limit=device),
        host=TierUsage(limit=host),
        disk=TierUsage(limit=None),
        disk_enabled=disk,
    )


async def _offload(func, *args):
    return func(*args)


def device_shard(input_partition: int, npartitions: int = 4) -> Shard:
    # Rows of output partition p hold values input_partition * 10**6 + p * 10**4 + i.
    per = ROWS // npartitions
    values = np.concatenate(
        [input_partition * 10**6 + p * 10**4 + np.arange(per) for p in range(npartitions)]
    )
    return Shard(
        backend=NumpyDeviceBackend.name,
        input_partition=input_partition,
        partitions=np.arange(npartitions),
        offsets=np.arange(npartitions + 1) * per,
        table=FakeDeviceTable(values),
        nbytes=values.nbytes,
    )


def store_for(backend, memory, tmp_path, wait_timeout=0.0) -> ShardStore:
    return ShardStore(
        backend=backend,
        memory=memory,
        directory=str(tmp_path / "spill"),
        offload=_offload,
        wait_timeout=wait_timeout,
        describe="test run",
    )


def test_three_tiers_down_and_back_up(tmp_path):
    NumpyDeviceBackend.moves_to_host = NumpyDeviceBackend.moves_to_device = 0
    memory = make_memory(device=2 * ROWS * 8, host=2 * ROWS * 8)
    backend = NumpyDeviceBackend()
    store = store_for(backend, memory, tmp_path)

    async def fill():
        for i in (3, 0, 5, 1, 4, 2):  # arrival order differs from input order
            await store.put(device_shard(i))
            assert memory.device.bytes <= memory.device.limit
            assert memory.host.bytes <= memory.host.limit

    asyncio.run(fill())
    snapshot = memory.snapshot()
    assert snapshot["device_to_host_bytes"] > 0
    assert snapshot["host_to_disk_bytes"] > 0
    assert memory.disk.bytes > 0
    assert os.listdir(tmp_path / "spill")

    for p in range(4):
        nrows, tables = store.read(p)
        out = backend.assemble(tables, nrows, None, False)["v"].to_numpy()
        expected = np.concatenate([i * 10**6 + p * 10**4 + np.arange(ROWS // 4) for i in range(6)])
        np.testing.assert_array_equal(out, expected)  # every row, in input order
    snapshot = memory.snapshot()
    assert snapshot["disk_to_host_bytes"] > 0
    assert snapshot["host_to_device_bytes"] > 0
    assert NumpyDeviceBackend.moves_to_device > 0
    assert memory.device.bytes == memory.host.bytes == memory.disk.bytes == 0
    store.close()
    assert not (tmp_path / "spill").exists()


def test_pieces_being_read_are_never_moved(tmp_path):
    memory = make_memory(device=ROWS * 8, host=None)
    backend = NumpyDeviceBackend()
    store = store_for(backend, memory, tmp_path)
    asyncio.run(store.put(device_shard(0)))
    _, tables = store.read(0)  # partition 0 is being read
    first = next(tables)
    assert first.on_device
    asyncio.run(store.put(device_shard(1)))  # over the device limit: moves shard 0's others
    assert first.on_device and first.values[0] == 0
    rest = list(tables)
    assert rest == []  # partition 0 of input 1 arrived after the read began
    store.close()
    assert memory.device.bytes == memory.host.bytes == 0


def test_disk_off_and_over_budget_fails_clearly(tmp_path):
    memory = make_memory(host=ROWS * 8, disk=False)
    store = store_for(PandasBackend(), memory, tmp_path)

    async def fill():
        for i in range(3):
            table = PandasTable([np.arange(ROWS)], None)
            await store.put(Shard("pandas", i, np.array([0]), np.array([0, ROWS]), table, ROWS * 8))

    with pytest.raises(ShuffleMemoryError, match=r"gpushuffle.memory.host-limit .*disk is false"):
        asyncio.run(fill())
    store.close()
    assert memory.host.bytes == 0


def test_waits_for_another_run_then_fails_after_timeout(tmp_path):
    memory = make_memory(host=ROWS * 8, disk=False)
    memory.charge("host", ROWS * 8)  # another shuffle holds the whole budget
    store = store_for(PandasBackend(), memory, tmp_path, wait_timeout=0.3)
    table = PandasTable([np.arange(ROWS)], None)

    async def put_and_release_later():
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, memory.release, "host", ROWS * 8)
        await store.put(Shard("pandas", 0, np.array([0]), np.array([0, ROWS]), table, ROWS * 8))

    asyncio.run(put_and_release_later())  # the other run released: no error
    memory.charge("host", ROWS * 8)
    with pytest.raises(ShuffleMemoryError):
        asyncio.run(store.put(Shard("pandas", 1, np.array([0]), np.array([0, ROWS]), table, 8)))
    store.close()


def test_disk_full_names_the_directory(tmp_path, monkeypatch):
    import gpushuffle.engine.store as store_module

    def full_disk(fd, frames):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "_write_all", full_disk)
    memory = make_memory(host=ROWS * 8)
    store = store_for(PandasBackend(), memory, tmp_path)
    table = PandasTable([np.arange(2 * ROWS)], None)
    with pytest.raises(ShuffleDiskFullError, match="spill"):
        asyncio.run(
            store.put(Shard("pandas", 0, np.array([0]), np.array([0, 2 * ROWS]), table, 16_000))
        )
    store.close()


def test_assemble_holds_output_plus_one_piece():
    """Unpack copies each piece into the output and lets it go: no 2x spike."""
    backend = PandasBackend()
    npieces, rows = 20, 200_000  # 20 pieces x 2 columns x 1.6 MB = 64 MB in all
    meta = pd.DataFrame({"a": np.array([], np.int64), "b": np.array([], np.float64)})
    piece_bytes = rows * 16
    output_bytes = npieces * piece_bytes

    def pieces():
        for i in range(npieces):  # like reading from disk: made only when asked for
            yield PandasTable([np.full(rows, i, np.int64), np.full(rows, i, np.float64)], None)

    tracemalloc.start()
    tracemalloc.reset_peak()
    before, _ = tracemalloc.get_traced_memory()
    out = backend.assemble(pieces(), npieces * rows, meta, keep_index=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(out) == npieces * rows and out["a"].iloc[-1] == npieces - 1
    extra = peak - before
    # The output, two pieces alive at a hand-over, and 1 MiB of bookkeeping.
    assert extra <= output_bytes + 2 * piece_bytes + (1 << 20), extra
    # A concatenating implementation would hold every piece and the output.
    assert extra < 2 * output_bytes * 0.75


def test_device_assemble_holds_output_plus_one_piece():
    """The device unpack (the cuDF backend's, on stand-in columns) fills the
    output in place: the device holds the output plus one piece, not 2x."""
    device = DeviceMemory()
    ops = NumpyDeviceColumns(device)
    npieces, rows = 20, 10_000
    piece_bytes = rows * 16
    made = []

    def pieces():
        for i in range(npieces):  # like the store: each brought up only when asked
            made.append(device.bytes)
            yield [device.full(rows, i, np.int64), device.full(rows, i / 2, np.float64)]

    out = assemble_columns(pieces(), npieces * rows, ops)
    assert out is not None
    a, b = out
    np.testing.assert_array_equal(a, np.repeat(np.arange(npieces), rows))
    np.testing.assert_array_equal(b, np.repeat(np.arange(npieces) / 2, rows))
    output_bytes = npieces * piece_bytes
    # Every piece was released before the next was brought up ...
    assert made[1:] == [output_bytes] * (npieces - 1), made
    # ... so the peak is the output plus one piece (concatenating every piece
    # at once would hold 2x the output).
    assert device.peak == output_bytes + piece_bytes
    del out, a, b
    assert device.bytes == 0


def test_device_assemble_variable_width_columns_are_copied_out_of_pieces():
    """A variable-width column (strings) is concatenated at the end, from copies:
    the rest of each piece is released once copied."""
    device = DeviceMemory()
    ops = NumpyDeviceColumns(device)
    npieces, rows = 10, 1_000

    def strings(i):
        column = device.empty(rows, object)
        column[:] = f"s{i}"
        return column

    def pieces():
        for i in range(npieces):
            yield [device.full(rows, i, np.int64), strings(i), device.full(rows, i, np.int32)]

    out = assemble_columns(pieces(), npieces * rows, ops)
    assert out is not None
    assert out[1].tolist() == [f"s{i}" for i in range(npieces) for _ in range(rows)]
    assert out[2].dtype == np.int32 and out[2][-1] == npieces - 1
    fixed = npieces * rows * (8 + 4)
    strings_bytes = npieces * rows * 8  # object pointers
    piece = rows * (8 + 8 + 4)
    # Output, one piece, the strings' copies and their concatenation.
    assert device.peak <= fixed + piece + 2 * strings_bytes


def test_device_assemble_falls_back_to_concatenate_for_mixed_types():
    device = DeviceMemory()
    ops = NumpyDeviceColumns(device)
    pieces = [[device.full(3, 1, np.int32)], [device.full(2, 2, np.int64)]]
    out = assemble_columns(iter(pieces), 5, ops)
    assert out is not None
    assert out[0].tolist() == [1, 1, 1, 2, 2] and out[0].dtype == np.int64
    assert assemble_columns(iter([]), 0, ops) is None
    with pytest.raises(ValueError, match="expected 6"):
        assemble_columns(iter(pieces), 6, ops)


# -- closing while work is in flight (a worker left: the run is closed) -----


def pandas_shard(input_partition: int, npartitions: int = 4, rows: int = ROWS) -> Shard:
    table = PandasTable([np.arange(rows) + input_partition * rows], None)
    per = rows // npartitions
    return Shard(
        "pandas",
        input_partition,
        np.arange(npartitions),
        np.arange(npartitions + 1) * per,
        table,
        rows * 8,
    )


def assert_nothing_charged(memory: WorkerMemory) -> None:
    # Not negative either: a double release would let later shuffles on the
    # worker exceed the budget.
    assert (memory.device.bytes, memory.host.bytes, memory.disk.bytes) == (0, 0, 0)


def test_close_while_an_unpack_reads_releases_once(tmp_path):
    memory = make_memory(host=2 * ROWS * 8)
    store = store_for(PandasBackend(), memory, tmp_path)

    async def fill():
        for i in range(6):
            await store.put(pandas_shard(i))

    asyncio.run(fill())
    assert memory.disk.bytes > 0 and memory.host.bytes > 0
    _, tables = store.read(0)  # pieces on disk first, in memory last
    next(tables)
    store.close()
    assert_nothing_charged(memory)
    # The rest of the read finds the run closed (its task is rescheduled).
    with pytest.raises(ShuffleClosedError):
        list(tables)
    assert_nothing_charged(memory)
    assert not (tmp_path / "spill").exists()


def test_close_while_a_shard_moves_to_disk_charges_nothing_after(tmp_path):
    memory = make_memory(host=ROWS * 8)
    store = store_for(PandasBackend(), memory, tmp_path)

    async def close_during_offload(func, *args):
        result = func(*args)  # the file write finished ...
        store.close()  # ... and the run closed before the store saw it
        return result

    store._offload = close_during_offload

    async def fill():
        for i in range(3):
            await store.put(pandas_shard(i))

    with pytest.raises(ShuffleClosedError):
        asyncio.run(fill())
    assert_nothing_charged(memory)
    assert not (tmp_path / "spill").exists()


def test_put_after_close_is_refused(tmp_path):
    memory = make_memory(host=None)
    store = store_for(PandasBackend(), memory, tmp_path)
    store.close()
    with pytest.raises(ShuffleClosedError):
        asyncio.run(store.put(pandas_shard(0)))
    assert_nothing_charged(memory)


def test_close_while_waiting_for_memory_is_not_a_memory_error(tmp_path):
    memory = make_memory(host=ROWS * 8, disk=False)
    memory.charge("host", ROWS * 8)  # another shuffle holds the whole budget
    store = store_for(PandasBackend(), memory, tmp_path, wait_timeout=30)

    async def put_then_close():
        asyncio.get_running_loop().call_later(0.1, store.close)
        await store.put(pandas_shard(0))

    # A closed run is restarted by distributed; a ShuffleMemoryError would fail it.
    with pytest.raises(ShuffleClosedError):
        asyncio.run(put_then_close())
    memory.release("host", ROWS * 8)
    assert_nothing_charged(memory)


def _borrowed_shard(frame: pd.DataFrame, nparts: int, input_partition: int = 0):
    """The local shard of ``frame`` (every output partition local), split by
    ``pid`` with the local group borrowed when the caller holds ``frame``."""
    backend = PandasBackend()
    rank = np.arange(nparts, dtype=np.int16)
    tables, offsets = backend.split_groups(
        frame, "pid", rank, nparts, True, [(0, nparts)], borrow=0
    )
    table = tables[0]
    return Shard(
        backend=backend.name,
        input_partition=input_partition,
        partitions=np.arange(nparts),
        offsets=offsets,
        table=table,
        nbytes=backend.nbytes(table),
    )


def _input_frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "x": rng.integers(0, 10**9, n),
            "s": pd.array([f"v{i}-{seed}" for i in range(n)], dtype="str"),
            "pid": rng.integers(0, 4, n).astype(np.int16),
        },
        index=pd.Index(rng.permutation(n) + seed * n, name="i"),
    )


def _assert_reads_back(store, backend, memory, expected: dict) -> None:
    """Each partition ``p`` reads back as ``expected[p]``, then nothing is left
    charged; closes the store."""
    for p, frame in expected.items():
        nrows, pieces = store.read(p)
        out = backend.assemble(pieces, nrows, frame.iloc[:0], keep_index=True)
        pd.testing.assert_frame_equal(out, frame)
    assert memory.host.bytes == 0 and memory.disk.bytes == 0
    store.close()


def test_borrowed_rows_move_when_their_partition_column_alone_exceeds_the_budget(tmp_path):
    """As in a transfer task: the input the worker holds, plus the partition
    column dask assigned for the shuffle, which only the borrowed rows keep.
    A budget smaller than that column must spill them, not fail the shuffle
    with "nothing can move" (seen on workers whose "auto" budget was ~0)."""
    backend = PandasBackend()
    memory = make_memory(host=4096)
    store = store_for(backend, memory, tmp_path)
    held = _input_frame(5_000, seed=4).drop(columns="pid")
    pid = np.random.default_rng(4).integers(0, 4, len(held)).astype(np.int16)
    expected = {p: held[pid == p] for p in range(4)}
    asyncio.run(store.put(_borrowed_shard(held.assign(pid=pid), 4)))
    assert memory.moves[("host", "disk")].bytes > 0
    assert memory.host.bytes <= 4096
    _assert_reads_back(store, backend, memory, expected)


@borrows
def test_an_input_let_go_of_after_the_last_put_is_charged_and_spilled_at_unpack(tmp_path):
    """The unpack phase has no puts: what borrowed rows keep alive of an
    input the worker let go of since (distributed spilled it) is charged
    and spilled when the unpack starts, not held uncounted."""
    backend = PandasBackend()
    memory = make_memory(host=4096)
    store = store_for(backend, memory, tmp_path)
    held = _input_frame(5_000, seed=3)
    expected = {p: held[held.pid == p].drop(columns="pid") for p in range(4)}
    asyncio.run(store.put(_borrowed_shard(held.copy(deep=False), 4)))
    asyncio.run(store.release_let_go_inputs())
    assert memory.host.bytes < 1024 and memory.moves.get(("host", "disk")) is None  # still held
    del held
    asyncio.run(store.release_let_go_inputs())
    assert memory.moves[("host", "disk")].bytes > 5_000 * 8
    assert memory.host.bytes <= 4096
    _assert_reads_back(store, backend, memory, expected)


@borrows
def test_borrowed_rows_cost_nothing_while_the_input_is_held_then_count_and_spill(tmp_path):
    """Rows left in an input the caller holds are charged nothing; once the
    caller lets go, the next put charges what they keep alive and spills
    them (copied out of the input), and every row reads back as it was."""
    from gpushuffle.backends.pandas import BorrowedRows

    backend = PandasBackend()
    memory = make_memory(host=4096)
    store = store_for(backend, memory, tmp_path)
    held = _input_frame(5_000, seed=1)
    expected = {p: held[held.pid == p].drop(columns="pid") for p in range(4)}
    shard = _borrowed_shard(held.copy(deep=False), 4)
    assert isinstance(shard.table, BorrowedRows)
    asyncio.run(store.put(shard))
    assert memory.host.bytes < 1024  # the index is counted; the rows are not
    assert store.statistics.bytes_borrowed == shard.nbytes
    assert memory.moves.get(("host", "disk")) is None

    # The caller lets go: only the store keeps the input alive now.
    del held, shard
    other = _input_frame(50, seed=2)
    asyncio.run(store.put(_borrowed_shard(other, 4, input_partition=1)))
    moved = memory.moves[("host", "disk")]
    assert moved.bytes > 5_000 * 8  # the borrowed rows, copied out and written
    assert memory.host.bytes <= 4096
    truth = {
        p: pd.concat([expected[p], other[other.pid == p].drop(columns="pid")]) for p in range(4)
    }
    _assert_reads_back(store, backend, memory, truth)


@borrows
def test_puts_check_borrowed_rows_a_constant_number_of_times_each(tmp_path):
    """Each put checks what borrowed groups keep alive of their inputs, but
    not every group on every put: with many input partitions that cost grew
    with the square of their number (a second of the event loop per worker
    at 1,000 partitions).  Checks per put stay bounded, and an input let go
    of is still charged and spilled by the puts that follow."""

    class CountingBackend(PandasBackend):
        checks = 0

        def unshared_bytes(self, table):
            CountingBackend.checks += 1
            return super().unshared_bytes(table)

    backend = CountingBackend()
    memory = make_memory(host=256 << 10)
    store = store_for(backend, memory, tmp_path)
    n = 300
    # Large enough pieces to be borrowed (_BORROW_MIN_PIECE_ROWS).
    held = [_input_frame(2048, seed=s) for s in range(n)]
    for i, frame in enumerate(held):
        asyncio.run(store.put(_borrowed_shard(frame.copy(deep=False), 4, input_partition=i)))
    # Quadratic: n * (n + 1) / 2 = 45,150 checks; one per put for the shard
    # itself plus at most about _RECHARGE_PER_PUT per put for the others.
    assert CountingBackend.checks <= n * 40
    assert memory.moves.get(("host", "disk")) is None  # every input still held

    expected = {p: pd.concat([f[f.pid == p].drop(columns="pid") for f in held]) for p in range(4)}
    held.clear()  # the caller lets go: the borrowed rows alone keep the inputs
    for i in range(n, n + 20):
        extra = _input_frame(2048, seed=i)
        asyncio.run(store.put(_borrowed_shard(extra, 4, input_partition=i)))
        for p in range(4):
            expected[p] = pd.concat([expected[p], extra[extra.pid == p].drop(columns="pid")])
    assert memory.moves[("host", "disk")].bytes > 256 << 10
    assert memory.host.bytes <= 256 << 10
    _assert_reads_back(store, backend, memory, expected)


_KEEP_ROWS = 4096  # gpushuffle.backends.pandas_columns._KEEP_CHUNK_ROWS


def _string_shard(backend, input_partition: int, sizes: list[int]) -> Shard:
    """A pandas shard of Arrow strings (about 100 bytes a row) with ``sizes``
    rows for output partitions 0, 1, ..."""
    rows = sum(sizes)
    rng = np.random.default_rng(input_partition)
    frame = pd.DataFrame(
        {
            "s": pd.array(
                [f"{input_partition:04d}-{i:08d}-" + "x" * 84 for i in range(rows)],
                dtype=pd.ArrowDtype(pa.string()),
            ),
            "v": rng.random(rows),
            "_partitions": np.repeat(np.arange(len(sizes), dtype=np.int16), sizes),
        }
    )
    table, offsets = backend.split(
        frame, "_partitions", np.arange(len(sizes), dtype=np.int16), len(sizes), False
    )
    return Shard(
        "pandas", input_partition, np.arange(len(sizes)), offsets, table, backend.nbytes(table)
    )


def test_strings_read_back_from_disk_are_held_once_and_counted_per_piece(tmp_path):
    """An output's large string pieces read back from its spill file are
    copied as they are added (while their pages are there) and kept as the
    output's chunks: the assembly holds them once, plus about a piece.  The
    fit rule counts as joined at the end only pieces under keep_rows rows."""
    backend = PandasBackend()
    big, small = _KEEP_ROWS + 1000, 500
    memory = make_memory(host=0)  # everything goes to disk
    store = store_for(backend, memory, tmp_path)

    async def fill():
        for i in range(4):  # output 0 gets large pieces, output 1 small ones
            await store.put(_string_shard(backend, i, [big, small]))

    asyncio.run(fill())
    assert memory.disk.bytes > 0 and memory.host.bytes == 0
    sizes = store.partition_sizes()
    # Large pieces are kept, not joined at the end: the fit rule counts only
    # the small pieces' strings twice.  Unless the output's chunks would be
    # combined when distributed pickles it (PandasBackend.kept_nbytes says
    # why): then every piece's strings count twice.
    assert backend.keep_rows == _KEEP_ROWS
    assert sizes[0].concat_bytes == 0
    assert sizes[1].concat_bytes == pytest.approx(sizes[1].nbytes - small * 4 * 8, rel=0.05)
    with dask.config.set({"gpushuffle.memory.pickle-without-copy": False}):
        store_off = store_for(backend, make_memory(host=None), tmp_path / "off")
        asyncio.run(store_off.put(_string_shard(backend, 9, [big, small])))
    counted = store_off.partition_sizes()
    string_bytes_big = counted[0].nbytes - big * 8  # all but the float column
    assert counted[0].concat_bytes == pytest.approx(string_bytes_big, rel=0.05)
    store_off.close()

    meta = pd.DataFrame({"s": pd.array([], dtype=pd.ArrowDtype(pa.string())), "v": []})
    nrows, tables = store.read(0)
    before = pa.total_allocated_bytes()
    out = backend.assemble(tables, nrows, meta, keep_index=False)
    grown = pa.total_allocated_bytes() - before
    chunks = out["s"].array._pa_array.chunks
    assert [len(c) for c in chunks] == [big] * 4  # each piece kept as its chunk
    # One copy of the strings in Arrow's memory: no second, combined copy.
    assert grown <= 1.1 * out["s"].array.nbytes
    expected = [f"{i:04d}-{j:08d}-" + "x" * 84 for i in range(4) for j in range(big)]
    assert out["s"].tolist() == expected
    store.close()


def _received_shard(backend, frame: pd.DataFrame, nparts: int, input_partition: int):
    """``frame`` split ``nparts`` ways (by its ``_partitions`` column), then
    serialized and rebuilt from one buffer, as a TCP comm receives it: every
    piece is a view of that buffer.  Returns the shard and the buffer."""
    table, offsets = backend.split(
        frame, "_partitions", np.arange(nparts, dtype=np.int16), nparts, True
    )
    header, frames = backend.serialize(table)
    sizes = [memoryview(f).nbytes for f in frames]
    received = np.empty(sum(sizes), np.uint8)
    views, start = [], 0
    for f, size in zip(frames, sizes, strict=True):
        received[start : start + size] = np.frombuffer(memoryview(f).cast("B"), np.uint8)
        views.append(memoryview(received[start : start + size]))
        start += size
    rebuilt = backend.deserialize(header, views)
    shard = Shard(
        "pandas", input_partition, np.arange(nparts), offsets, rebuilt, backend.nbytes(rebuilt)
    )
    return shard, received


def _mixed_input(rows: int, nparts: int, seed: int, index: str = "float") -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    values = rng.random(rows)
    return pd.DataFrame(
        {
            "i": rng.integers(0, 1 << 40, rows),
            "s": pd.array(
                [f"{seed}-{v:09d}" + "y" * 30 for v in rng.integers(0, 10**9, rows)],
                dtype=pd.ArrowDtype(pa.string()),
            ),
            "c": pd.Categorical.from_codes(rng.integers(0, 3, rows), ["a", "b", "c"]),
            "t": pd.date_range("2026-01-01", periods=rows, freq="s", tz="UTC"),
            "o": np.array([f"o{v}" for v in rng.integers(0, 100, rows)], dtype=object),
            "n": pd.arrays.IntegerArray(rng.integers(0, 99, rows), rng.random(rows) < 0.1),
            "a": pd.arrays.ArrowExtensionArray(
                pa.array(rng.integers(0, 99, rows), mask=rng.random(rows) < 0.1)
            ),
            "b": pd.array(rng.random(rows) < 0.5, dtype="boolean"),
            **{f"f{i}": rng.random(rows) for i in range(6)},
            "_partitions": rng.integers(0, nparts, rows).astype(np.int16),
        },
        # Under pandas 3 a string index is Arrow-backed: views, as the columns.
        index=pd.Index(values.astype(str) if index == "str" else values, name="idx"),
    )


def _unpack_all(
    tmp_path,
    keep_outputs: bool,
    index: str = "float",
    backend=None,
    nparts: int = 16,
    rows: int = 200_000,
):
    """Three received shards of mixed columns, unpacked into ``nparts``
    outputs in order: the store's charge and how many shard buffers are
    alive after each, checked against pandas."""
    import gc
    import weakref

    from gpushuffle.engine.pool import host_pool

    # Outputs of other tests in this process would count as held ones.
    gc.collect()
    assert host_pool().in_use("unpack") == 0
    backend = backend or PandasBackend()
    memory = make_memory(host=None)
    store = store_for(backend, memory, tmp_path)
    inputs = [_mixed_input(rows, nparts, seed, index) for seed in range(3)]
    buffers = []

    async def fill():
        for i, frame in enumerate(inputs):
            shard, received = _received_shard(backend, frame, nparts, i)
            assert shard.nbytes >= 4 << 20  # large enough to compact
            buffers.append(weakref.ref(received))
            del received
            await store.put(shard)

    asyncio.run(fill())
    total = memory.host.bytes
    meta = inputs[0].drop(columns="_partitions").iloc[:0]
    held, outputs = [], []
    store.start_unpack()
    for p in range(nparts):
        nrows, tables = store.read(p)
        out = backend.assemble(tables, nrows, meta, keep_index=True)
        del tables
        gc.collect()
        expected = pd.concat([f[f["_partitions"] == p].drop(columns="_partitions") for f in inputs])
        # Row for row, index included (assert_frame_equal took 0.8 s each).
        assert out.equals(expected) and list(out.dtypes) == list(expected.dtypes)
        if keep_outputs:
            outputs.append(out)
        del out
        held.append((memory.host.bytes, sum(b() is not None for b in buffers)))
    statistics = store.statistics
    store.close()
    assert_nothing_charged(memory)
    return total, held, statistics


@pytest.mark.parametrize("index", ["float", "str"])
def test_the_store_lets_go_of_a_shard_once_half_of_it_was_read(tmp_path, index):
    """A received shard holds rows for every output partition: once unpacks
    have read half of its bytes, and the outputs built are kept (a persisted
    frame), the rest is copied together and the shard's receive buffer goes,
    so the store shrinks as outputs are built instead of holding everything
    until the last one.  Every output still has exactly its rows."""
    total, held, statistics = _unpack_all(tmp_path, keep_outputs=True, index=index)
    charged = [c for c, _ in held]
    # Before half of their bytes were read, every shard was held whole.
    assert held[:8] == [(total, 3)] * 8
    # Once outputs held add up to several (gpushuffle.engine.store's
    # _COMPACT_HELD_OUTPUTS), no shard is: what was left of them lives in
    # copies of its own, and the store shrinks with every output after.
    first = next(i for i, (_, alive) in enumerate(held) if alive < 3)
    assert first <= 11 and all(alive == 0 for _, alive in held[first:])
    assert charged[first] < 0.5 * total
    assert charged[first:] == sorted(charged[first:], reverse=True) and charged[-1] == 0
    assert charged[-2] < 0.15 * total
    # Copies of at most about what the store held.
    assert statistics.compactions >= 3 and statistics.bytes_compacted <= total


def test_outputs_consumed_as_they_are_built_leave_the_shards_as_they_are(tmp_path):
    """Without outputs held, copying half the store would only add pages
    (the peak comes early in the unpack then): the shards stay whole until
    their last rows are read."""
    total, held, statistics = _unpack_all(tmp_path / "consumed", keep_outputs=False)
    assert held[:-1] == [(total, 3)] * 15 and held[-1] == (0, 0)
    assert statistics.compactions == 0


class _InterruptedCopies(PandasBackend):
    """The pandas backend, with something done to the store while it copies."""

    def __init__(self, meanwhile):
        self.meanwhile = meanwhile
        self.store = None

    def compacted(self, tables):
        self.meanwhile(self.store)
        return super().compacted(tables)


def _unpack_with_copies_interrupted(tmp_path, monkeypatch, meanwhile):
    import gpushuffle.engine.store as store_module

    # Every half-read shard is copied, held outputs or not.
    monkeypatch.setattr(store_module, "_COMPACT_HELD_OUTPUTS", -2)
    backend = _InterruptedCopies(meanwhile)
    original = store_module.ShardStore.__init__

    def remember(self, *args, **kwargs):
        original(self, *args, **kwargs)
        backend.store = self

    monkeypatch.setattr(store_module.ShardStore, "__init__", remember)
    return _unpack_all(tmp_path, keep_outputs=False, backend=backend, nparts=8, rows=60_000)


def test_a_copy_that_fails_leaves_the_shard_whole_and_every_row(tmp_path, monkeypatch, caplog):
    def fail(store):
        raise ValueError("no copy")

    total, held, statistics = _unpack_with_copies_interrupted(tmp_path, monkeypatch, fail)
    # Asked once (logged), then not again: the shards stay whole to the end.
    assert "could not copy half-read shards together" in caplog.text
    assert held[:-1] == [(total, 3)] * 7 and statistics.compactions == 0


def test_pieces_moved_to_disk_while_they_are_copied_keep_their_rows(tmp_path, monkeypatch):
    def shed(store):
        asyncio.run(store.shed_host())

    _total, _held, statistics = _unpack_with_copies_interrupted(tmp_path, monkeypatch, shed)
    # Moved to disk first: the copies went; rows read back from the files.
    assert statistics.bytes_spilled > 0 and statistics.compactions == 0


def test_a_store_closed_while_it_copies_charges_nothing_after(tmp_path, monkeypatch):
    stores = []

    def close(store):
        stores.append(store)
        store.close()

    with pytest.raises(ShuffleClosedError):
        _unpack_with_copies_interrupted(tmp_path, monkeypatch, close)
    # The copy finished after the close: nothing charged for it, nothing
    # released twice.
    assert_nothing_charged(stores[0]._memory)
    assert stores[0].statistics.compactions == 0


def test_kept_outputs_with_a_string_index_hold_no_received_buffer(tmp_path, monkeypatch):
    """An Arrow-backed index (strings, under pandas 3) appended as it came
    would be views of every message an output's rows came in, keeping each
    whole (numeric columns too) for as long as the output: it is copied."""
    import gpushuffle.engine.store as store_module

    monkeypatch.setattr(store_module, "_COMPACT_MIN_BYTES", 1 << 60)  # no copies of shards
    _, held, statistics = _unpack_all(
        tmp_path, keep_outputs=True, index="str", nparts=8, rows=60_000
    )
    assert statistics.compactions == 0 and held[-1] == (0, 0)


def test_spilled_pieces_pickle_each_dtype_once_per_store_and_read_back_exactly(tmp_path):
    """Every received shard unpickles dtype objects of its own; spilled
    pieces refer to them by number in the store's memo, which holds one of
    each dtype (not one per shard, nor per piece), and every output reads
    back row for row, dtypes included (categories in their order)."""
    backend = PandasBackend()
    memory = make_memory(host=1)  # every shard goes to disk
    store = store_for(backend, memory, tmp_path)
    nparts = 8
    inputs = [_mixed_input(2_000, nparts, seed) for seed in range(4)]
    # The last input's categories in another order: an unordered dtype that
    # compares equal to the others', whose codes mean other values.
    inputs[-1]["c"] = inputs[-1]["c"].cat.reorder_categories(["c", "b", "a"])

    memo_sizes = []

    async def fill():
        for i, frame in enumerate(inputs):
            shard, _ = _received_shard(backend, frame, nparts, i)
            await store.put(shard)
            memo_sizes.append(len(store._spill_memo))

    asyncio.run(fill())
    assert memory.host.bytes == 0 and memory.disk.bytes > 0
    meta = inputs[0].drop(columns="_partitions").iloc[:0]
    # Shards of the same dtypes add nothing (keyed by identity, each shard
    # would add its own); the reordered categories are one more.
    first = memo_sizes[0]
    assert first >= len({str(d) for d in meta.dtypes}) and memo_sizes == [first] * 3 + [first + 1]
    store.start_unpack()
    for p in range(nparts):
        _, tables = store.read(p)
        pieces = [pd.DataFrame(dict(zip(meta.columns, t.columns, strict=True))) for t in tables]
        codes = [piece["c"].cat.categories.tolist() for piece in pieces]
        assert codes == [["a", "b", "c"]] * 3 + [["c", "b", "a"]]
        for piece, frame in zip(pieces, inputs, strict=True):
            expected = frame[frame["_partitions"] == p].drop(columns="_partitions")
            piece.index = expected.index
            assert piece.equals(expected) and list(piece.dtypes) == list(expected.dtypes)
    store.close()
    assert_nothing_charged(memory)


def test_a_pickle_made_with_a_memo_names_what_reads_it():
    from gpushuffle.backends import arrow

    memo = arrow.PickleMemo()
    values = pd.Categorical(["x", "y"])
    buffers: list[pickle.PickleBuffer] = []
    payload = arrow.dumps(values, buffers.append, memo=memo)
    assert len(memo) == 2  # the categorical's dtype, its codes' numpy dtype
    with pytest.raises(pickle.UnpicklingError, match="memo of dtypes"):
        pickle.loads(payload, buffers=buffers)
    assert arrow.loads(payload, buffers, memo).equals(values)
    # A dtype too large to keep (many categories of its own) is pickled
    # with the piece, as without a memo.
    many = pd.Categorical([f"category-{i:06d}" for i in range(20_000)])
    buffers.clear()
    payload = arrow.dumps(many, buffers.append, memo=memo)
    assert len(pickle.dumps(many.dtype)) > arrow.PickleMemo.MAX_OBJECT_BYTES
    kept = [memo[i] for i in range(len(memo))]
    assert not any(isinstance(d, pd.CategoricalDtype) and len(d.categories) > 2 for d in kept)
    assert arrow.loads(payload, buffers, memo).equals(many)


def test_spill_writes_survive_partial_writes(tmp_path, monkeypatch):
    """A ``writev`` may write less than asked (a signal, a nearly full disk);
    the rest is written after, in order.  The partial writes are simulated:
    a regular file on this machine does not make them on demand."""
    import gpushuffle.engine.store as store_module

    real_writev = os.writev
    calls = []

    def short_writev(fd, buffers):
        calls.append(len(buffers))
        chunk = b"".join(bytes(b) for b in buffers)[:777]  # at most 777 bytes a call
        return real_writev(fd, [chunk])

    monkeypatch.setattr(store_module.os, "writev", short_writev)
    frames = [b"head", np.arange(1000, dtype=np.int64), b"", memoryview(b"x" * 3000)]
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        store_module._write_all(fd, frames)
    finally:
        os.close(fd)
    expected = b"".join(bytes(memoryview(f).cast("B")) for f in frames)
    assert path.read_bytes() == expected
    assert len(calls) == -(-len(expected) // 777)


def test_spilled_shards_let_go_of_their_received_buffers(tmp_path):
    """A received categorical's categories are views of the message it came
    in: the memo of spilled pieces' dtypes must not keep them (it would hold
    every spilled shard's buffer while charging nothing for it)."""
    import gc
    import weakref

    backend = PandasBackend()
    memory = make_memory(host=1)  # every shard goes to disk
    store = store_for(backend, memory, tmp_path)
    nparts = 4
    buffers = []

    async def fill():
        for seed in range(4):
            frame = _mixed_input(2_000, nparts, seed)
            # Categories of their own per shard (unknown categories), integers
            # under numeric ones: views of the message too.
            frame["k"] = pd.Categorical(frame["i"] % 7 + 10 * seed)
            shard, received = _received_shard(backend, frame, nparts, seed)
            buffers.append(weakref.ref(received))
            del received
            await store.put(shard)
            del shard

    asyncio.run(fill())
    gc.collect()
    assert memory.host.bytes == 0
    assert [b() is not None for b in buffers] == [False] * 4
    store.close()


def test_a_pandas_backend_with_its_own_serialization_gets_no_memo():
    """A subclass that serializes its own way may not take the memo (or
    read back what was written with it): the store spills its tables as
    before."""

    class OwnWay(PandasBackend):
        def serialize(self, table, *, device_frames=False):
            return super().serialize(table, device_frames=device_frames)

    assert PandasBackend().new_memo() is not None
    assert OwnWay().new_memo() is None
