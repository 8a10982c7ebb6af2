"""Bad input fails early, with an error that names the problem and the fix."""

from __future__ import annotations

import threading

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from test_shuffle import check, make_frame

import gpushuffle

pytestmark = pytest.mark.timeout(120)


def test_missing_key_column_fails_at_graph_construction(client):
    df = dd.from_pandas(make_frame(100), npartitions=2)
    with pytest.raises(KeyError, match="nope"):
        gpushuffle.shuffle(df, "nope")
    with pytest.raises(KeyError, match="nope"):
        df.shuffle(["key", "nope"], shuffle_method="gpushuffle")


def test_npartitions_below_one(client):
    df = dd.from_pandas(make_frame(100), npartitions=2)
    with pytest.raises(ValueError, match="at least 1"):
        gpushuffle.shuffle(df, "key", npartitions=0)
    with pytest.raises(ValueError, match="at least 1"):
        gpushuffle.shuffle(df, "key", npartitions=-3)


def test_complex_sparse_and_non_string_column_names_work(client):
    """What numpy and pandas can carry, gpushuffle carries: no needless rejection."""
    rng = np.random.default_rng(3)
    n = 600
    pdf = pd.DataFrame(
        {
            "key": rng.integers(0, 20, n),
            1: rng.random(n) + 1j * rng.random(n),
            ("a", "b"): pd.arrays.SparseArray(np.where(rng.random(n) < 0.9, 0.0, 1.0)),
            2.5: np.arange(n),
        }
    )
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    parts = check(
        df.shuffle("key", npartitions=3, shuffle_method="gpushuffle"),
        df.shuffle("key", npartitions=3, shuffle_method="tasks"),
        pdf,
    )
    assert list(parts[0].columns) == list(pdf.columns)
    assert isinstance(parts[0][("a", "b")].dtype, pd.SparseDtype)


def test_partition_with_a_different_dtype_names_partition_and_column(client):
    pdf = make_frame(400)
    df = dd.from_pandas(pdf, npartitions=4, sort=False)

    def break_partition_two(part, partition_info=None):
        if partition_info["number"] == 2:
            part = part.assign(f=pd.Timestamp("2020-01-01"))
        return part

    # enforce_metadata=False: dask's own check would catch this first.
    broken = df.map_partitions(break_partition_two, meta=df._meta, enforce_metadata=False)
    with pytest.raises(gpushuffle.ShuffleInputError, match=r"column 'f' of input partition 2"):
        broken.shuffle("key", shuffle_method="gpushuffle").compute()


def test_partition_with_other_columns_names_them(client):
    df = dd.from_pandas(make_frame(400), npartitions=4, sort=False)

    def drop_in_one(part, partition_info=None):
        return part.drop(columns="b") if partition_info["number"] == 1 else part

    broken = df.map_partitions(drop_in_one, meta=df._meta, enforce_metadata=False)
    with pytest.raises(gpushuffle.ShuffleInputError, match=r"input partition 1 .*missing: \['b'\]"):
        broken.shuffle("key", shuffle_method="gpushuffle").compute()


def _frame_with_locks(i: int) -> pd.DataFrame:
    return pd.DataFrame(
        {"key": np.arange(100) + 100 * i, "lock": pd.Series([threading.Lock()] * 100, dtype=object)}
    )


def test_unpicklable_values_name_the_column(client):
    meta = pd.DataFrame({"key": np.array([], np.int64), "lock": pd.Series([], dtype=object)})
    # Built on the workers: locks cannot even be tokenized on the client; and
    # without convert-string dask would turn them into strings first.
    with dask.config.set({"dataframe.convert-string": False}):
        df = dd.from_map(_frame_with_locks, range(2), meta=meta, enforce_metadata=False)
        shuffled = df.shuffle("key", npartitions=4, shuffle_method="gpushuffle")
        # Locks cannot leave their worker, and some rows must go to the other one.
        with pytest.raises(
            gpushuffle.ShuffleInputError,
            match=r"column 'lock' of input partition \d holds values that cannot be pickled",
        ):
            shuffled.compute()


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_without_a_distributed_cluster_the_error_says_to_start_one(scheduler):
    """dask's local schedulers cannot run a P2P shuffle: the error names
    gpushuffle, the missing client and the method that runs anywhere, not
    distributed's message about ``shuffle='p2p'``."""
    pdf = make_frame(200)
    df = dd.from_pandas(pdf, npartitions=3)
    other = dd.from_pandas(pdf[["key"]].drop_duplicates(), npartitions=2)
    for collection in (
        df.shuffle(on="key", shuffle_method="gpushuffle"),
        df.merge(other, on="key", shuffle_method="gpushuffle"),
    ):
        with pytest.raises(gpushuffle.ShuffleSchedulerError) as info:
            collection.compute(scheduler=scheduler)
        message = str(info.value)
        assert "distributed" in message and "Client()" in message, message
        assert "shuffle_method='tasks'" in message and "p2p" not in message, message
    # With the method that runs anywhere, the same data shuffles.
    out = df.shuffle(on="key", shuffle_method="tasks").compute(scheduler=scheduler)
    assert len(out) == len(pdf)
