"""The pandas backend on its own: split, wire round trip, concat, against pandas."""

from __future__ import annotations

import copy
import decimal
import gc
import itertools
from typing import Any

import dask
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pandas_versions import ARROW_STR_REASON, PANDAS_3, borrows
from truth import checksum

from gpushuffle.backends import backend_for, backend_named
from gpushuffle.backends.pandas import PandasBackend, PandasTable
from gpushuffle.engine.pool import HostBufferPool
from gpushuffle.errors import ShuffleInputError
from gpushuffle.transport import Shard


def frame_with_partitions(n: int, nparts: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame(
        {
            "a": rng.integers(0, 100, n),
            "b": rng.random(n),
            "s": pd.array([f"v{i}" for i in range(n)], dtype="string[pyarrow]"),
            "c": pd.Categorical(rng.choice(["p", "q"], n)),
            "n": pd.array(np.where(rng.random(n) < 0.3, None, rng.integers(0, 9, n)), "Int64"),
        },
        index=pd.Index(rng.permutation(n) * 7, name="ix"),
    )
    df["_partitions"] = rng.integers(0, nparts, n).astype(np.int16)
    return df


def split_and_concat(df: pd.DataFrame, nparts: int, keep_index: bool = True):
    backend = PandasBackend()
    rank = np.arange(nparts, dtype=np.int16)
    table, offsets = backend.split(df, "_partitions", rank, nparts, keep_index)
    meta = df.iloc[:0].drop(columns="_partitions")
    if not keep_index:
        meta = meta.reset_index(drop=True)
    outs = []
    for p in range(nparts):
        piece = backend.slice(table, int(offsets[p]), int(offsets[p + 1]))
        outs.append(backend.concat([piece], meta, keep_index) if len(piece) else None)
    return outs, offsets


def test_split_groups_rows_by_partition_in_input_order():
    df = frame_with_partitions(1000, 7)
    outs, offsets = split_and_concat(df, 7)
    assert offsets[-1] == len(df)
    for p, out in enumerate(outs):
        expected = df[df["_partitions"] == p].drop(columns="_partitions")
        pd.testing.assert_frame_equal(out, expected)


def test_unwanted_partitions_are_dropped():
    df = frame_with_partitions(500, 5)
    backend = PandasBackend()
    rank = np.array([0, 2, 1, 2, 2], dtype=np.int16)  # only partitions 0 and 2 wanted
    table, offsets = backend.split(df, "_partitions", rank, 2, True)
    assert len(offsets) == 3
    assert len(table) == (df["_partitions"].isin([0, 2])).sum()
    first = backend.slice(table, 0, int(offsets[1]))
    assert pd.Index(first.index).equals(df.index[df["_partitions"] == 0])
    second = backend.slice(table, int(offsets[1]), int(offsets[2]))
    assert pd.Index(second.index).equals(df.index[df["_partitions"] == 2])


def test_slices_of_numeric_columns_and_a_plain_index_are_not_tracked_by_gc():
    # With many output partitions a store holds tens of thousands of slices;
    # each object the garbage collector tracks is walked on every full
    # collection.  A plain index is kept as numpy values (no pd.Index per
    # slice, nor the weak reference pandas keeps of every view of an index).
    rng = np.random.default_rng(0)
    n = 2_000
    df = pd.DataFrame(
        {"a": rng.integers(0, 9, n), "b": rng.random(n)},
        index=pd.Index(rng.permutation(n), name="ix"),
    )
    df["_partitions"] = rng.integers(0, 50, n).astype(np.int16)
    backend = PandasBackend()
    table, offsets = backend.split(df, "_partitions", np.arange(50, dtype=np.int16), 50, True)
    pieces = [backend.slice(table, int(a), int(b)) for a, b in itertools.pairwise(offsets)]
    gc.collect()
    assert all(isinstance(p.index, np.ndarray) for p in pieces)
    assert not any(gc.is_tracked(p.columns) for p in pieces)
    meta = df.iloc[:0].drop(columns="_partitions")
    out = backend.concat(pieces[3:4], meta, True)
    pd.testing.assert_frame_equal(out, df[df["_partitions"] == 3].drop(columns="_partitions"))


def test_wire_round_trip_is_zero_copy_and_exact():
    df = frame_with_partitions(300_000, 4)
    backend = PandasBackend()
    table, offsets = backend.split(df, "_partitions", np.arange(4, dtype=np.int16), 4, True)
    view = backend.slice(table, int(offsets[1]), int(offsets[3]))
    header, frames = backend.serialize(view)
    # Numeric columns and the index travel out of band, as views of the table.
    b_column = table.columns[1]
    assert any(
        np.shares_memory(np.frombuffer(f, dtype=np.uint8), b_column.view(np.uint8))
        for f in frames[1:]
    )
    back = backend_named("pandas").deserialize(header, [memoryview(f) for f in frames])
    meta = df.iloc[:0].drop(columns="_partitions")
    pd.testing.assert_frame_equal(
        backend.concat([back], meta, True), backend.concat([view], meta, True)
    )


def _arrow_column(kind: str, n: int) -> pd.api.extensions.ExtensionArray:
    import decimal

    import pyarrow as pa

    rng = np.random.default_rng(3)
    missing = rng.random(n) < 0.2
    if kind == "str":
        if not PANDAS_3:
            pytest.skip(ARROW_STR_REASON)
        words = [f"w{i}" * (i % 4) for i in range(n)]
        return pd.array(
            [None if m else w for m, w in zip(missing, words, strict=True)], dtype="str"
        )
    if kind == "string[pyarrow]":
        return pd.array([None if m else f"é{i}" for i, m in enumerate(missing)], dtype=kind)
    types = {
        "string": pa.string(),
        "decimal": pa.decimal128(12, 2),
        "timestamp": pa.timestamp("us", tz="UTC"),
        "bool": pa.bool_(),
        "list": pa.list_(pa.int64()),
    }
    values = {
        "string": lambda i: f"s{i}",
        "decimal": lambda i: decimal.Decimal(i) / 100,
        "timestamp": lambda i: pd.Timestamp(i * 10**9, tz="UTC"),
        "bool": lambda i: bool(i % 3),
        "list": lambda i: [i] * (i % 3),
    }[kind]
    return pd.array(
        [None if m else values(i) for i, m in enumerate(missing)], dtype=pd.ArrowDtype(types[kind])
    )


@pytest.mark.parametrize(
    "kind", ["str", "string[pyarrow]", "string", "decimal", "timestamp", "bool", "list"]
)
@pytest.mark.parametrize("writable", [True, False])
def test_arrow_columns_travel_as_views_cut_to_their_rows(kind, writable):
    """pandas pickles Arrow arrays through combine_chunks() (a copy of every
    byte), and pyarrow pickles a slice with its parent's whole buffers; the
    backend sends each buffer as a view of the table, cut to the slice."""
    import pyarrow as pa

    from gpushuffle.backends.arrow import _cuttable

    column = _arrow_column(kind, 20_000)
    backend = PandasBackend()
    for start, stop in [(0, 20_000), (13, 19_001), (8, 16), (5, 5), (4_003, 11_007)]:
        view = PandasTable([column[start:stop]], None)
        header, frames = backend.serialize(view)
        received = [bytearray(f) if writable else bytes(f) for f in frames]
        back = backend.deserialize(header, received).columns[0]
        assert back.dtype == column.dtype
        pd.testing.assert_extension_array_equal(back, column[start:stop])
        chunk = column[start:stop]._pa_array.combine_chunks()
        if not _cuttable(chunk.type) or stop == start:
            continue
        # Out of band: views of the column's own buffers, only the slice's
        # rows; a cut that starts mid-data sends its offsets rebased (a copy
        # of the offsets alone).
        owned = [b for b in column._pa_array.chunks[0].buffers() if b is not None]
        copied = [
            memoryview(f).nbytes
            for f in frames[1:]
            if not any(
                b.address <= np.frombuffer(f, np.uint8).ctypes.data < b.address + b.size
                for b in owned
            )
        ]
        assert len(copied) <= 1 and sum(copied) <= 8 * (stop - start + 8), (kind, copied)
        sent = sum(memoryview(f).nbytes for f in frames[1:])
        own = pa.concat_arrays([chunk]).nbytes  # the slice's bytes, compacted
        # (a cut starts at the byte holding its first validity bit: up to 7 more rows)
        assert sent <= own + 7 * 16 + 2, (kind, start, stop, sent, own)
        assert len(frames[0]) < 1000  # in band: metadata only


@pytest.mark.parametrize(
    "kind", ["str", "string[pyarrow]", "string", "decimal", "timestamp", "bool", "list"]
)
def test_arrow_take_matches_pandas_take(kind):
    from gpushuffle.backends import arrow

    column = _arrow_column(kind, 5_000)
    sliced = column[100:4_000]  # a view: the take must honour its offset
    rows = np.random.default_rng(1).permutation(len(sliced))[:2_500]
    got = arrow.take(sliced, arrow.Positions(rows))
    assert type(got) is type(sliced) and got.dtype == sliced.dtype
    pd.testing.assert_extension_array_equal(got, sliced.take(rows))
    assert arrow.take(sliced, arrow.Positions(rows[:0])).dtype == sliced.dtype


def _chunked(values: pd.api.extensions.ExtensionArray, bounds: list[int]) -> Any:
    """``values`` (one chunk) as chunks cut at ``bounds``, views with offsets."""
    import pyarrow as pa

    array = values._pa_array.combine_chunks()
    cuts = [0, *bounds, len(array)]
    chunks = [array.slice(a, b - a) for a, b in itertools.pairwise(cuts)]
    return type(values)(pa.chunked_array(chunks, array.type))


@pytest.mark.parametrize("kind", ["str", "decimal", "bool", "list"])
@pytest.mark.parametrize("order", ["ascending", "output-groups", "shuffled"])
def test_arrow_take_of_a_chunked_column_matches_pandas_take(kind, order):
    """Rows ascending (a borrowed piece), ascending within groups (a split),
    or in any order, over chunks of any length, empty ones among them."""
    from gpushuffle.backends import arrow

    column = _chunked(_arrow_column(kind, 6_000), [1_000, 1_000, 2_500, 5_999])
    assert column._pa_array.num_chunks == 5
    rng = np.random.default_rng(2)
    rows = np.sort(rng.choice(len(column), 2_000, replace=False))
    if order == "output-groups":
        rows = rows[np.argsort(rng.integers(0, 4, len(rows)), kind="stable")]
    elif order == "shuffled":
        rows = rng.permutation(rows)
    positions = arrow.Positions(rows)
    got = arrow.take(column, positions)
    assert type(got) is type(column) and got.dtype == column.dtype
    assert got._pa_array.num_chunks == 1
    pd.testing.assert_extension_array_equal(got, column.take(rows))
    # Positions are shared by the columns of a piece: the same answer again.
    pd.testing.assert_extension_array_equal(arrow.take(column, positions), column.take(rows))
    assert len(arrow.take(column, arrow.Positions(rows[:0]))) == 0


def _arrow_peak_bytes(f: Any) -> int:
    """The most memory Arrow held at once for ``f()`` (its result freed)."""
    import pyarrow as pa

    default = pa.default_memory_pool()
    counted = pa.proxy_memory_pool(default)
    pa.set_memory_pool(counted)
    try:
        del_me = f()
        del del_me  # freed while the counting pool is still the default
    finally:
        pa.set_memory_pool(default)
    return counted.max_memory()


def test_taking_a_few_ascending_rows_of_a_chunked_column_copies_only_those_rows():
    """pyarrow's take of a ChunkedArray concatenates every chunk first: for
    each output partition a worker takes from its inputs, the whole column.
    Rows that visit the chunks in order are taken chunk by chunk instead."""
    from gpushuffle.backends import arrow

    words = pd.array([f"word-{i:08d}" for i in range(400_000)], dtype="string[pyarrow]")
    column = _chunked(words, list(range(40_000, 400_000, 40_000)))
    rows = np.sort(np.random.default_rng(0).choice(len(column), 1_000, replace=False))
    expected = column.take(rows)
    whole = column._pa_array.nbytes
    peak = _arrow_peak_bytes(lambda: arrow.take(column, arrow.Positions(rows)))
    assert peak < whole / 50
    pd.testing.assert_extension_array_equal(arrow.take(column, arrow.Positions(rows)), expected)
    # Rows that go back and forth between the chunks (more runs than chunks)
    # take pyarrow's way; the answer is the same.
    mixed = np.random.default_rng(1).permutation(rows)
    assert arrow.Positions(mixed).runs(tuple(len(c) for c in column._pa_array.chunks)) is None
    pd.testing.assert_extension_array_equal(
        arrow.take(column, arrow.Positions(mixed)), column.take(mixed)
    )


def test_datetime_columns_travel_out_of_band():
    """numpy pickles datetime64/timedelta64 in band (a copy each way)."""
    n = 50_000
    stamps = pd.date_range("2001-01-01", periods=n, freq="min")
    columns = [
        stamps.array,
        stamps.tz_localize("Europe/Berlin").array,
        (stamps - stamps[0]).array,
        stamps.to_numpy(),
    ]
    index = pd.Index(stamps.to_numpy(), name="when")
    table = PandasTable([c[7 : n - 3] for c in columns], index[7 : n - 3])
    backend = PandasBackend()
    header, frames = backend.serialize(table)
    assert len(frames[0]) < 4000
    assert sum(memoryview(f).nbytes for f in frames[1:]) == 5 * 8 * (n - 10)
    back = backend.deserialize(header, [bytes(f) for f in frames])
    for got, expected in zip(back.columns, table.columns, strict=True):
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    pd.testing.assert_index_equal(back.index, table.index)


_COLLECT_FRAMES_IN_CYCLES = """
import gc
import pandas as pd
from gpushuffle.backends.pandas import PandasBackend, PandasTable

stamps = pd.date_range("2001-01-01", periods=5_000, freq="min").to_numpy()
strings = pd.array([None if i % 7 == 0 else f"s{i}" for i in range(5_000)], dtype="string[pyarrow]")


class Cycle:
    pass


for _ in range(20):
    _, frames = PandasBackend().serialize(PandasTable([strings[13:4_001], stamps[7:4_000]], None))
    cycle = Cycle()
    cycle.me, cycle.frames = cycle, frames
    del frames, cycle
    gc.collect()
"""


def _no_core_dump() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def test_frames_held_by_a_reference_cycle_are_collected_safely():
    """A shard's frames held in a reference cycle (an exception's traceback
    keeps them, say) are freed by the garbage collector without crashing.

    A frame made from a PickleBuffer of a memoryview crashed the process
    there (SIGSEGV, cpython#77894, fixed only in 3.12.7): a CI run died of
    it when a worker left mid-shuffle.  Every frame's exporter must be an
    Arrow buffer or a numpy array.
    """
    import subprocess
    import sys

    strings = _arrow_column("string[pyarrow]", 5_000)
    stamps = pd.date_range("2001-01-01", periods=5_000, freq="min").to_numpy()
    _, frames = PandasBackend().serialize(PandasTable([strings[13:4_001], stamps[7:4_000]], None))
    exporters = [type(memoryview(f).obj).__name__ for f in frames[1:]]
    assert "memoryview" not in exporters, exporters
    proc = subprocess.run(
        [sys.executable, "-c", _COLLECT_FRAMES_IN_CYCLES],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_no_core_dump,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])


