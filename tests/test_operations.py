"""dask operations that shuffle, through shuffle_method="gpushuffle", equal to tasks."""

from __future__ import annotations

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from truth import canonical

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def frames():
    rng = np.random.default_rng(42)
    n = 3000
    left = pd.DataFrame(
        {"k": rng.integers(0, 400, n), "a": rng.random(n), "s": rng.choice(list("abcdef"), n)}
    )
    right = pd.DataFrame({"k": np.arange(0, 400, 2), "b": np.arange(200) * 1.5})
    return left, right


def both(build):
    ours = build("gpushuffle")
    truth = build("tasks")
    assert_takes_gpushuffle(ours)
    return ours, truth


def assert_takes_gpushuffle(collection) -> None:
    """The graph shuffles with gpushuffle, and with nothing else."""
    from dask.utils import key_split

    prefixes = {key_split(k) for k in collection.__dask_graph__()}
    assert "gpushuffle-transfer" in prefixes
    assert "gpushuffle-unpack" in prefixes or "gpushuffle-join" in prefixes
    others = {"shuffle-transfer", "hash-join-transfer", "shuffle-split", "shuffle-group"}
    assert not prefixes & others, prefixes & others


def test_merge(client, frames):
    left, right = frames
    dl = dd.from_pandas(left, npartitions=5)
    dr = dd.from_pandas(right, npartitions=3)
    for how in ("inner", "left", "outer"):
        ours, truth = both(
            lambda m, how=how: dl.merge(dr, on="k", how=how, shuffle_method=m, broadcast=False)
        )
        assert "gpushuffle" in str(ours.__dask_graph__().keys())
        a, b = ours.compute(), truth.compute()
        assert len(a) == len(b) == len(left.merge(right, on="k", how=how))
        pd.testing.assert_frame_equal(
            canonical(a.reset_index(drop=True)), canonical(b.reset_index(drop=True))
        )


def test_groupby_split_out(client, frames):
    left, _ = frames
    df = dd.from_pandas(left, npartitions=6)
    ours, truth = both(
        lambda m: df.groupby("k").agg({"a": "sum", "s": "count"}, split_out=4, shuffle_method=m)
    )
    assert ours.npartitions == 4
    pd.testing.assert_frame_equal(ours.compute().sort_index(), truth.compute().sort_index())
    pd.testing.assert_frame_equal(
        ours.compute().sort_index(),
        left.groupby("k").agg({"a": "sum", "s": "count"}),
        check_dtype=False,
    )


def test_set_index_and_sort_values(client, frames):
    left, _ = frames
    df = dd.from_pandas(left, npartitions=5)
    ours, truth = both(lambda m: df.set_index("k", shuffle_method=m))
    a, b = ours.compute(), truth.compute()
    assert a.index.is_monotonic_increasing
    pd.testing.assert_frame_equal(canonical(a), canonical(b))
    ours, truth = both(lambda m: df.sort_values("a", shuffle_method=m))
    pd.testing.assert_frame_equal(ours.compute(), truth.compute())
    # dask stores strings as string[pyarrow]; pandas here keeps its default.
    pd.testing.assert_frame_equal(
        ours.compute().reset_index(drop=True),
        left.sort_values("a").reset_index(drop=True),
        check_dtype=False,
    )


def test_drop_duplicates_split_out(client, frames):
    left, _ = frames
    df = dd.from_pandas(left[["k", "s"]], npartitions=5)
    ours, truth = both(lambda m: df.drop_duplicates(split_out=3, shuffle_method=m))
    a = ours.compute()
    pd.testing.assert_frame_equal(canonical(a), canonical(truth.compute()))
    assert len(a) == len(left[["k", "s"]].drop_duplicates())
