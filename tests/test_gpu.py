"""The cuDF backend and the device path, on a real GPU (skipped without one).

Run by ``ci/test_gpu.sh`` on GPU runners and by ``ci/gpu_run.sh`` on the lent
GPU machine; on CPU CI they are collected and skipped with the reason (see
``conftest.pytest_collection_modifyitems``, which allocates with cuDF in a
child process).  cuDF is imported inside the tests, so collection works
without it.

What they cover, in the order a broken device path would show it:

- the backend on its own: every dtype the backend claims through split,
  slice, the wire (host and device frames), the host tier and back, and
  assemble; categories that differ between partitions and from meta; loose
  meta cast; column labels; tables without columns; a bounded unpack
  (device peak measured with RMM's statistics); tables refusing pickle;
- the store's device tier spilling to host and disk and back;
- shuffles on two worker processes sharing the one GPU, over TCP and UCX,
  against dask's ``tasks`` method, asserting that shards crossed the wire
  through the backend's serializers (and, over UCX, as device frames), with
  tiny device and host budgets, and that nothing is left behind;
- ``gpushuffle shuffle`` end to end on cuDF.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from conftest import assert_nothing_left_behind
from test_transport import _copied, _wire, wire_delta
from truth import checksum

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

NPARTS = 4


# -- frames -------------------------------------------------------------------


def _pandas_frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    ints = pd.array(rng.integers(-50, 50, n), dtype="Int64")
    ints[rng.random(n) < 0.1] = pd.NA
    floats = rng.random(n)
    floats[rng.random(n) < 0.1] = np.nan
    strings = pd.array([f"s{i % 97}" * (1 + i % 3) for i in range(n)], dtype="string")
    strings[rng.random(n) < 0.1] = pd.NA
    return pd.DataFrame(
        {
            "key": rng.integers(0, 500, n),
            "row": np.arange(n),
            "i32": rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32),
            "nullable": ints,
            "f": floats,
            "b": rng.random(n) < 0.5,
            "s": strings,
            "c": pd.Categorical(rng.choice(["x", "y", "z"], n)),
            "ts": pd.Timestamp("2026-01-01") + pd.to_timedelta(rng.integers(0, 10**6, n), "s"),
            "tz": pd.date_range("2020-01-01", periods=n, freq="min", tz="Europe/Berlin"),
            "td": pd.to_timedelta(rng.integers(0, 10**6, n), "ms"),
        },
        index=pd.Index(np.arange(n) * 3, name="idx"),
    )


def gpu_frame(n: int = 5000, seed: int = 0):
    """Every dtype the backend claims, nulls in most, a named index."""
    import cudf

    gdf = cudf.from_pandas(_pandas_frame(n, seed))
    rng = np.random.default_rng(seed + 1)
    # index=: a Series is aligned to the frame by label.
    gdf["dec"] = cudf.Series(
        [None if i % 11 == 0 else round(float(v), 2) for i, v in enumerate(rng.random(n) * 100)],
        index=gdf.index,
    ).astype(cudf.Decimal64Dtype(precision=10, scale=2))
    gdf["lst"] = cudf.Series(
        [None if i % 13 == 0 else list(range(i % 4)) for i in range(n)], index=gdf.index
    )
    gdf["st"] = cudf.Series([{"a": i, "b": f"v{i % 5}"} for i in range(n)], index=gdf.index)
    return gdf


def with_partitions(gdf, nparts: int = NPARTS):
    """``gdf`` with dask's ``_partitions`` column (``key`` modulo ``nparts``)."""
    out = gdf.copy()
    out["_partitions"] = (out["key"] % nparts).astype(np.int16)
    return out


def expected_partition(gdf, p: int, keep_index: bool = True):
    part = gdf[gdf["_partitions"] == p].drop(columns=["_partitions"])
    return part if keep_index else part.reset_index(drop=True)


def assert_frames_equal(ours, expected) -> None:
    """Values, nulls, dtypes, index and labels.

    cuDF 26.10's ``assert_frame_equal`` reports equal decimal columns as
    different (``cudf/testing/testing.py:61-75, 297-306``; NVIDIA/cudf#16635)
    and raises NotImplementedError comparing list and struct columns: those
    are compared through Arrow, dtype first.
    """
    import cudf

    special = [
        name
        for name, dtype in ours.dtypes.items()
        if isinstance(dtype, (cudf.core.dtypes.DecimalDtype, cudf.ListDtype, cudf.StructDtype))
    ]
    for name in special:
        assert ours[name].dtype == expected[name].dtype, (name, ours[name].dtype)
        assert ours[name].to_arrow().equals(expected[name].to_arrow()), name
    cudf.testing.assert_frame_equal(ours.drop(columns=special), expected.drop(columns=special))


