"""Partition ids: gpushuffle's computation against dask's own, dtype by dtype.

The ids decide which output partition every row lands in; frames shuffled by
different methods (or by gpushuffle in different calls) line up only if they
are dask's exactly, so the truth here is dask's ``AssignPartitioningIndex``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushuffle._distributed import AssignPartitioningIndex
from gpushuffle.engine import partitioning
from gpushuffle.engine.partitioning import assign_partitioning_index


def _column(kind: str, rng: np.random.Generator, n: int) -> object:
    ints = rng.integers(-50, 50, n)
    missing = rng.random(n) < 0.2
    if kind == "int64":
        return ints
    if kind == "uint8":
        return ints.astype(np.uint8)
    if kind == "float64":
        values = rng.normal(size=n)
        values[missing] = np.nan
        values[rng.random(n) < 0.1] = -0.0
        values[rng.random(n) < 0.05] = np.inf
        return values
    if kind == "Int64":
        return pd.array(np.where(missing, None, ints), dtype="Int64")
    if kind == "Float64":
        return pd.array(np.where(missing, None, ints / 4), dtype="Float64")
    if kind == "bool":
        return rng.random(n) < 0.5
    if kind == "boolean":
        return pd.array(np.where(missing, None, ints > 0), dtype="boolean")
    if kind == "str":
        return pd.array([f"k{i}" for i in ints], dtype="str")
    if kind == "object":
        return np.array([f"k{i}" if i % 7 else None for i in ints], dtype=object)
    if kind == "category":
        return pd.Categorical([f"c{i % 5}" for i in ints])
    if kind == "category-int":
        return pd.Categorical(ints % 5)
    if kind == "datetime":
        return pd.to_datetime(ints, unit="D", origin="2020-01-01")
    if kind == "datetime-tz":
        return pd.to_datetime(ints, unit="h", origin="2020-01-01").tz_localize("Europe/Oslo")
    if kind == "timedelta":
        return pd.to_timedelta(ints, unit="s")
    raise AssertionError(kind)


KINDS = [
    "int64",
    "uint8",
    "float64",
    "Int64",
    "Float64",
    "bool",
    "boolean",
    "str",
    "object",
    "category",
    "category-int",
    "datetime",
    "datetime-tz",
    "timedelta",
]


def _dask_ids(df, on, npartitions, meta):
    return AssignPartitioningIndex.operation(df, on, "_partitions", npartitions, meta, False)


@pytest.fixture
def no_fallback(monkeypatch):
    """Fail if the computation hands the frame to dask's code."""

    class Refuse:
        @staticmethod
        def operation(*args, **kwargs):
            raise AssertionError("took dask's path")

    monkeypatch.setattr(partitioning, "AssignPartitioningIndex", Refuse)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    nkeys=st.integers(1, 3),
    repeat_a_key=st.booleans(),
    npartitions=st.sampled_from([1, 2, 7, 40, 1000, 40_000]),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**16),
)
def test_ids_are_dasks_for_every_dtype(kinds, nkeys, repeat_a_key, npartitions, n, seed):
    rng = np.random.default_rng(seed)
    data = {f"k{i}": _column(kind, rng, n) for i, kind in enumerate(kinds)}
    data["x"] = rng.random(n)
    df = pd.DataFrame(data, index=pd.Index(rng.permutation(n), name="i"))
    on = list(df.columns[: min(nkeys, len(kinds))])
    if repeat_a_key:
        on.append(on[0])
    meta = df.iloc[:0]
    expected = _dask_ids(df, on, npartitions, meta)
    with pytest.MonkeyPatch.context() as m:
        # The plain-column case must not fall back to dask's code.
        m.setattr(partitioning, "AssignPartitioningIndex", None)
        got = assign_partitioning_index(df, on, "_partitions", npartitions, meta, False)
    pd.testing.assert_frame_equal(got, expected)