def test_datetimes_nested_in_object_columns_keep_their_shape():
    from gpushuffle.backends import arrow

    cell = np.arange(6).astype("M8[s]").reshape(2, 3)
    column = np.empty(2, object)
    column[0], column[1] = cell, np.datetime64("2001-01-01", "ns")
    buffers: list = []
    payload = arrow.dumps(([column], None), buffers.append)
    (back,), _ = __import__("pickle").loads(payload, buffers=[b.raw() for b in buffers])
    assert back[0].shape == (2, 3) and (back[0] == cell).all()
    assert back[1] == column[1]


def test_shard_serializes_through_distributed():
    from distributed.protocol import deserialize, serialize

    df = frame_with_partitions(1000, 3)
    backend = PandasBackend()
    table, offsets = backend.split(df, "_partitions", np.arange(3, dtype=np.int16), 3, True)
    shard = Shard("pandas", 5, np.arange(3), offsets, table, backend.nbytes(table))
    header, frames = serialize(shard, serializers=("dask",))
    assert header["serializer"] == "dask"
    back = deserialize(header, frames)
    assert back.input_partition == 5
    assert back.offsets.tolist() == offsets.tolist()
    meta = df.iloc[:0].drop(columns="_partitions")
    pd.testing.assert_frame_equal(
        backend.concat([back.table], meta, True), backend.concat([table], meta, True)
    )