def split_pieces(backend, gdf, keep_index: bool = True, nparts: int = NPARTS):
    table, offsets = backend.split(
        gdf, "_partitions", np.arange(nparts, dtype=np.int16), nparts, keep_index
    )
    return [backend.slice(table, int(offsets[p]), int(offsets[p + 1])) for p in range(nparts)]


# -- the backend on its own ---------------------------------------------------


@pytest.mark.parametrize("keep_index", [True, False], ids=["index", "ignore-index"])
def test_every_dtype_through_every_path(keep_index):
    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    gdf = with_partitions(gpu_frame())
    meta = gdf.iloc[:0].drop(columns=["_partitions"])
    if not keep_index:
        meta = meta.reset_index(drop=True)
    for p, piece in enumerate(split_pieces(backend, gdf, keep_index)):
        expected = expected_partition(gdf, p, keep_index)
        moved = {
            "device": piece,
            "host tier": backend.to_device(backend.to_host(piece)),
            "spill file": backend.deserialize(*backend.serialize(backend.to_host(piece))),
        }
        for device_frames in (False, True):
            header, frames = backend.serialize(piece, device_frames=device_frames)
            if device_frames:
                assert any(hasattr(f, "__cuda_array_interface__") for f in frames)
            else:
                assert not any(hasattr(f, "__cuda_array_interface__") for f in frames)
            moved[f"wire (device frames: {device_frames})"] = backend.deserialize(header, frames)
        for how, table in moved.items():
            out = backend.assemble([table], table.nrows, meta, keep_index)
            try:
                assert_frames_equal(out, expected)
            except AssertionError as e:
                raise AssertionError(f"partition {p} via {how}: {e}") from e


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_device_frames_compressed_with_nvcomp_decode_to_the_same_rows(codec):
    """nvCOMP on device frames (gpushuffle.device_codecs): never run before."""
    import cupy

    import gpushuffle
    from gpushuffle import codecs
    from gpushuffle.backends.cudf import CudfBackend
    from gpushuffle.engine.links import LinkState, RunCompression

    backend = CudfBackend()
    gdf = with_partitions(gpu_frame(20_000))
    meta = gdf.iloc[:0].drop(columns=["_partitions"])
    compression = RunCompression(codec)
    for p, piece in enumerate(split_pieces(backend, gdf)):
        header, frames = backend.serialize(piece, device_frames=True)
        sent, entries = codecs.encode_frames(frames, compression.compressor(LinkState(1e6, 1.0)))
        assert entries is not None, "no device frame was compressed"
        compressed = [f for f, e in zip(sent, entries, strict=True) if e is not None]
        assert all(hasattr(f, "__cuda_array_interface__") for f in compressed)
        table = backend.deserialize(header, codecs.decode_frames(entries, sent, f"piece {p}"))
        assert_frames_equal(
            backend.assemble([table], table.nrows, meta, True), expected_partition(gdf, p)
        )
    # A device frame changed on the way: nvCOMP's checksum refuses it.
    position = next(i for i, e in enumerate(entries) if e is not None)
    damaged = cupy.asarray(sent[position]).view(cupy.uint8).copy()
    damaged[damaged.size // 2] ^= 0xFF
    sent = [damaged if i == position else f for i, f in enumerate(sent)]
    with pytest.raises(gpushuffle.ShuffleCodecError):
        codecs.decode_frames(entries, sent, "a damaged piece")


def test_pieces_in_input_order_with_a_multiindex_and_column_labels():
    import cudf

    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    pdf = _pandas_frame(3000, 1)[["key", "row", "f", "s"]]
    pdf.index = pd.MultiIndex.from_arrays(
        [np.arange(3000) % 7, np.arange(3000).astype(str)], names=["a", "b"]
    )
    pdf.columns.name = "fields"
    gdf = with_partitions(cudf.from_pandas(pdf))
    halves = [gdf.iloc[:1500], gdf.iloc[1500:]]
    meta = gdf.iloc[:0].drop(columns=["_partitions"])
    pieces = [split_pieces(backend, half) for half in halves]
    for p in range(NPARTS):
        out = backend.concat([pieces[0][p], pieces[1][p]], meta, True)
        assert_frames_equal(out, expected_partition(gdf, p))
        assert out.columns.name == "fields"


def test_categories_differ_between_pieces_and_from_meta():
    """As pandas' union_categoricals: every label right, categories in order of appearance."""
    import cudf

    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    many = [f"c{i:04d}" for i in range(300)]  # > 255 categories: wider codes
    values = [
        pd.Categorical(["b", "a", "b"]),
        pd.Categorical(["z", "a"], categories=["z", "a"]),
        pd.Categorical(many),
        pd.Categorical([None, None], categories=pd.Index([], dtype=object)),
    ]
    tables = []
    for column in values:
        gdf = cudf.DataFrame({"c": cudf.from_pandas(pd.Series(column))})
        gdf["_partitions"] = np.zeros(len(column), dtype=np.int16)
        (piece,) = split_pieces(backend, gdf, keep_index=False, nparts=1)
        tables.append(backend.to_device(backend.to_host(piece)))
    # pandas' union_categoricals, written out: values as they are, categories
    # in order of first appearance.
    expected = pd.Series([v for column in values for v in column], dtype=object)
    expected_categories = list(dict.fromkeys(c for column in values for c in column.categories))
    unknown = cudf.DataFrame(
        {"c": cudf.Series(["__UNKNOWN_CATEGORIES__"], dtype="category").iloc[:0]}
    )
    out = backend.concat(tables, unknown, False).to_pandas()
    pd.testing.assert_series_equal(out["c"].astype(object), expected, check_names=False)
    assert list(out["c"].cat.categories) == expected_categories
    # Known categories in meta that cover every value: the output takes meta's dtype.
    known = cudf.DataFrame(
        {"c": cudf.Series([], dtype=cudf.CategoricalDtype(["z", "b", "a", *many]))}
    )
    out = backend.concat(tables, known, False)
    assert out["c"].dtype == known["c"].dtype
    pd.testing.assert_series_equal(out["c"].to_pandas().astype(object), expected, check_names=False)


def test_categories_of_differing_dtypes_fail_rather_than_mix():
    """docs/gpu-calls.md section 3, item 8: pieces whose categories have
    different dtypes (unknown categories, inconsistent data) cannot be put in
    one column; libcudf's concatenate refuses, as cuDF's own concat does."""
    import cudf

    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    tables = []
    for values in ([1, 2, 1], ["a", "b"]):
        gdf = cudf.DataFrame({"c": cudf.Series(values).astype("category")})
        gdf["_partitions"] = np.zeros(len(values), dtype=np.int16)
        (piece,) = split_pieces(backend, gdf, keep_index=False, nparts=1)
        tables.append(piece)
    unknown = cudf.DataFrame(
        {"c": cudf.Series(["__UNKNOWN_CATEGORIES__"], dtype="category").iloc[:0]}
    )
    with pytest.raises(TypeError):
        backend.concat(tables, unknown, False)


def test_loose_meta_is_cast_and_bad_input_is_rejected():
    import cudf

    from gpushuffle.backends.cudf import CudfBackend
    from gpushuffle.errors import ShuffleInputError

    backend = CudfBackend()
    gdf = with_partitions(cudf.DataFrame({"key": np.arange(100), "v": np.arange(100, dtype="i4")}))
    meta = gdf.iloc[:0].astype({"v": "f8"})
    backend.validate(gdf, meta, "_partitions", 0)  # int32 data, float64 meta: castable
    pieces = split_pieces(backend, gdf)
    out = backend.concat(pieces, meta.drop(columns=["_partitions"]), True)
    assert out["v"].dtype == np.float64
    assert sorted(out["v"].to_pandas()) == list(range(100))
    bad = meta.astype({"v": "str"})
    with pytest.raises(ShuffleInputError, match="column 'v'"):
        backend.validate(gdf, bad, "_partitions", 3)


def test_only_the_key_without_the_index():
    """A table without columns: rows are counted, nothing else travels."""
    import cudf

    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    gdf = with_partitions(cudf.DataFrame({"key": np.arange(1000)}))
    meta = gdf.iloc[:0][[]].reset_index(drop=True)
    for p, piece in enumerate(split_pieces(backend, gdf.drop(columns=["key"]), keep_index=False)):
        piece = backend.deserialize(*backend.serialize(backend.to_host(piece)))
        out = backend.assemble([piece], piece.nrows, meta, False)
        assert len(out) == int((gdf["_partitions"] == p).sum()) and not len(out.columns)


def test_unpack_peak_is_the_output_plus_one_piece():
    import rmm

    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    import cudf

    columns = ["key", "row", "i32", "f", "b", "ts"]
    gdf = with_partitions(cudf.from_pandas(_pandas_frame(200_000, 0)[columns]), 1)
    meta = gdf.iloc[:0].drop(columns=["_partitions"])
    pieces = [
        backend.to_host(piece) for i in range(8) for piece in split_pieces(backend, gdf, nparts=1)
    ]
    nrows = sum(p.nrows for p in pieces)
    output = pieces[0].nbytes * 8
    previous = rmm.mr.get_current_device_resource()
    stats = rmm.mr.StatisticsResourceAdaptor(previous)
    rmm.mr.set_current_device_resource(stats)
    try:
        # Like the store: each piece comes up only when asked for, and goes.
        out = backend.assemble((backend.to_device(p) for p in pieces), nrows, meta, True)
        peak = stats.allocation_counts.peak_bytes
    finally:
        rmm.mr.set_current_device_resource(previous)
    assert len(out) == nrows
    assert peak <= output + 2 * pieces[0].nbytes + (16 << 20), (peak, output)


def _fixed_width_frame(n: int, seed: int, nulls: bool):
    """Every fixed-width type the output columns are allocated in
    (``make_fixed_width_column``) and filled with (``copy_range_in_place``),
    decimals of each width among them; with nulls or without."""
    import cudf

    rng = np.random.default_rng(seed)
    missing = (rng.random(n) < 0.2) if nulls else np.zeros(n, dtype=bool)

    def masked(values, dtype):
        out = pd.array(values, dtype=dtype)
        out[missing] = pd.NA
        return out

    pdf = pd.DataFrame(
        {
            "key": rng.integers(0, 40, n),
            "i8": masked(rng.integers(-100, 100, n), "Int8"),
            "u32": masked(rng.integers(0, 2**32 - 1, n, dtype=np.uint32), "UInt32"),
            "f32": masked(rng.random(n).astype(np.float32), "Float32"),
            "b": masked(rng.random(n) < 0.5, "boolean"),
            "clean": np.arange(n, dtype=np.int16),  # never null: its mask is dropped
        }
    )
    gdf = cudf.from_pandas(pdf)
    ts = pd.Series(pd.to_datetime(rng.integers(0, 10**9, n), unit="s")).astype("datetime64[ms]")
    td = pd.Series(pd.to_timedelta(rng.integers(0, 10**6, n), unit="s"))
    gdf["ts_ms"] = cudf.from_pandas(ts.where(~missing))
    gdf["td_s"] = cudf.from_pandas(td.where(~missing)).astype("timedelta64[s]")
    amounts = cudf.Series(np.round(rng.random(n) * 1000, 2))
    amounts[cudf.Series(missing)] = None
    gdf["d32"] = amounts.astype(cudf.Decimal32Dtype(precision=7, scale=2))
    gdf["d64"] = amounts.astype(cudf.Decimal64Dtype(precision=12, scale=3))
    gdf["d128"] = amounts.astype(cudf.Decimal128Dtype(precision=30, scale=5))
    return gdf


def test_fixed_width_types_with_and_without_nulls_fill_one_output_column():
    """docs/gpu-calls.md section 3, items 1 and 2: ``make_fixed_width_column``
    and ``copy_range_in_place`` have no upstream test for decimals, for nulls
    copied into an all-valid target, or for sources that are offset views
    into an unpacked buffer; gpushuffle trusts the target's null count."""
    import cudf

    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    inputs = [with_partitions(_fixed_width_frame(3000, seed, nulls=seed > 0)) for seed in range(3)]
    meta = inputs[0].iloc[:0].drop(columns=["_partitions"])
    pieces = [split_pieces(backend, gdf) for gdf in inputs]
    whole = cudf.concat(inputs)
    for p in range(NPARTS):
        expected = expected_partition(whole, p)
        assert expected["d32"].null_count > 0, "the test must copy nulls"
        ways = {
            # Slices of the split's table: validity bits at a row offset.
            "slices": [piece[p] for piece in pieces],
            # Through the host tier: each piece unpacked into a buffer of its own.
            "host tier": [backend.to_device(backend.to_host(piece[p])) for piece in pieces],
        }
        for how, tables in ways.items():
            out = backend.concat(tables, meta, True)
            assert_frames_equal(out, expected)
            for name in out.columns:
                assert out[name].null_count == expected[name].null_count, (p, how, name)
            assert out["clean"]._column.mask is None, "an output without nulls keeps no mask"


def test_pieces_without_rows_and_categories_without_values():
    """docs/gpu-calls.md section 3, item 3: ``ChunkedPack`` and
    ``unpack_from_memoryviews`` on tables with columns and no rows (an empty
    shard, a categories part with no categories; ``_pack_on_device`` hands
    those to ``_pack_to_host``), on every path a piece takes."""
    import cudf

    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    gdf = gpu_frame(2000)[["key", "row", "f", "s", "c", "dec"]]
    gdf["key"] = gdf["key"] % 2  # partitions 2 and 3 receive nothing
    # A categorical column whose every value is null: no categories at all.
    gdf["none"] = cudf.Series([None] * len(gdf), dtype="str", index=gdf.index).astype("category")
    gdf = with_partitions(gdf)
    meta = gdf.iloc[:0].drop(columns=["_partitions"])
    pieces = split_pieces(backend, gdf)
    rows = backend.to_device(backend.to_host(pieces[0]))
    for p, piece in enumerate(pieces):
        assert (piece.nrows == 0) == (p >= 2)
        paths = {
            "device": piece,
            "host tier": backend.to_device(backend.to_host(piece)),
            "spill file": backend.deserialize(*backend.serialize(backend.to_host(piece))),
            "wire, device frames": backend.deserialize(
                *backend.serialize(piece, device_frames=True)
            ),
            "wire, host frames": backend.deserialize(*backend.serialize(piece)),
        }
        for how, table in paths.items():
            assert table.nrows == piece.nrows, how
            # Around a piece with rows: an output with no rows at all never
            # reaches assemble (the run returns meta for it).
            out = backend.concat([table, rows, table], meta, True)
            mine, first = expected_partition(gdf, p), expected_partition(gdf, 0)
            try:
                assert_frames_equal(out, cudf.concat([mine, first, mine]))
            except AssertionError as e:
                raise AssertionError(f"partition {p} via {how}: {e}") from e


def test_meta_categories_of_another_dtype_keep_the_values():
    """docs/gpu-calls.md section 3, item 6: where meta's known categories have
    a dtype the data's cannot be compared with, ``Index.isin`` is all False
    and the output keeps the categories the data brought: values are kept."""
    import cudf

    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    gdf = cudf.DataFrame({"key": np.arange(60), "c": cudf.Series(["x", "y", "z"] * 20)})
    gdf["c"] = gdf["c"].astype("category")
    gdf = with_partitions(gdf)
    meta = gdf.iloc[:0].drop(columns=["_partitions"])
    meta["c"] = meta["c"].astype(cudf.CategoricalDtype([1, 2, 3]))
    out = backend.concat(split_pieces(backend, gdf), meta, True).sort_index()
    assert out["c"].astype(str).to_arrow().to_pylist() == ["x", "y", "z"] * 20
    assert sorted(out["c"].cat.categories.to_arrow().to_pylist()) == ["x", "y", "z"]


def test_device_tables_refuse_pickle():
    import cudf

    from gpushuffle.backends.cudf import CudfBackend

    backend = CudfBackend()
    (piece, *_) = split_pieces(backend, with_partitions(cudf.DataFrame({"key": np.arange(10)})))
    with pytest.raises(TypeError, match="reached plain pickle"):
        pickle.dumps(piece)


def test_store_device_tier_to_disk_and_back(tmp_path):
    from gpushuffle.backends.cudf import CudfBackend
    from gpushuffle.engine.memory import TierUsage, WorkerMemory
    from gpushuffle.engine.store import ShardStore
    from gpushuffle.transport import Shard

    backend = CudfBackend()
    gdf = with_partitions(gpu_frame(4000))
    meta = gdf.iloc[:0].drop(columns=["_partitions"])
    memory = WorkerMemory(
        device=TierUsage(limit=64 << 10),
        host=TierUsage(limit=64 << 10),
        disk=TierUsage(limit=None),
        disk_enabled=True,
    )

    async def offload(func, *args):
        return func(*args)

    store = ShardStore(backend, memory, str(tmp_path / "spill"), offload, 0.0, "gpu test")
    inputs = [gdf.iloc[i * 1000 : (i + 1) * 1000] for i in range(4)]

    async def fill():
        for i in (2, 0, 3, 1):  # arrival order differs from input order
            table, offsets = backend.split(
                inputs[i], "_partitions", np.arange(NPARTS, dtype=np.int16), NPARTS, True
            )
            await store.put(Shard("cudf", i, np.arange(NPARTS), offsets, table, table.nbytes))

    asyncio.run(fill())
    snapshot = memory.snapshot()
    assert snapshot["device_to_host_bytes"] > 0 and snapshot["host_to_disk_bytes"] > 0
    for p in range(NPARTS):
        nrows, tables = store.read(p)
        out = backend.assemble(tables, nrows, meta, True)
        assert_frames_equal(out, expected_partition(gdf, p))  # input order kept
    assert memory.device.bytes == memory.host.bytes == memory.disk.bytes == 0
    store.close()


# -- shuffles on two worker processes sharing the GPU ------------------------


def two_workers_on_gpu0(**kwargs):
    """dask-cuda's ``LocalCUDACluster``, with two workers on GPU 0.

    Each worker is specified as dask-cuda specifies one (its
    ``new_worker_spec``: the ``DeviceHostFile`` data with a device memory
    limit, and its RMM, cuDF-spilling and pre-import worker plugins), so
    the shuffle meets what users run.  dask-cuda names workers by device and
    so gives each GPU one worker; two on the one lent GPU make shards cross
    the wire, which this subclass allows and nothing else changes.
    """
    import copy

    from dask_cuda import LocalCUDACluster
    from dask_cuda.worker_common import worker_plugins

    class TwoWorkersOnGPU0(LocalCUDACluster):
        def new_worker_spec(self):
            spec = copy.deepcopy(self.new_spec)
            spec["options"].update(
                {
                    "env": {"CUDA_VISIBLE_DEVICES": "0"},
                    "data": self.data(0),
                    "plugins": worker_plugins(
                        device_index=0,
                        rmm_initial_pool_size=self.rmm_pool_size,
                        rmm_maximum_pool_size=self.rmm_maximum_pool_size,
                        rmm_managed_memory=self.rmm_managed_memory,
                        rmm_async_alloc=self.rmm_async,
                        rmm_release_threshold=self.rmm_release_threshold,
                        rmm_log_directory=self.rmm_log_directory,
                        rmm_track_allocations=self.rmm_track_allocations,
                        rmm_allocator_external_lib_list=self.rmm_allocator_external_lib_list,
                        pre_import=self.pre_import,
                        enable_cudf_spill=self.enable_cudf_spill,
                        cudf_spill_stats=self.cudf_spill_stats,
                    ),
                }
            )
            return {f"gpu0-{len(self.worker_spec)}": spec}

    cluster = TwoWorkersOnGPU0(CUDA_VISIBLE_DEVICES="0", n_workers=1, **kwargs)
    cluster.scale(2)
    cluster.sync(cluster._correct_state)
    return cluster


@pytest.fixture(scope="module", params=["tcp", "ucx"])
def gpu_client(request):
    """Two dask-cuda workers on GPU 0 (RMM pools, cuDF spilling, a device
    memory limit), over TCP or UCX."""
    from distributed import Client

    protocol = request.param
    settings = {}
    if protocol == "ucx":
        pytest.importorskip("distributed_ucxx", reason="the UCX wheels did not travel")
        os.environ["UCX_TLS"] = "tcp,cuda_copy,cuda_ipc,sm,self"
        settings = {"distributed-ucxx.create-cuda-context": True}
    with (
        dask.config.set(settings),
        two_workers_on_gpu0(
            protocol=protocol,
            threads_per_worker=1,
            rmm_pool_size="2GiB",
            enable_cudf_spill=True,
            device_memory_limit="16GiB",
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=120)
        yield client


def check_against_tasks(client, gdf, on, npartitions: int, ignore_index: bool = False) -> None:
    """Each output partition holds the rows ``tasks`` puts there, in input order."""
    before = client.run(_wire)
    copied_before = client.run(_copied)
    df = dd.from_pandas(gdf, npartitions=6, sort=False)
    ours = df.shuffle(
        on, npartitions=npartitions, ignore_index=ignore_index, shuffle_method="gpushuffle"
    )
    assert any("gpushuffle-transfer" in str(k) for k in ours.__dask_graph__())
    truth = df.shuffle(
        on, npartitions=npartitions, ignore_index=ignore_index, shuffle_method="tasks"
    )
    ours_parts = dask.compute(*ours.to_delayed())
    truth_parts = dask.compute(*truth.to_delayed())
    total = 0
    for i, (a, b) in enumerate(zip(ours_parts, truth_parts, strict=True)):
        assert type(a).__module__.startswith("cudf"), type(a)
        a, b = a.to_pandas(), b.to_pandas()
        assert len(a) == len(b), f"partition {i}: {len(a)} rows, tasks {len(b)}"
        assert a["row"].is_monotonic_increasing, f"partition {i}: input order lost"
        pd.testing.assert_series_equal(a.dtypes, b.dtypes)
        flat = [c for c in a.columns if c not in ("lst", "st")]
        assert checksum(a[flat], index=not ignore_index) == checksum(
            b.sort_values("row")[flat], index=not ignore_index
        ), f"partition {i}"
        if "lst" in a:
            b = b.sort_values("row")
            assert a["lst"].tolist() == b["lst"].tolist() and a["st"].tolist() == b["st"].tolist()
        total += len(a)
    assert total == len(gdf)
    per_worker = wire_delta(client, before)
    delta = {k: sum(d[k] for d in per_worker.values()) for k in next(iter(per_worker.values()))}
    assert delta["wire_shards_sent"] > 0, "no shard crossed the wire"
    assert (
        delta["wire_shards_serialized"]
        == delta["wire_shards_deserialized"]
        == delta["wire_shards_sent"]
    )
    if client.scheduler.address.startswith("ucx"):
        assert delta["wire_device_frames"] > 0, "UCX carried no device frame"
    # Bytes copied per stage (gpushuffle.engine.copies) on the device path:
    # every row is gathered by the split and copied into its output once.
    after = client.run(_copied)
    copied = {
        k: sum(after[w][k] - copied_before[w][k] for w in after) for k in next(iter(after.values()))
    }
    assert copied["copied_split_bytes"] > 0 and copied["copied_unpack_bytes"] > 0, copied
    # Bytes read from a peer on this machine (same-host reads, TCP) are
    # copied once, by the receiver; the rest by both ends (test_samehost).
    read = delta["wire_bytes_read_from_peers"]
    assert copied["copied_send_bytes"] + read == copied["copied_receive_bytes"] > 0, copied
    assert_nothing_left_behind(client)


def test_shuffle_every_dtype_matches_tasks(gpu_client):
    check_against_tasks(gpu_client, gpu_frame(20_000), "key", 5)


def test_shuffle_string_and_multi_column_keys_ignore_index_empty_outputs(gpu_client):
    gdf = gpu_frame(3000, seed=3)[["key", "row", "s", "f", "c"]]
    gdf["s"] = gdf["s"].fillna("none")
    check_against_tasks(gpu_client, gdf, ["s", "key"], 7)
    # Few keys, many outputs: most outputs are empty.
    few = gdf.assign(key=gdf["key"] % 3)
    check_against_tasks(gpu_client, few, "key", 16, ignore_index=True)


def test_shuffle_with_tiny_device_and_host_budgets(gpu_client):
    import gpushuffle
    from gpushuffle.engine.memory import reset_worker_memory

    def budgets(limits, dask_worker=None):
        dask.config.set(limits)
        reset_worker_memory()

    tiny = {"gpushuffle.memory.device-limit": "256 KiB", "gpushuffle.memory.host-limit": "256 KiB"}
    defaults = {key: dask.config.get(key) for key in tiny}
    gpu_client.run(budgets, tiny)
    try:
        check_against_tasks(gpu_client, gpu_frame(20_000, seed=4), "key", 4)
        stats = gpushuffle.statistics(gpu_client)
        assert (stats["device_to_host_bytes"] > 0).all(), stats
        assert (stats["host_to_disk_bytes"] > 0).all(), stats
    finally:
        gpu_client.run(budgets, defaults)


def test_shuffle_with_compression_matches_tasks(gpu_client):
    """zstd on every frame between the workers: nvCOMP on device frames over
    UCX, pyarrow on host frames over TCP (same-host reads off, so that TCP
    carries the bytes)."""
    settings = {"gpushuffle.comm.compression": "zstd", "gpushuffle.comm.same-host-reads": False}
    defaults = {key: dask.config.get(key) for key in settings}
    gpu_client.run(lambda: dask.config.set(settings))
    try:
        before = gpu_client.run(_wire)
        with dask.config.set(settings):
            check_against_tasks(gpu_client, gpu_frame(20_000, seed=6), "key", 5)
        per_worker = wire_delta(gpu_client, before)
        compressed = sum(d["wire_compressed_frames"] for d in per_worker.values())
        decompressed = sum(d["wire_decompressed_frames"] for d in per_worker.values())
        assert compressed > 0 and decompressed == compressed, per_worker
    finally:
        gpu_client.run(lambda: dask.config.set(defaults))


def test_p2p_on_cudf_runs_on_gpushuffle(gpu_client):
    gdf = gpu_frame(2000)[["key", "row", "f"]]
    df = dd.from_pandas(gdf, npartitions=3)
    with dask.config.set({"gpushuffle.p2p-on-cudf": True}):
        out = df.shuffle("key", shuffle_method="p2p")
        assert any("gpushuffle-transfer" in str(k) for k in out.__dask_graph__())
        assert len(out) == 2000


@pytest.mark.parametrize("how", ["inner", "left", "outer", "leftsemi"])
def test_join_on_cudf_matches_pandas(gpu_client, how):
    """The fused hash join on the device: cuDF's merge of both sides' pieces."""
    import cudf

    rng = np.random.default_rng(7)
    left = pd.DataFrame(
        {"k": rng.integers(0, 400, 6000), "row": np.arange(6000), "x": rng.random(6000)}
    )
    right = pd.DataFrame({"k": np.arange(0, 500, 2), "y": np.arange(250).astype("f8")})
    gl = dd.from_pandas(cudf.from_pandas(left), npartitions=5, sort=False)
    gr = dd.from_pandas(cudf.from_pandas(right), npartitions=3, sort=False)
    with dask.config.set({"gpushuffle.p2p-on-cudf": True}):
        for method in ("gpushuffle", "p2p"):  # p2p on cuDF is routed to gpushuffle
            joined = gl.merge(gr, on="k", how=how, shuffle_method=method, broadcast=False)
            graph = joined.__dask_graph__()
            assert any("gpushuffle-join" in str(k) for k in graph), method
            ours = joined.compute().to_pandas()
            if how == "leftsemi":
                truth = left[left["k"].isin(right["k"])]
            else:
                truth = left.merge(right, on="k", how=how)
            assert len(ours) == len(truth), (method, how)
            key = list(truth.columns)
            pd.testing.assert_frame_equal(
                ours.sort_values(key).reset_index(drop=True)[list(truth.columns)],
                truth.sort_values(key).reset_index(drop=True),
                check_dtype=False,
            )
    assert_nothing_left_behind(gpu_client)


def test_join_on_a_categorical_key_and_with_an_empty_side(gpu_client):
    """docs/gpu-calls.md section 3, item 7: gpushuffle calls cuDF's merge
    without dask's merge_chunk, which unions categorical keys' categories
    and patches results with an empty side.

    Both sides share one CategoricalDtype: cuDF hashes a categorical column's
    codes (``hash_values``), so dask's partition ids, which every method
    uses, put equal values with different codes in different partitions
    (a limit of dask with cuDF: docs/gpu.md).
    """
    import cudf

    keys = pd.CategoricalDtype(list("abcdefgh"))
    left = pd.DataFrame({"k": list("abcabfgh") * 125, "row": np.arange(1000)})
    right = pd.DataFrame({"k": list("bcdeh"), "y": np.arange(5.0)})
    left["k"], right["k"] = left["k"].astype(keys), right["k"].astype(keys)
    gl = dd.from_pandas(cudf.from_pandas(left), npartitions=4, sort=False)
    gr = dd.from_pandas(cudf.from_pandas(right), npartitions=2, sort=False)
    cases = {
        "categorical key": (gl, gr, left, right),
        "empty right": (gl, gr[gr["y"] < 0], left, right[right["y"] < 0]),
        "empty left": (gl[gl["row"] < 0], gr, left[left["row"] < 0], right),
    }
    for name, (a, b, pa_, pb) in cases.items():
        for how in ("inner", "left", "outer"):
            joined = a.merge(
                b, on="k", how=how, npartitions=8, shuffle_method="gpushuffle", broadcast=False
            )
            assert any("gpushuffle-join" in str(k) for k in joined.__dask_graph__())
            ours = joined.compute().to_pandas()
            truth = pa_.merge(pb, on="k", how=how)
            assert len(ours) == len(truth), (name, how)
            ours["k"], truth["k"] = ours["k"].astype(object), truth["k"].astype(object)
            columns = list(truth.columns)
            pd.testing.assert_frame_equal(
                ours[columns].sort_values(["row", "k"]).reset_index(drop=True),
                truth.sort_values(["row", "k"]).reset_index(drop=True),
                check_dtype=False,
                obj=f"{name}, {how}",
            )
    assert_nothing_left_behind(gpu_client)


# -- the command line ---------------------------------------------------------


def test_cli_shuffle_on_cudf(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    pdf = _pandas_frame(20_000, 5)[["key", "row", "f", "s"]].reset_index(drop=True)
    for i in range(4):
        pdf.iloc[i * 5000 : (i + 1) * 5000].to_parquet(src / f"part-{i}.parquet", index=False)
    out = tmp_path / "out"
    gpushuffle = str(Path(sys.executable).parent / "gpushuffle")
    command = (
        [gpushuffle] if os.path.exists(gpushuffle) else [sys.executable, "-m", "gpushuffle.cli"]
    )
    proc = subprocess.run(
        [
            *command,
            "shuffle",
            str(src),
            str(out),
            "--on",
            "key",
            "--npartitions",
            "6",
            "--backend",
            "cudf",
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["rows"] == len(pdf) and summary["backend"] == "cudf"
    parts = [pd.read_parquet(f) for f in sorted(out.glob("part.*.parquet"))]
    assert len(parts) == 6
    keys = [set(p["key"]) for p in parts]
    assert sum(len(k) for k in keys) == len(set().union(*keys))  # each key in one file
    whole = pd.concat(parts, ignore_index=True)
    assert checksum(whole, index=False) == checksum(pdf.astype(whole.dtypes), index=False)
