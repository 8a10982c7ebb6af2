"""The cuDF backend and the device path, on a real GPU (skipped without one).

Run by ci/test_gpu.sh on GPU runners; on CPU CI these are collected and
skipped with the reason (see conftest.pytest_collection_modifyitems).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cuda_client():
    dask_cuda = pytest.importorskip("dask_cuda")
    from distributed import Client

    with (
        dask_cuda.LocalCUDACluster(protocol="ucx", rmm_pool_size="1GB") as cluster,
        Client(cluster) as client,
    ):
        yield client


def frame(n: int = 20_000, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "key": rng.integers(0, 500, n),
            "row": np.arange(n),
            "f": rng.random(n),
            "s": [f"s{i % 97}" for i in range(n)],
            "c": pd.Categorical(rng.choice(["x", "y", "z"], n)),
        },
        index=pd.Index(np.arange(n) * 3, name="idx"),
    )


def test_cudf_shuffle_matches_tasks(cuda_client):
    import dask.dataframe as dd
    from truth import checksum

    pdf = frame()
    gdf = dd.from_pandas(pdf, npartitions=6, sort=False).to_backend("cudf")
    ours = gdf.shuffle("key", npartitions=5, shuffle_method="gpushuffle")
    assert any("gpushuffle-transfer" in str(k) for k in ours.__dask_graph__())
    truth = gdf.shuffle("key", npartitions=5, shuffle_method="tasks")
    for i in range(5):
        a = ours.partitions[i].compute().to_pandas()
        b = truth.partitions[i].compute().to_pandas()
        assert len(a) == len(b)
        assert checksum(a) == checksum(b)
        assert a["row"].is_monotonic_increasing  # input order kept
        assert a.index.name == "idx"
        pd.testing.assert_series_equal(a.dtypes, b.dtypes)


def test_p2p_on_cudf_opt_in_routes_to_gpushuffle(cuda_client):
    import dask
    import dask.dataframe as dd

    gdf = dd.from_pandas(frame(1000), npartitions=3).to_backend("cudf")
    with dask.config.set({"gpushuffle.p2p-on-cudf": True}):
        graph = gdf.shuffle("key", shuffle_method="p2p").__dask_graph__()
    assert any("gpushuffle-transfer" in str(k) for k in graph)


def test_backend_round_trips_on_the_device():
    import cudf

    from gpushuffle.backends.cudf import CudfBackend

    pdf = frame(5000)
    pdf["_partitions"] = (pdf["key"] % 4).astype(np.int16)
    gdf = cudf.from_pandas(pdf)
    backend = CudfBackend()
    table, offsets = backend.split(gdf, "_partitions", np.arange(4, dtype=np.int16), 4, True)
    meta = gdf.iloc[:0].drop(columns="_partitions")
    for p in range(4):
        piece = backend.slice(table, int(offsets[p]), int(offsets[p + 1]))
        for moved in (piece, backend.to_device(backend.to_host(piece))):
            out = backend.assemble([moved], moved.nrows, meta, True).to_pandas()
            expected = pdf[pdf["_partitions"] == p].drop(columns="_partitions")
            pd.testing.assert_frame_equal(out, expected, check_dtype=False)
        for device_frames in (False, True):
            header, frames = backend.serialize(piece, device_frames=device_frames)
            back = backend.deserialize(header, frames)
            assert (
                backend.assemble([back], back.nrows, meta, True)
                .to_pandas()
                .equals(backend.assemble([piece], piece.nrows, meta, True).to_pandas())
            )