def test_string_columns_come_out_in_one_chunk():
    """Pieces concatenated chunk by chunk would slow every later use of the output."""
    backend = PandasBackend()
    df = frame_with_partitions(3000, 1)
    pieces = []
    for i in range(30):
        part = df.iloc[i * 100 : (i + 1) * 100]
        table, _ = backend.split(part, "_partitions", np.zeros(1, np.int16), 1, True)
        pieces.append(table)
    meta = df.iloc[:0].drop(columns="_partitions")
    out = backend.concat(pieces, meta, True)
    assert out["s"].array._pa_array.num_chunks == 1
    pd.testing.assert_frame_equal(out, df.drop(columns="_partitions"))


def test_concat_casts_to_meta_without_losing_values():
    backend = PandasBackend()
    meta = pd.DataFrame(
        {"c": pd.Categorical([], categories=["x", "y", "z"]), "i": pd.array([], "Int64")}
    )
    a = pd.DataFrame({"c": pd.Categorical(["x"]), "i": np.array([1])})
    b = pd.DataFrame({"c": pd.Categorical(["z", "y"]), "i": np.array([2, 3])})
    tables = []
    for part in (a, b):
        part = part.assign(_partitions=np.int8(0))
        t, _ = backend.split(part, "_partitions", np.zeros(1, np.int16), 1, False)
        tables.append(t)
    out = backend.concat(tables, meta, keep_index=False)
    assert out["c"].dtype == meta["c"].dtype
    assert out["c"].tolist() == ["x", "z", "y"]
    assert out["i"].dtype == "Int64"
    assert out["i"].tolist() == [1, 2, 3]


def test_many_small_pieces_are_copied_in_batches_and_cast_to_meta():
    """Hundreds of one- to three-row pieces (many partitions): batched copies
    (more than one batch), pieces of narrower dtypes cast, and a piece that
    cannot be cast safely (float into an int column of loose meta) making
    that column concatenate instead, into the type both fit (float64, as
    p2p gives: a cast back to meta's int64 would lose NaN)."""
    backend = PandasBackend()
    meta = pd.DataFrame({"i": np.array([], np.int64), "f": np.array([], np.float64)})
    meta.index = pd.Index(np.array([], np.int64), name="ix")
    parts, expected = [], []
    for k in range(600):
        n = 1 + k % 3
        i = np.arange(n, dtype=np.int32 if k % 2 else np.int64) + k
        if k == 450:
            i = i.astype(np.float64)  # no safe cast to int64
        part = pd.DataFrame(
            {"i": i, "f": np.full(n, k, np.float32)},
            index=pd.Index(np.arange(n, dtype=np.int64) + 10 * k, name="ix"),
        )
        expected.append(part)
        table, _ = backend.split(
            part.assign(_partitions=np.int8(0)), "_partitions", np.zeros(1, np.int16), 1, True
        )
        parts.append(table)
    nrows = sum(len(p) for p in expected)
    out = backend.assemble(iter(parts), nrows, meta, keep_index=True)
    truth = pd.concat(expected)
    assert len(out) == nrows and out.index.name == "ix"
    np.testing.assert_array_equal(out.index.to_numpy(), truth.index.to_numpy())
    assert out["i"].dtype == np.float64 and out["f"].dtype == np.float64
    np.testing.assert_array_equal(out["i"].to_numpy(), truth["i"].to_numpy(np.float64))
    np.testing.assert_array_equal(out["f"].to_numpy(), truth["f"].to_numpy(np.float64))


def test_categories_outside_meta_are_kept():
    backend = PandasBackend()
    meta = pd.DataFrame({"c": pd.Categorical([], categories=["x"])})
    part = pd.DataFrame({"c": pd.Categorical(["x", "w"]), "_partitions": np.int8(0)})
    t, _ = backend.split(part, "_partitions", np.zeros(1, np.int16), 1, False)
    out = backend.concat([t], meta, keep_index=False)
    assert out["c"].tolist() == ["x", "w"]


def test_validate_names_the_problem():
    backend = PandasBackend()
    meta = pd.DataFrame({"a": [1], "_partitions": [0]}).iloc[:0]
    with pytest.raises(ShuffleInputError, match=r"input partition 3 .*missing: \['a'\]"):
        backend.validate(pd.DataFrame({"_partitions": [0]}), meta, "_partitions", 3)
    with pytest.raises(ShuffleInputError, match=r"expected a pandas\.DataFrame"):
        backend.validate(pd.Series([1]), meta, "_partitions", 0)
    assert isinstance(backend_for(meta), PandasBackend)


def test_pool_reuses_buffers_after_release():
    pool = HostBufferPool(limit=64 << 20, idle_release=0)
    a = pool.empty(1_000_000, np.float64)
    a[:] = 1.0
    view = a[10:20]
    del a
    assert pool.statistics.reused == 0
    del view  # the last view gone: the block returns to the pool
    b = pool.empty(900_000, np.float64)  # within the size slack: reused
    assert pool.statistics.reused == 1
    assert pool.statistics.bytes_fresh == pytest.approx(8_000_000, rel=0.01)
    c = pool.empty(1_000_000, np.int64)  # b still alive: fresh
    assert pool.statistics.reused == 1
    del b, c
    assert pool.release_idle(0) > 0
    assert pool.statistics.bytes_free == 0