def test_a_single_key_by_name_and_by_list(no_fallback):
    df = pd.DataFrame({"key": np.arange(500) * 7919, "v": np.arange(500.0)})
    meta = df.iloc[:0]
    for on in ("key", ["key"]):
        got = assign_partitioning_index(df, on, "_partitions", 40, meta, False)
        pd.testing.assert_frame_equal(
            got,
            AssignPartitioningIndex.operation(df, on, "_partitions", 40, meta, False),
        )
    assert got["_partitions"].dtype == np.int8
    assert got["_partitions"].nunique() == 40


def test_meta_decides_the_cast_as_in_dask(no_fallback):
    """Data whose dtype differs from meta's (dask's meta is often loose) is
    cast as meta says: int keys hash as float64, so 1 and 1.0 meet."""
    df = pd.DataFrame({"key": pd.array([1, 2, None, 4], dtype="Int64"), "v": [1.0] * 4})
    for meta in (df.iloc[:0], pd.DataFrame({"key": pd.Series([], dtype=object), "v": []})):
        got = assign_partitioning_index(df, ["key"], "_partitions", 3, meta, False)
        expected = AssignPartitioningIndex.operation(df, ["key"], "_partitions", 3, meta, False)
        pd.testing.assert_frame_equal(got, expected)


@pytest.mark.parametrize(
    "case",
    ["index-name", "index-shuffle", "multiindex-columns", "duplicate-columns", "cudf-like"],
)
def test_everything_else_is_dasks_own_computation(case):
    """Keys that are not plain columns of a pandas frame go to dask's code."""
    rng = np.random.default_rng(0)
    df = pd.DataFrame(
        {"a": rng.integers(0, 9, 50), "b": rng.random(50)},
        index=pd.Index(rng.integers(0, 5, 50), name="ix"),
    )
    on, index_shuffle = ["a"], False
    if case == "index-name":
        on = ["ix"]
    elif case == "index-shuffle":
        on, index_shuffle = ["_index"], True
    elif case == "multiindex-columns":
        df.columns = pd.MultiIndex.from_tuples([("a", "x"), ("b", "y")])
        on = ["a"]
    elif case == "duplicate-columns":
        df.columns = ["a", "a"]
    elif case == "cudf-like":
        df = _FrameSubclass(df)
    meta = df.iloc[:0]
    calls = []

    class Spy:
        @staticmethod
        def operation(*args):
            calls.append(args)
            return AssignPartitioningIndex.operation(*args)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(partitioning, "AssignPartitioningIndex", Spy)
        got = assign_partitioning_index(df, on, "_partitions", 7, meta, index_shuffle)
    assert len(calls) == 1
    expected = AssignPartitioningIndex.operation(df, on, "_partitions", 7, meta, index_shuffle)
    pd.testing.assert_frame_equal(pd.DataFrame(got), pd.DataFrame(expected))


class _FrameSubclass(pd.DataFrame):
    """Not a plain pandas DataFrame (as a cuDF frame is not)."""

    @property
    def _constructor(self):
        return _FrameSubclass


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    npartitions=st.sampled_from([1, 7, 300]),
    n=st.integers(0, 200),
    seed=st.integers(0, 2**16),
)
def test_join_ids_are_those_of_dasks_hash_join(kinds, npartitions, n, seed):
    """A join's side casts by its own dtypes (dask's ``HashJoinP2P``), not
    by meta's; the ids equal those of dask's computation, spelled out in
    ``partition_ids`` for the keys the plain path does not take."""
    from gpushuffle.engine import join

    rng = np.random.default_rng(seed)
    df = pd.DataFrame({f"k{i}": _column(kind, rng, n) for i, kind in enumerate(kinds)})
    on = list(df.columns)
    assert join.plain_keys(df, on, df) is not None
    got = join.partition_ids(df, on, npartitions, index_merge=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(join, "plain_keys", lambda *args: None)
        expected = join.partition_ids(df, on, npartitions, index_merge=False)
    np.testing.assert_array_equal(got, np.asarray(expected))
    assert got.dtype == np.asarray(expected).dtype
