"""The engine over real UCX (distributed-ucxx), on TCP transports: no GPU needed."""

from __future__ import annotations

import os

import dask
import dask.dataframe as dd
import pytest
from distributed import Client, LocalCluster
from test_shuffle import check, make_frame

pytest.importorskip("distributed_ucxx", reason="the ucx extra is not installed")

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def ucx_client():
    # Worker processes inherit these; UCX reads them when it starts.
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    with (
        dask.config.set({"distributed.comm.ucx.create-cuda-context": False}),
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            protocol="ucx",
            dashboard_address=":0",
            worker_dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


def test_shuffle_over_ucx(ucx_client):
    assert ucx_client.scheduler.address.startswith("ucx://")
    pdf = make_frame(5000, seed=21)
    df = dd.from_pandas(pdf, npartitions=6, sort=False)
    parts = check(
        df.shuffle(["key", "str"], npartitions=4, shuffle_method="gpushuffle"),
        df.shuffle(["key", "str"], npartitions=4, shuffle_method="tasks"),
        pdf,
    )
    for part in parts:
        assert part["row"].is_monotonic_increasing


def test_merge_over_ucx(ucx_client):
    pdf = make_frame(3000, seed=22)
    df = dd.from_pandas(pdf, npartitions=5, sort=False)
    right = dd.from_pandas(pdf[["key", "f"]].drop_duplicates("key"), npartitions=2)
    ours = df.merge(right, on="key", shuffle_method="gpushuffle", broadcast=False).compute()
    truth = pdf.merge(pdf[["key", "f"]].drop_duplicates("key"), on="key")
    assert len(ours) == len(truth)
    assert sorted(ours["row"]) == sorted(truth["row"])


def test_every_remote_shard_goes_through_its_backend_over_ucx(ucx_client):
    """Over UCX, distributed tries the ``cuda`` family first: it must reach Shard's."""
    from test_transport import shuffle_checking_the_wire

    shuffle_checking_the_wire(ucx_client, seed=23)


def test_device_stand_in_over_ucx(ucx_client):
    """Tables that refuse pickling cross UCX only through their serializers."""
    from test_transport import _wire, assert_every_shard_serialized, stand_in_shuffle, wire_delta

    before = ucx_client.run(_wire)
    stand_in_shuffle(ucx_client)
    assert_every_shard_serialized(wire_delta(ucx_client, before))