def test_pool_respects_its_limit_and_small_requests_bypass_it():
    pool = HostBufferPool(limit=10 << 20, idle_release=0)
    arrays = [pool.empty(1_000_000, np.float64) for _ in range(3)]  # 3 x 8 MB
    del arrays
    small = pool.empty(10, np.float64)  # small: left to the allocator
    assert small.base is None
    assert pool.statistics.requests == 3
    # 16 MB: more than the pool may keep once given back (it would be unmapped
    # then, but only when the pool next looks): the allocator's, freed with it.
    big = pool.empty(2_000_000, np.float64)
    assert big.base is None and pool.statistics.requests == 3
    pool.empty(500_000, np.float64)  # 4 MB: absorbs the returned blocks, none fits
    assert pool.statistics.requests == 4
    assert pool.statistics.bytes_free <= 10 << 20
    assert pool.statistics.bytes_released >= 16_000_000


#: Every column kind :func:`column` makes (nulls and NaN among them).
_ALL_KINDS = [
    "int64",
    "float64",
    "bool",
    "string",
    "category",
    "Int64",
    "tz",
    "decimal",
    "date32",
    "Float64",
    "boolean",
    "arrow-int-nulls",
    "arrow-chunked",
]

dtypes = st.sampled_from(_ALL_KINDS)


def column(dtype: str, n: int, rng: np.random.Generator) -> object:
    if dtype == "int64":
        return rng.integers(-(2**40), 2**40, n)
    if dtype == "float64":
        return np.where(rng.random(n) < 0.1, np.nan, rng.random(n))
    if dtype == "bool":
        return rng.random(n) < 0.5
    if dtype == "string":
        return pd.array([None if v < 0.1 else f"s{v:.3f}" for v in rng.random(n)], "string")
    if dtype == "category":
        return pd.Categorical(rng.choice(["a", "b", "c"], n))
    if dtype == "Int64":
        return pd.array(np.where(rng.random(n) < 0.2, None, rng.integers(0, 5, n)), "Int64")
    if dtype == "Float64":
        return pd.array(np.where(rng.random(n) < 0.2, None, rng.random(n)), "Float64")
    if dtype == "boolean":
        return pd.array(np.where(rng.random(n) < 0.2, None, rng.random(n) < 0.5), "boolean")
    if dtype == "decimal":  # as read_parquet gives TPC-H's money columns
        cents = [decimal.Decimal(int(v)).scaleb(-2) for v in rng.integers(0, 10**9, n)]
        return pd.array(pa.array(cents, pa.decimal128(15, 2)), pd.ArrowDtype(pa.decimal128(15, 2)))
    if dtype == "date32":
        days = pa.array(rng.integers(0, 20_000, n).astype(np.int32), pa.date32())
        return pd.array(days, pd.ArrowDtype(pa.date32()))
    if dtype == "arrow-int-nulls":  # nulls: no flat form, taken by Arrow
        values = np.where(rng.random(n) < 0.2, None, rng.integers(0, 9, n))
        return pd.array(pa.array(values, pa.int64()), pd.ArrowDtype(pa.int64()))
    if dtype == "arrow-chunked":  # several chunks, as a frame read from row groups
        values = rng.random(n)
        chunks = pa.chunked_array([values[: n // 2], values[n // 2 :]], pa.float64())
        return pd.arrays.ArrowExtensionArray(chunks)
    return pd.date_range("2021-01-01", periods=n, freq="min", tz="UTC")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 400),
    nparts=st.integers(1, 12),
    kinds=st.lists(dtypes, min_size=1, max_size=5),
    skew=st.floats(0, 1),
    keep_index=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_split_concat_property(n, nparts, kinds, skew, keep_index, seed):
    """Any dtypes, nulls, partition counts and key skew: every row lands once, in order."""
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({f"c{i}": column(k, n, rng) for i, k in enumerate(kinds)})
    hot = rng.random(n) < skew  # one partition takes most rows when skew is high
    df["_partitions"] = np.where(hot, 0, rng.integers(0, nparts, n)).astype(np.int8)
    outs, offsets = split_and_concat(df, nparts, keep_index)
    assert offsets[-1] == n
    got = [o for o in outs if o is not None]
    total = sum(len(o) for o in got)
    assert total == n
    for p, out in enumerate(outs):
        expected = df[df["_partitions"] == p].drop(columns="_partitions")
        if out is None:
            assert expected.empty
            continue
        if not keep_index:
            expected = expected.reset_index(drop=True)
        pd.testing.assert_frame_equal(out, expected)
    if got:
        whole = pd.concat(got)
        assert checksum(whole, index=keep_index) == checksum(
            df.drop(columns="_partitions"), index=keep_index
        )


def _fixed_width_frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "x": rng.integers(0, 10**9, n),
            "money": column("decimal", n, rng),
            "day": column("date32", n, rng),
            "at": pd.date_range("2021-01-01", periods=n, freq="s", tz="Europe/Paris")
            + pd.to_timedelta(seed, "D"),
            "count": pd.array(np.where(rng.random(n) < 0.2, None, rng.integers(0, 9, n)), "Int64"),
            "flag": column("boolean", n, rng),
            "_partitions": rng.integers(0, 3, n).astype(np.int16),
        }
    )


@borrows
def test_fixed_width_extension_columns_are_filled_in_place_borrowed_or_received():
    """Decimals, dates, tz-aware datetimes and masked arrays take the numpy
    path: rows borrowed from a held input and rows received from another
    worker are copied once each, straight into the output (no take into
    fresh memory, then a concatenation), which comes out in one chunk."""
    from gpushuffle.backends.pandas import BorrowedRows
    from gpushuffle.engine import copies

    backend = PandasBackend()
    rank = np.arange(3, dtype=np.int16)
    held = _fixed_width_frame(5_000, seed=0)  # this worker's input, borrowed
    other = _fixed_width_frame(4_000, seed=1)  # another worker's input, received
    (borrowed,), offsets_b = backend.split_groups(
        held, "_partitions", rank, 3, False, [(0, 3)], borrow=0
    )
    assert isinstance(borrowed, BorrowedRows)
    sent, offsets_s = backend.split(other, "_partitions", rank, 3, False)
    header, frames = backend.serialize(sent)
    received = backend.deserialize(header, [memoryview(f) for f in frames])
    meta = held.iloc[:0].drop(columns="_partitions")
    for p in range(3):
        pieces = [
            backend.slice(borrowed, int(offsets_b[p]), int(offsets_b[p + 1])),
            backend.slice(received, int(offsets_s[p]), int(offsets_s[p + 1])),
        ]
        nrows = sum(len(t) for t in pieces)
        before = copies.statistics.unpack
        out = backend.assemble(pieces, nrows, meta, keep_index=False)
        copied = copies.statistics.unpack - before
        expected = pd.concat(
            [held[held["_partitions"] == p], other[other["_partitions"] == p]], ignore_index=True
        ).drop(columns="_partitions")
        pd.testing.assert_frame_equal(out, expected)
        # One copy of every byte: the flat buffers are the output's own.
        assert copied == out.memory_usage(index=False).sum()
        for name in ("money", "day"):
            assert out[name].array._pa_array.num_chunks == 1


