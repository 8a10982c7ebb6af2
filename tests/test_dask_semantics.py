"""Where dask's semantics decide, gpushuffle does what ``p2p`` and ``tasks`` do.

Regression tests for what dask's and distributed's own tests found (issue
33): values lost where a join left NaN in a column whose meta says int64, a
meta check that rejected dask's own ``set_index`` plans, ``ignore_index``
outputs that contradicted their meta, and a thread left behind.  Each is
compared with ``tasks`` (or ``p2p``) and pandas.
"""

from __future__ import annotations

import threading
import time

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.dataframe.utils import assert_eq
from distributed import Client, LocalCluster
from truth import checksum, partitions_of

pytestmark = pytest.mark.timeout(180)


# -- a wrong meta never costs values -------------------------------------------


def _sides(n: int = 400) -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(33)
    left = pd.DataFrame(
        {
            "k": np.arange(n),
            "i": rng.integers(-(2**40), 2**40, n),
            "flag": rng.random(n) < 0.5,
            "when": pd.Timestamp("2024-03-01") + pd.to_timedelta(np.arange(n), unit="h"),
            "g": rng.integers(0, 7, n),
        }
    )
    # Keys the left side lacks and keys it has, so that left and outer joins
    # leave nulls on both sides.
    right = pd.DataFrame({"k": np.arange(n // 2, n + n // 2), "r": rng.integers(0, 9, n)})
    return left, right


@pytest.mark.parametrize("how", ["left", "right", "outer"])
def test_nulls_a_join_brings_into_int_bool_and_time_columns_survive_a_shuffle(client, how):
    """dask keeps int64/bool meta where the join leaves NaN: the shuffle after
    it must keep the NaN (not -9223372036854775808, not True)."""
    left, right = _sides()
    expected = left.merge(right, on="k", how=how)
    assert expected["i"].isna().any() or expected["r"].isna().any()
    joined = dd.from_pandas(left, npartitions=4).merge(
        dd.from_pandas(right, npartitions=3), on="k", how=how, shuffle_method="gpushuffle"
    )
    assert joined._meta["i"].dtype == np.int64  # dask's meta: the trap
    ours = joined.shuffle("g", npartitions=5, shuffle_method="gpushuffle")
    truth = joined.shuffle("g", npartitions=5, shuffle_method="tasks")
    parts, truth_parts = partitions_of(ours), partitions_of(truth)
    whole = pd.concat(parts)
    assert len(whole) == len(expected)
    widened = {"i": "float64", "r": "float64", "flag": object}
    pd.testing.assert_frame_equal(
        whole.sort_values("k").reset_index(drop=True).astype(widened),
        expected.sort_values("k").reset_index(drop=True).astype(widened),
    )
    for i, (a, b) in enumerate(zip(parts, truth_parts, strict=True)):
        assert checksum(a.astype(b.dtypes.to_dict())) == checksum(b), i
        assert a["i"].isna().sum() == b["i"].isna().sum(), i
        # No integer column came back from NaN.
        if b["i"].isna().any():
            assert a["i"].dtype == np.float64, a.dtypes
    # Grouped afterwards, as users do: counts per flag, NaN kept as its own.
    got = (
        joined.shuffle("g", shuffle_method="gpushuffle")
        .groupby("g")
        .i.count(split_out=3, shuffle_method="gpushuffle")
        .compute()
    )
    pd.testing.assert_series_equal(
        got.sort_index(), expected.groupby("g").i.count().sort_index(), check_names=False
    )


def test_outer_join_then_groupby_apply_counts_as_pandas(client):
    """dask's test_shuffle_nulls_introduced: NaN in a bool group key after an
    outer join must not become True."""
    df1 = pd.DataFrame([[True], [False]] * 50, columns=["A"])
    df1["B"] = list(range(100))
    df2 = pd.DataFrame([[2, 3], [109, 2], [345, 3], [50, 7], [95, 1]], columns=["B", "C"])
    meta = pd.Series(dtype=int, index=pd.Index([], dtype=bool, name="A"), name="A")
    result = (
        dd.merge(
            dd.from_pandas(df1, npartitions=10),
            dd.from_pandas(df2, npartitions=1),
            how="outer",
            on="B",
            shuffle_method="gpushuffle",
        )
        .groupby("A")
        .apply(lambda df: len(df), meta=meta, include_groups=False, shuffle_method="gpushuffle")
    )
    expected = pd.merge(df1, df2, how="outer", on="B").groupby("A").apply(len, include_groups=False)
    assert_eq(result, expected, check_names=False, scheduler=None)


def test_handle_floats_in_int_meta(client):
    """distributed's regression test for issue 8183, with gpushuffle."""
    df1 = pd.DataFrame({"a": [1, 2]})
    df2 = pd.DataFrame({"b": [1]})
    ddf1 = dd.from_pandas(df1, npartitions=1)
    ddf2 = dd.from_pandas(df2, npartitions=1)
    merged = ddf1.merge(ddf2, left_on="a", right_on="b", how="left", shuffle_method="tasks")
    result = merged.shuffle("a", shuffle_method="gpushuffle").compute()
    assert result["b"].isna().sum() == 1
    assert result["b"].dropna().tolist() == [1.0]


def _floats_in_one_partition(part: pd.DataFrame, partition_info=None) -> pd.DataFrame:
    if partition_info["number"] == 0:
        part = part.astype({"v": "float64"})
        part.iloc[::7, part.columns.get_loc("v")] = np.nan
    return part


def test_a_loose_meta_gives_the_types_p2p_gives_and_loses_no_value(client):
    """One partition's int column is float with NaN, meta says int64: each
    output partition has the dtype p2p gives it, and every value."""
    pdf = pd.DataFrame({"key": np.arange(300) % 11, "v": np.arange(300)})
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    loose = df.map_partitions(_floats_in_one_partition, meta=df._meta, enforce_metadata=False)
    ours = partitions_of(loose.shuffle("key", npartitions=3, shuffle_method="gpushuffle"))
    p2p = partitions_of(loose.shuffle("key", npartitions=3, shuffle_method="p2p"))
    for a, b in zip(ours, p2p, strict=True):
        assert a["v"].dtype == b["v"].dtype, (a.dtypes, b.dtypes)
        assert checksum(a) == checksum(b)
    assert any(p["v"].dtype == np.float64 for p in ours)
    whole = pd.concat(ours)
    expected = _floats_in_one_partition(pdf.iloc[:75].copy(), {"number": 0})
    assert whole["v"].isna().sum() == expected["v"].isna().sum() > 0


def test_lossless_casts_still_follow_meta(client):
    """int32 and bool rows where meta says int64: cast, as before."""
    pdf = pd.DataFrame({"key": np.arange(200) % 5, "v": np.arange(200), "w": np.arange(200)})
    df = dd.from_pandas(pdf, npartitions=4, sort=False)

    def narrow(part):
        return part.astype({"v": "int32", "w": "bool"})

    loose = df.map_partitions(narrow, meta=df._meta, enforce_metadata=False)
    parts = partitions_of(loose.shuffle("key", npartitions=3, shuffle_method="gpushuffle"))
    assert all(p["v"].dtype == np.int64 and p["w"].dtype == np.int64 for p in parts)
    assert sorted(pd.concat(parts)["v"]) == list(range(200))


# -- dask's own plans -----------------------------------------------------------


@pytest.mark.parametrize("freq", ["-16h", "16h", "-1D"])
def test_set_index_on_a_derived_datetime_key(client, freq):
    """dask's meta for the partition column of this plan says datetime64."""
    values = {"x": [1, 2, 3, 4] * 3, "y": [10, 20, 30] * 4, "name": ["Alice", "Bob"] * 6}
    date_index = pd.date_range(start="2022-02-22", freq=freq, periods=12) - pd.Timedelta(seconds=30)
    df = pd.DataFrame(values, index=date_index)
    ddf = dd.from_pandas(df, npartitions=3, sort=False)
    with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
        result = ddf.set_index(ddf.index.dt.floor("D"))
        assert_eq(result, pd.DataFrame(values, index=date_index.floor("D")), scheduler=None)
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        truth = ddf.set_index(ddf.index.dt.floor("D"))
        assert_eq(result, truth, scheduler=None)


# -- ignore_index: meta and data agree -------------------------------------------


def _timeseries() -> dd.DataFrame:
    return dask.datasets.timeseries(
        "2000-01-01",
        "2000-03-01",
        types={"value": float, "name": str, "id": int},
        freq="2h",
        partition_freq="1W",
        seed=1,
    )


def test_ignore_index_keeps_an_index_meta_says_is_kept(client):
    """dask's meta keeps the index for every method but tasks: so do the data."""
    df = _timeseries()
    out = df.shuffle("id", ignore_index=True, shuffle_method="gpushuffle")
    assert out._meta.index.name == "timestamp"
    parts = partitions_of(out)
    for part in parts:
        assert part.index.name == "timestamp" and part.index.dtype == out._meta.index.dtype
    assert_eq(out, df.shuffle("id", ignore_index=True, shuffle_method="p2p"), scheduler=None)
    # What dask builds on that meta holds: the index becomes the same column.
    assert_eq(out.reset_index(), df.compute().reset_index(), check_index=False, scheduler=None)


def test_ignore_index_with_a_plain_index_sends_none_and_agrees_with_meta(client):
    pdf = pd.DataFrame({"key": np.arange(500) % 13, "v": np.arange(500)})
    df = dd.from_pandas(pdf, npartitions=5, sort=False)
    out = df.shuffle("key", npartitions=4, ignore_index=True, shuffle_method="gpushuffle")
    parts = partitions_of(out)
    truth = partitions_of(
        df.shuffle("key", npartitions=4, ignore_index=True, shuffle_method="tasks")
    )
    for a, b in zip(parts, truth, strict=True):
        assert checksum(a, index=False) == checksum(b, index=False)
    for part in parts:
        assert isinstance(part.index, pd.RangeIndex) and part.index.start == 0
        assert part.index.dtype == out._meta.index.dtype
        assert part.index.name == out._meta.index.name
    assert sorted(pd.concat(parts)["v"]) == list(range(500))


# -- nothing left behind ------------------------------------------------------------


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_no_thread_or_pool_memory_left_once_an_in_process_cluster_closes():
    """distributed's test harness allows 5 s for threads a test started to end."""
    from gpushuffle.engine.pool import host_pool

    before = _threads()
    pdf = pd.DataFrame({"key": np.arange(400_000) % 101, "v": np.arange(400_000)})
    with (
        LocalCluster(n_workers=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        df = dd.from_pandas(pdf, npartitions=4, sort=False)
        out = df.shuffle("key", npartitions=3, shuffle_method="gpushuffle")
        assert len(out.compute()) == len(pdf)
        assert "gpushuffle-host-pool-trimmer" in _threads()
        del client
    deadline = time.monotonic() + 5
    while "gpushuffle-host-pool-trimmer" in _threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {name for name in _threads() - before if name.startswith("gpushuffle")}
    assert not left, left
    usage = host_pool().usage()
    assert not any(usage.values()), usage


# -- errors in p2p's words ------------------------------------------------------------


@pytest.mark.parametrize("phase", ["transfer", "unpack"])
def test_a_failure_reads_as_p2p_words_it_with_the_real_error_as_cause(phase):
    from gpushuffle.engine.tasks import _phase_errors

    cause = ValueError("the real reason")
    expected = rf"^P2P abc failed during {phase} phase"
    with (
        pytest.raises(RuntimeError, match=expected) as info,
        _phase_errors("abc", phase, "input partition 3"),
    ):
        raise cause
    assert info.value.__cause__ is cause
    assert "the real reason" in str(info.value) and "input partition 3" in str(info.value)


# -- what dask's own tests check of a method's expressions ------------------------------


def test_a_join_of_a_column_to_a_string_index(client):
    """dask's test_join_by_index_patterns: meta's index is an Index of
    pandas' string dtype, no numpy array (the unpack failed on it)."""
    pdl = pd.DataFrame({"a": list("abcdefg"), "b": [7, 6, 5, 4, 3, 2, 1]}, index=list("abcdefg"))
    pdr = pd.DataFrame({"c": list("abdg"), "d": [5, 4, 3, 2]}, index=list("abdg"))
    ddl, ddr = dd.from_pandas(pdl, 3), dd.from_pandas(pdr, 2)
    for how in ("inner", "left", "outer"):
        out = ddl.join(ddr, how=how, on="a", shuffle_method="gpushuffle").compute()
        expected = pdl.join(pdr, how=how, on="a")
        assert_eq(out.sort_values("b"), expected.sort_values("b"), check_index=False)


def test_column_projections_reach_the_inputs_of_a_gpushuffle_join():
    """dask's test_merge_combine_similar_intermediate_projections, for
    gpushuffle's join expression (dask's test asks for its own classes)."""
    from gpushuffle.api import GPUHashJoin

    pdf = pd.DataFrame({"a": range(1, 11), "b": 1, "c": 1})
    pdf2 = pd.DataFrame({"a": range(1, 11), "x": 1})
    pdf3 = pd.DataFrame({"d": range(1, 11), "e": 1, "y": 1})
    df, df2, df3 = (dd.from_pandas(p, npartitions=n) for p, n in ((pdf, 2), (pdf2, 3), (pdf3, 3)))
    with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
        q = df.merge(df2).merge(df3, left_on="b", right_on="d")[["b", "x", "y"]]
        q["new"] = q.b + q.x
        joins = [e for e in q.optimize(fuse=False).walk() if isinstance(e, GPUHashJoin)]
    columns = sorted((list(j.left.columns), list(j.right.columns)) for j in joins)
    # "c" and "e" are never read: no shuffle carries them.
    assert columns == [(["a", "b"], ["a", "x"]), (["b", "x"], ["d", "y"])], columns


@pytest.mark.parametrize("func", ["set_index", "sort_values", "shuffle"])
def test_the_method_in_effect_when_a_frame_is_built_is_kept(client, func):
    """dask's test_respect_context_shuffle, for gpushuffle's expression."""
    from gpushuffle.api import GPUShuffle

    df = dd.from_pandas(pd.DataFrame({"x": list(range(20)) * 5, "y": range(100)}), 10)
    with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
        q = getattr(df, func)("x")
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        result = q.optimize(fuse=False)
    assert any(isinstance(e, GPUShuffle) for e in result.walk())