@borrows
def test_large_string_pieces_taken_from_a_borrowed_input_stay_chunks_of_the_output():
    """A string piece taken from a held input is memory of its own: it becomes
    a chunk of the output as it is, not copied once more into one chunk.
    Received pieces (views of message buffers) and small pieces are still
    joined into one chunk, and the values are those of pandas' concat."""
    from gpushuffle.backends import pandas_columns as backend_module
    from gpushuffle.backends.pandas import BorrowedRows
    from gpushuffle.engine import copies

    backend = PandasBackend()
    rank = np.zeros(1, dtype=np.int16)
    big = backend_module._KEEP_CHUNK_ROWS + 1000
    held = frame_with_partitions(big, 1, seed=0)  # this worker's input, borrowed
    small = frame_with_partitions(500, 1, seed=1)  # borrowed too, but small
    meta = held.iloc[:0].drop(columns="_partitions")
    pieces, received = [], []
    for frame in (held, small):
        (borrowed,), _ = backend.split_groups(
            frame, "_partitions", rank, 1, False, [(0, 1)], borrow=0
        )
        assert isinstance(borrowed, BorrowedRows)
        pieces.append(borrowed)
    for seed in (2, 3):  # from another worker, 2,000 rows each
        sent, _ = backend.split(
            frame_with_partitions(2000, 1, seed=seed), "_partitions", rank, 1, False
        )
        header, frames = backend.serialize(sent)
        received.append(backend.deserialize(header, [memoryview(f) for f in frames]))
    frames_in = [held, small]
    nrows = big + 500 + 4000
    before = copies.statistics.unpack
    out = backend.assemble(pieces + received, nrows, meta, keep_index=False)
    copied = copies.statistics.unpack - before
    expected = pd.concat(
        frames_in + [frame_with_partitions(2000, 1, seed=s) for s in (2, 3)], ignore_index=True
    ).drop(columns="_partitions")
    pd.testing.assert_frame_equal(out, expected)
    chunks = out["s"].array._pa_array.chunks
    # The large taken piece as it was taken; the small one and both received
    # ones joined into one chunk.
    assert [len(c) for c in chunks] == [big, 4500]
    held_data = held["s"].array._pa_array.chunks[0].buffers()[2]
    taken_data = chunks[0].buffers()[2]
    assert taken_data.address != held_data.address  # a take, not a view of the input
    # Every string byte was copied once (taken, or joined), not twice.
    string_bytes = out["s"].array.nbytes
    numeric = out.drop(columns="s").memory_usage(index=False).sum()
    assert copied <= numeric + string_bytes + chunks[0].nbytes // 10


@borrows
def test_outputs_taken_from_a_borrowed_chunked_input_match_pandas():
    """A shuffled frame's Arrow columns come in many chunks (an output keeps
    those it received); its pieces, borrowed, are taken chunk by chunk."""
    from gpushuffle.backends.pandas import BorrowedRows

    backend = PandasBackend()
    whole = frame_with_partitions(20_000, 4, seed=5)
    whole["money"] = pd.array(
        [decimal.Decimal(i) / 100 for i in range(len(whole))],
        dtype=pd.ArrowDtype(pa.decimal128(12, 2)),
    )
    df = pd.concat([whole.iloc[i : i + 3_000] for i in range(0, len(whole), 3_000)])
    assert df["s"].array._pa_array.num_chunks == 7
    assert df["money"].array._pa_array.num_chunks == 7
    rank = np.arange(4, dtype=np.int16)
    (borrowed,), offsets = backend.split_groups(
        df, "_partitions", rank, 4, True, [(0, 4)], borrow=0
    )
    assert isinstance(borrowed, BorrowedRows)
    meta = df.iloc[:0].drop(columns="_partitions")
    for p in range(4):
        piece = backend.slice(borrowed, int(offsets[p]), int(offsets[p + 1]))
        out = backend.assemble([piece], len(piece), meta, keep_index=True)
        expected = df[df["_partitions"] == p].drop(columns="_partitions")
        pd.testing.assert_frame_equal(out, expected)
        assert out["s"].array._pa_array.num_chunks == 1


def test_categorical_pieces_with_their_categories_in_another_order_keep_their_values():
    """Unordered categoricals compare equal whatever their categories' order,
    but their codes do not mean the same: such a piece is not filled code
    for code into an output of the other order."""
    backend = PandasBackend()
    meta = pd.DataFrame({"c": pd.Categorical([], categories=["x", "y", "z"])})
    same = pd.DataFrame({"c": pd.Categorical(["x", "z"], categories=["x", "y", "z"])})
    other = pd.DataFrame({"c": pd.Categorical(["x", "y", "z"], categories=["z", "y", "x"])})
    assert other["c"].dtype == meta["c"].dtype
    tables = []
    for part in (same, other, same):
        t, _ = backend.split(
            part.assign(_partitions=np.int8(0)), "_partitions", np.zeros(1, np.int16), 1, False
        )
        tables.append(t)
    out = backend.concat(tables, meta, keep_index=False)
    assert out["c"].tolist() == ["x", "z", "x", "y", "z", "x", "z"]
    assert list(out["c"].cat.categories) == ["x", "y", "z"]


def _over_tcp(shard: Shard) -> Shard:
    """``shard`` sent over a real TCP comm of distributed, as workers send them."""
    import asyncio

    from distributed.comm import connect, listen

    from gpushuffle.transport import wire_payload

    async def main() -> Shard:
        received: asyncio.Future[Shard] = asyncio.get_running_loop().create_future()

        async def handle(comm: object) -> None:
            message = await comm.read()  # type: ignore[attr-defined]
            (result,) = message["data"]
            received.set_result(result)
            await comm.close()  # type: ignore[attr-defined]

        async with listen("tcp://127.0.0.1:0", handle) as listener:
            comm = await connect(listener.contact_address)
            await comm.write({"data": wire_payload([shard])})
            result = await received
            await comm.close()
        return result

    return asyncio.run(main())


def test_string_rows_received_in_buffers_of_their_own_stay_chunks_of_the_output():
    """The split cuts a shard's string columns at output partitions, so each
    large output's strings cross the comm in buffers of their own; the
    receiver keeps them as chunks of the output instead of copying them.
    Rows read back from disk, or sharing a buffer, are still copied."""
    from gpushuffle.backends import pandas_columns as backend_module
    from gpushuffle.engine import copies

    backend = PandasBackend()
    big = backend_module._KEEP_CHUNK_ROWS + 500
    frame = frame_with_partitions(2 * big, 2, seed=4)
    frame["_partitions"] = np.repeat(np.array([0, 1], np.int16), big)  # two large outputs
    rank = np.arange(2, dtype=np.int16)
    sent, offsets = backend.split(frame, "_partitions", rank, 2, False)
    # Cut at the output boundary: two chunks of views, no copy.
    assert [len(c) for c in sent.columns[2]._pa_array.chunks] == [big, big]
    shard = Shard("pandas", 0, np.arange(2), offsets, sent, backend.nbytes(sent))
    received = _over_tcp(shard).table
    assert received.standalone  # TCP reads these buffers into arrays of their own

    small = frame_with_partitions(300, 1, seed=5)
    small_table, _ = backend.split(small, "_partitions", np.zeros(1, np.int16), 1, False)
    meta = frame.iloc[:0].drop(columns="_partitions")
    for p in range(2):
        piece = backend.slice(received, int(offsets[p]), int(offsets[p + 1]))
        before = copies.statistics.unpack
        out = backend.assemble([piece, small_table], big + 300, meta, keep_index=False)
        copied = copies.statistics.unpack - before
        expected = pd.concat([frame[frame["_partitions"] == p], small], ignore_index=True).drop(
            columns="_partitions"
        )
        pd.testing.assert_frame_equal(out, expected)
        chunks = out["s"].array._pa_array.chunks
        assert [len(c) for c in chunks] == [big, 300]
        # The received chunk is the received buffers themselves.
        assert (
            chunks[0].buffers()[2].address
            == piece.columns[2]._pa_array.chunk(0).buffers()[2].address
        )
        assert copied < out.memory_usage(index=False).sum() - chunks[0].nbytes // 2

    # The same frames as views into one buffer (a file read back, a shared
    # message buffer): nothing of it is standalone, every string is copied,
    # once: a large chunk as the piece is added (while a spill file's pages
    # are there), kept as a chunk of the output; small ones joined at the end.
    header, frames = backend.serialize(sent)
    block = np.concatenate([np.frombuffer(f, np.uint8) for f in frames[1:]])
    views, start = [], 0
    for f in frames[1:]:
        n = memoryview(f).nbytes
        views.append(memoryview(block)[start : start + n])
        start += n
    shared = backend.deserialize(header, [frames[0], *views])
    assert not shared.standalone
    piece = backend.slice(shared, int(offsets[0]), int(offsets[1]))
    before = copies.statistics.unpack
    out = backend.assemble([piece, small_table], big + 300, meta, keep_index=False)
    copied = copies.statistics.unpack - before
    chunks = out["s"].array._pa_array.chunks
    assert [len(c) for c in chunks] == [big, 300]
    block_start = block.ctypes.data
    for chunk in chunks:
        assert all(
            not block_start <= b.address < block_start + block.nbytes
            for b in chunk.buffers()
            if b is not None
        )
    # Each byte of the output copied once (the small piece's strings twice:
    # its own chunk, joined at the end, is at most a few KiB).
    assert copied <= out.memory_usage(index=False).sum() + chunks[1].nbytes
    pd.testing.assert_frame_equal(
        out,
        pd.concat([frame[frame["_partitions"] == 0], small], ignore_index=True).drop(
            columns="_partitions"
        ),
    )


def _split_keeping_the_upper_half(df, nparts):
    """``split_groups`` of ``df`` into two groups of output partitions, the
    upper half local (borrowed where worth it): that group's table, and the
    split's offsets."""
    rank = np.arange(nparts, dtype=np.int16)
    half = nparts // 2
    groups = [(0, half), (half, nparts)]
    tables, offsets = PandasBackend().split_groups(
        df, "_partitions", rank, nparts, True, groups, borrow=1
    )
    return tables[1], offsets


def _assert_local_pieces_match_pandas(local, offsets, df, nparts):
    """Each output partition's piece of the local group, as pandas selects it."""
    backend = PandasBackend()
    meta = df.iloc[:0].drop(columns="_partitions")
    half = nparts // 2
    start = int(offsets[half])
    for p in range(half, nparts):
        piece = backend.slice(local, int(offsets[p]) - start, int(offsets[p + 1]) - start)
        out = backend.concat([piece], meta, keep_index=True)
        expected = df[df["_partitions"] == p].drop(columns="_partitions")
        pd.testing.assert_frame_equal(out, expected)


@pytest.mark.parametrize(
    ("nrows", "nparts", "borrowed"),
    # 8,000 and 4 rows per output partition
    [pytest.param(64_000, 8, True, marks=borrows), (2_000, 500, False)],
)
def test_a_local_group_is_borrowed_only_when_its_pieces_are_large(nrows, nparts, borrowed):
    """Borrowed rows cost a gather per column for every piece at unpack: with
    many output partitions and few rows each, the split copies the local
    group instead (once per column for the whole group), and the pieces
    come out the same either way."""
    from gpushuffle.backends.pandas import BorrowedRows

    df = frame_with_partitions(nrows, nparts, seed=3)
    local, offsets = _split_keeping_the_upper_half(df, nparts)
    assert isinstance(local, BorrowedRows) == borrowed
    _assert_local_pieces_match_pandas(local, offsets, df, nparts)


@borrows
def test_borrowed_rows_keep_compact_positions_of_their_own():
    """Borrowed rows wait in the store until the unpack: their positions are
    an int32 array of their own, not a view that keeps the split's whole
    int64 sort order alive (both groups' rows) for as long; the pieces
    still come out as pandas has them, index included."""
    from gpushuffle.backends.pandas import BorrowedRows

    nparts = 8
    df = frame_with_partitions(64_000, nparts, seed=5)
    local, offsets = _split_keeping_the_upper_half(df, nparts)
    assert isinstance(local, BorrowedRows)
    assert local.rows.dtype == np.int32
    assert local.rows.base is None  # not a view of the sort order
    assert local.rows.nbytes == 4 * len(local)
    _assert_local_pieces_match_pandas(local, offsets, df, nparts)
    # Copied out before a spill: the same rows.
    backend = PandasBackend()
    meta = df.iloc[:0].drop(columns="_partitions")
    whole = backend.concat([backend.materialize(local)], meta, keep_index=True)
    expected = df[df["_partitions"] >= nparts // 2].drop(columns="_partitions")
    pd.testing.assert_frame_equal(whole.sort_index(), expected.sort_index())


def _every_dtype_frame(n: int, nparts: int, index: str, seed: int) -> pd.DataFrame:
    """Every column kind of the property test (nulls and NaN among them),
    with an index of the given kind and an unwanted rank (``nparts``) too."""
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({f"c_{k}": column(k, n, rng) for k in _ALL_KINDS})
    df["dt"] = pd.to_datetime(rng.integers(0, 10**9, n), unit="s")
    df["td"] = pd.to_timedelta(rng.integers(0, 10**6, n), unit="s")
    if index == "range-kept":
        df.index = pd.RangeIndex(5, 5 + 3 * n, 3, name="ix")
    elif index == "int":
        df.index = pd.Index(rng.permutation(n) * 3, name="ix")
    elif index == "string":
        df.index = pd.Index([f"r{i}" for i in rng.permutation(n)], name="ix")
    elif index == "datetime":
        df.index = pd.DatetimeIndex(pd.to_datetime(rng.integers(0, 10**9, n), unit="s"))
    # Rank ``nparts`` belongs to outputs nobody asked for: dropped either way.
    df["_partitions"] = rng.integers(0, nparts + 1, n).astype(np.int16)
    return df


def _split_with(reorder: str, df, nparts: int, groups, borrow, local, keep_index: bool):
    import dask

    rank = np.arange(nparts + 1, dtype=np.int16)
    with dask.config.set({"gpushuffle.split.reorder": reorder}):
        return PandasBackend().split_groups(
            df, "_partitions", rank, nparts, keep_index, groups, borrow=borrow, local=local
        )


@pytest.mark.parametrize("index", ["range", "range-kept", "int", "string", "datetime"])
@pytest.mark.parametrize(
    ("groups", "borrow", "local"),
    [
        ([(0, 6)], None, None),  # one group: every row scattered
        ([(0, 2), (2, 4), (4, 6)], 1, 1),  # the local group borrowed, in the middle
        ([(0, 3), (3, 6)], 0, 0),
        ([(0, 1), (1, 3), (3, 6)], 2, 2),
        ([(0, 2), (2, 4), (4, 6)], None, 1),  # not persisted: the local group copied
        ([(0, 3), (3, 6)], None, None),  # a worker with no outputs: every group sent
    ],
)
def test_scatter_puts_every_dtype_in_the_same_order_as_gather(index, groups, borrow, local):
    """The scatter reorder gives the same tables as the gather, row for row,
    for every column kind (with nulls), index kind and group layout, and
    each output partition's rows as pandas selects them; the sent groups
    share one block per column, which the local group does not."""
    nparts = 6
    df = _every_dtype_frame(3_000, nparts, index, seed=len(groups) + len(index))
    meta = df.iloc[:0].drop(columns="_partitions")
    backend = PandasBackend()
    keep_index = index != "range"
    results = {
        reorder: _split_with(reorder, df, nparts, groups, borrow, local, keep_index)
        for reorder in ("gather", "scatter")
    }
    (gathered, offsets_g), (scattered, offsets_s) = results["gather"], results["scatter"]
    np.testing.assert_array_equal(offsets_g, offsets_s)
    for g, (first, last) in enumerate(groups):
        start = int(offsets_g[first])
        for p in range(first, last):
            a, b = int(offsets_g[p]) - start, int(offsets_g[p + 1]) - start
            out_g = backend.concat([backend.slice(gathered[g], a, b)], meta, keep_index)
            out_s = backend.concat([backend.slice(scattered[g], a, b)], meta, keep_index)
            pd.testing.assert_frame_equal(out_s, out_g)
            expected = df[df["_partitions"] == p].drop(columns="_partitions")
            if not keep_index:
                expected = expected.reset_index(drop=True)
            pd.testing.assert_frame_equal(out_s, expected)
    sent = [t for g, t in enumerate(scattered) if g != local]
    if len(sent) > 1:  # one block per column for the groups scattered together
        assert _root(sent[0].columns[0]) is _root(sent[1].columns[0])
        sent_g = [t for g, t in enumerate(gathered) if g != local]
        assert _root(sent_g[0].columns[0]) is not _root(sent_g[1].columns[0])
    if local is not None and isinstance(scattered[local], PandasTable):
        for other in sent:  # the local copy keeps no sent rows alive
            assert _root(scattered[local].columns[0]) is not _root(other.columns[0])


def _root(array: np.ndarray) -> object:
    """The object that owns ``array``'s memory (what keeps it alive)."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


@pytest.mark.parametrize(
    ("nrows", "ngroups", "borrowed", "passes"),
    [
        (20_000, 2, True, []),  # half sent: the gather is as fast or faster
        (1_000_000, 2, False, []),
        (20_000, 4, True, [[1, 2, 3]]),  # 3/4 sent
        (300_000, 8, False, [list(range(1, 8))]),  # an eighth stays: gathered
        (10_000, 4, True, []),  # too small
    ],
)
def test_auto_scatters_where_it_measured_faster(nrows, ngroups, borrowed, passes):
    from gpushuffle.backends.pandas import _scatter_passes

    nparts = 40
    groups = [(nparts * i // ngroups, nparts * (i + 1) // ngroups) for i in range(ngroups)]
    offsets = np.linspace(0, nrows, nparts + 1).astype(np.int64)
    assert _scatter_passes(groups, offsets, 0, borrowed, nrows) == passes
    # A worker with no output partitions sends every group: one pass.
    assert _scatter_passes([(0, nparts)], offsets, None, False, nrows) == (
        [[0]] if nrows >= 16_384 else []
    )
    # One worker: its only group is local, copied in a pass of its own.
    assert _scatter_passes([(0, nparts)], offsets, 0, False, nrows) == (
        [[0]] if nrows >= 16_384 else []
    )


def test_a_scattered_group_held_back_is_detached_from_the_others():
    """A sent group that the engine holds back (a small shard waiting for
    others to its peer) is copied out of the block the scatter shared
    between destinations, so that it keeps only its own rows alive; a
    table of its own is returned as it is."""
    nparts = 6
    df = _every_dtype_frame(3_000, nparts, "int", seed=7)
    groups = [(0, 2), (2, 4), (4, 6)]
    tables, _ = _split_with("scatter", df, nparts, groups, None, 0, keep_index=True)
    backend = PandasBackend()
    meta = df.iloc[:0].drop(columns="_partitions")
    small, other = tables[1], tables[2]
    assert small.shared and _root(small.columns[0]) is _root(other.columns[0])
    detached = backend.detached(small)
    assert not detached.shared
    for column in (*detached.columns, detached.index):
        if isinstance(column, np.ndarray):
            assert _root(column) is not _root(other.columns[0])
    pd.testing.assert_frame_equal(
        backend.concat([detached], meta, True), backend.concat([small], meta, True)
    )
    assert backend.detached(tables[0]) is tables[0]  # the local group: a block of its own
    gathered, _ = _split_with("gather", df, nparts, groups, None, 0, keep_index=True)
    assert backend.detached(gathered[1]) is gathered[1]


def test_groups_without_rows_and_frames_without_rows_scatter():
    nparts = 6
    df = _every_dtype_frame(2_000, nparts, "int", seed=3)
    df = df[~df["_partitions"].isin([2, 3])]  # the middle group gets no rows
    groups = [(0, 2), (2, 4), (4, 6)]
    for frame in (df, df.iloc[:0]):
        tables, _ = _split_with("scatter", frame, nparts, groups, None, 0, True)
        gathered, _ = _split_with("gather", frame, nparts, groups, None, 0, True)
        assert len(tables[1]) == 0
        meta = frame.iloc[:0].drop(columns="_partitions")
        for t, g in zip(tables, gathered, strict=True):
            pd.testing.assert_frame_equal(
                PandasBackend().concat([t], meta, True), PandasBackend().concat([g], meta, True)
            )


def test_an_unknown_reorder_is_refused_with_the_choices():
    df = frame_with_partitions(100, 4)
    with pytest.raises(ValueError, match=r"gpushuffle\.split\.reorder: 'sideways' is not one of"):
        _split_with("sideways", df, 4, [(0, 4)], None, None, keep_index=True)


def _chunked_strings(chunks: int, rows: int) -> pd.DataFrame:
    """A frame whose string column is ``chunks`` Arrow chunks of ``rows`` each
    (about 10 bytes a row), as a shuffle's output of large pieces is."""
    parts = [
        pa.array([f"v{i:02d}-{j:07d}" for j in range(rows)], pa.string()) for i in range(chunks)
    ]
    strings = pd.array(pa.chunked_array(parts), dtype=pd.ArrowDtype(pa.string()))
    return pd.DataFrame({"s": strings, "x": np.arange(chunks * rows)})


@pytest.mark.parametrize("in_place", [True, False])
def test_distributed_spills_a_large_arrow_column_without_copying_it(in_place):
    """distributed spills (and sends) a frame by pickling it, and pandas
    pickles an Arrow column by combining its chunks: a second copy of every
    string at the moment a worker is fullest.  With
    ``gpushuffle.memory.pickle-without-copy`` the chunks go as they are, out
    of band; the values come back equal, in the same chunks."""
    from distributed.protocol import deserialize_bytes, serialize_bytelist

    df = _chunked_strings(4, 100_000)
    strings = df["s"].array._pa_array
    assert strings.nbytes >= 4 << 20
    with dask.config.set({"gpushuffle.memory.pickle-without-copy": in_place}):
        before = pa.total_allocated_bytes()
        frames = serialize_bytelist(df)
        grown = pa.total_allocated_bytes() - before
    if in_place:
        assert grown < 64 << 10, f"pickling allocated {grown} bytes in Arrow"
    else:
        assert grown >= strings.nbytes  # pandas' combine_chunks()
    back = deserialize_bytes(b"".join(frames))
    pd.testing.assert_frame_equal(back, df)
    chunks = back["s"].array._pa_array.num_chunks
    assert chunks == (4 if in_place else 1)


def test_sliced_or_small_arrow_columns_pickle_only_their_rows():
    """A slice's chunks hold their parent's rows (pyarrow would pickle all of
    them: ARROW-10739): each is copied to its own rows.  A small column is
    not worth many buffers: it is combined into one chunk, as pandas does."""
    import pickle

    df = _chunked_strings(4, 100_000)
    part = df.iloc[1000:150_000]
    payload = pickle.dumps(part, protocol=5)
    assert len(payload) < 2 * part["s"].array.nbytes
    back = pickle.loads(payload)
    pd.testing.assert_frame_equal(back, part)
    assert back["s"].array._pa_array.num_chunks == 2  # rows of chunks 0 and 1
    small = _chunked_strings(3, 1000)
    back = pickle.loads(pickle.dumps(small, protocol=5))
    pd.testing.assert_frame_equal(back, small)
    assert back["s"].array._pa_array.num_chunks == 1


@pytest.mark.parametrize("in_place", [True, False])
def test_distributed_spills_large_datetime_columns_out_of_band(in_place):
    """numpy pickles datetime64 and timedelta64 in band (a copy into the
    pickle); pandas' block of several datetime columns is 2-D.  With
    ``gpushuffle.memory.pickle-without-copy`` they go as int64 views, out of
    band, and come back with their dtypes (time zone included)."""
    import pickle

    from distributed.protocol import deserialize_bytes, serialize_bytelist

    n = 500_000
    df = pd.DataFrame(
        {
            "naive": pd.date_range("2020", periods=n, freq="s"),
            "naive2": pd.date_range("2021", periods=n, freq="ms"),
            "utc": pd.date_range("2020", periods=n, freq="s", tz="UTC"),
            "delta": pd.to_timedelta(np.arange(n), unit="s"),
        }
    )
    with dask.config.set({"gpushuffle.memory.pickle-without-copy": in_place}):
        frames = serialize_bytelist(df)
        in_band = len(pickle.dumps(df, protocol=5, buffer_callback=lambda b: None))
    if in_place:
        assert in_band < 64 << 10
    else:
        assert in_band >= 4 * n * 8
    back = deserialize_bytes(b"".join(frames))
    pd.testing.assert_frame_equal(back, df)
    # Any protocol, and copy.deepcopy, which reads the same table.
    pd.testing.assert_frame_equal(pickle.loads(pickle.dumps(df, protocol=2)), df)
    pd.testing.assert_frame_equal(copy.deepcopy(df), df)


def test_a_sliced_chunk_is_copied_alone_and_dictionaries_pickle_the_pandas_way():
    """Among whole chunks, one that is a slice of a larger array is copied to
    its rows alone (not the column, not its parent's buffers).  Dictionary
    chunks share one dictionary, which pickle would write once per chunk:
    they are combined, as pandas does."""
    import pickle

    from distributed.protocol import deserialize_bytes, serialize_bytelist

    whole = [pa.array([f"v{i}-{j:07d}" for j in range(100_000)]) for i in range(4)]
    sliced = pa.array([f"big{j:07d}" for j in range(400_000)]).slice(0, 100_000)
    strings = pd.Series(
        pd.array(pa.chunked_array([*whole, sliced]), dtype=pd.ArrowDtype(pa.string()))
    )
    before = pa.total_allocated_bytes()
    frames = serialize_bytelist(strings)
    grown = pa.total_allocated_bytes() - before
    assert sliced.nbytes <= grown < sliced.nbytes + (64 << 10)
    assert sum(len(f) for f in frames) < 1.2 * strings.array.nbytes
    back = deserialize_bytes(b"".join(frames))
    pd.testing.assert_series_equal(back, strings)
    assert back.array._pa_array.num_chunks == 5

    dictionary = pa.array([f"key-{i:07d}" for i in range(100_000)])
    codes = np.random.default_rng(0).integers(0, 100_000, (40, 20_000), dtype=np.int32)
    chunks = [pa.DictionaryArray.from_arrays(pa.array(c), dictionary) for c in codes]
    keys = pd.Series(pd.array(pa.chunked_array(chunks), dtype=pd.ArrowDtype(chunks[0].type)))
    payload = pickle.dumps(keys, protocol=5)
    assert len(payload) < 2 * (dictionary.nbytes + codes.nbytes)  # once, not 40 times
    pd.testing.assert_series_equal(pickle.loads(payload), keys)


def test_shallow_copies_of_large_datetimes_are_datetimes():
    """copy.copy reads copyreg's table too and hands the state to
    ``__setstate__`` unpickled: it gets pandas' own state."""
    n = 500_000
    for values in (
        pd.date_range("2020", periods=n, freq="s").array,
        pd.date_range("2020", periods=n, freq="s", tz="UTC").array,
        pd.to_timedelta(np.arange(n), unit="s").array,
    ):
        assert values.nbytes >= 1 << 20
        for copied in (copy.copy(values), copy.deepcopy(values)):
            assert type(copied) is type(values) and copied.dtype == values.dtype
            assert (copied == values).all()


def test_auto_scatters_the_sent_rows_of_four_workers_whatever_the_keys_spread():
    """With 4 workers a partition sends 3/4 of its rows give or take the
    keys' spread (here 74.8%): "auto" scatters them all the same (at 0.75
    half of the benchmark's partitions were gathered, 6% slower at 12M
    numeric rows); with 2 workers (half sent) it gathers."""
    from gpushuffle.backends.pandas import _scatter_passes

    nrows = 200_000
    four = np.array([0, 50_400, 100_000, 150_000, nrows])  # local group 0: 25.2%
    groups = [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert _scatter_passes(groups, four, 0, True, nrows) == [[1, 2, 3]]
    two = np.array([0, 100_000, nrows])
    assert _scatter_passes([(0, 1), (1, 2)], two, 0, True, nrows) == []


def test_an_output_column_lets_go_of_each_piece_once_copied():
    """A column remembers the dtypes it found its own, but not the pieces:
    a received categorical's categories are views of its message, which
    must go as soon as the piece is copied, not when the output is done."""
    import gc
    import weakref

    from gpushuffle.backends import flat
    from gpushuffle.backends.pandas_output import _ColumnBuilder
    from gpushuffle.engine.pool import host_pool

    dtype = pd.CategoricalDtype([10, 20, 30])
    outs = tuple(np.empty(6, d) for d in flat.flat_dtypes(dtype))
    builder = _ColumnBuilder(dtype, host_pool(), outs)
    alive = []
    for piece in range(3):
        message = np.array([10, 20, 30, 1, 2], dtype=np.int64)  # categories, then codes
        alive.append(weakref.ref(message))
        categories = pd.Index(message[:3], copy=False)
        values = pd.Categorical.from_codes(
            message[3:].astype(np.int8), dtype=pd.CategoricalDtype(categories)
        )
        builder.add(values)
        del message, categories, values
        gc.collect()
        assert [a() is not None for a in alive] == [False] * (piece + 1)
    assert builder.finish().tolist() == [20, 30] * 3
