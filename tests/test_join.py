"""Joins on gpushuffle: results against pandas, dask's lowering decisions, dask's own tests.

Results are compared with pandas' ``merge`` of the whole frames (row counts
and order-independent checksums, via :mod:`truth`), computed on the session
cluster (real worker processes over TCP).  Worker loss during a join is in
``test_join_faults.py``.
"""

from __future__ import annotations

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.utils import key_split
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from truth import checksum

from gpushuffle.api import GPUHashJoin, GPUJoin, takes_gpushuffle

pytestmark = pytest.mark.timeout(240)

HOWS = ["inner", "left", "right", "outer", "leftsemi"]


def task_prefixes(collection) -> set[str]:
    """Prefixes of the keys of ``collection``'s graph (``gpushuffle-join``, ...)."""
    from dask.utils import key_split

    return {key_split(k) for k in collection.__dask_graph__()}


def pandas_truth(left: pd.DataFrame, right: pd.DataFrame, how: str, **kwargs) -> pd.DataFrame:
    """pandas' answer; ``leftsemi`` (which pandas lacks) as the left rows with a match."""
    if how != "leftsemi":
        return left.merge(right, how=how, **kwargs)
    on = [kwargs.get("on") or kwargs["left_on"]]
    right_on = [kwargs.get("on") or kwargs["right_on"]]
    keys = right[right_on].drop_duplicates()
    matched = left[on].merge(keys, left_on=on, right_on=right_on, how="left", indicator=True)
    return left[(matched["_merge"] == "both").to_numpy()]


def comparable(df: pd.DataFrame) -> pd.DataFrame:
    """Values only: categoricals and string dtypes as object strings, no index."""
    out = df.reset_index(drop=True)
    for name in out.columns:
        dtype = out[name].dtype
        if isinstance(dtype, pd.CategoricalDtype) or pd.api.types.is_string_dtype(dtype):
            out[name] = out[name].astype(object).where(out[name].notna(), None)
        elif isinstance(dtype, pd.Int64Dtype):
            out[name] = out[name].astype("float64")
    return out


def assert_same_rows(ours: pd.DataFrame, expected: pd.DataFrame) -> None:
    a, b = comparable(ours), comparable(expected)
    assert list(a.columns) == list(b.columns)
    assert len(a) == len(b), f"{len(a)} rows, pandas has {len(b)}"
    # Sum of per-row hashes: the same multiset of rows, in any order.
    assert checksum(a, index=False) == checksum(b, index=False), "rows differ from pandas"


def assert_meta_matches(collection, computed: pd.DataFrame) -> None:
    meta = collection._meta
    assert list(computed.columns) == list(meta.columns)
    for name in meta.columns:
        expected, actual = meta[name].dtype, computed[name].dtype
        if isinstance(expected, pd.CategoricalDtype):
            assert isinstance(actual, pd.CategoricalDtype), name
        elif expected.kind in "iub" and actual.kind == "f" and computed[name].isna().any():
            continue  # missing matches of a non-inner join, as with p2p and tasks
        else:
            assert actual == expected, f"{name}: {actual} != meta's {expected}"


# -- property tests against pandas ----------------------------------------------


@st.composite
def join_inputs(draw):
    """Two frames sharing a key column: nulls, duplicates, skew, empties, strings, categories."""
    kind = draw(st.sampled_from(["int", "float", "string", "category", "nullable"]))
    n_left = draw(st.integers(0, 120))
    n_right = draw(st.integers(0, 60))
    nkeys = draw(st.integers(1, 30))
    skew = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)

    def keys(n: int):
        if skew:  # most rows on one key: one output partition gets nearly everything
            values = np.where(rng.random(n) < 0.8, 0, rng.integers(0, nkeys, n))
        else:
            values = rng.integers(0, nkeys, n)
        nulls = rng.random(n) < 0.1
        if kind == "int":
            return values
        if kind == "float":
            return np.where(nulls, np.nan, values.astype(float))
        if kind == "nullable":
            out = pd.array(values, dtype="Int64")
            out[nulls] = pd.NA
            return out
        strings = pd.array([f"k{v}" for v in values], dtype="string[pyarrow]")
        strings[nulls] = pd.NA
        if kind == "category":
            categories = pd.Index([f"k{v}" for v in range(nkeys)], dtype="str")
            return pd.Categorical(strings.astype(object), categories=categories)
        return strings

    left = pd.DataFrame(
        {
            "k": keys(n_left),
            "a": rng.integers(0, 10**6, n_left),
            "s": pd.array([f"l{i % 7}" for i in range(n_left)], dtype="string[pyarrow]"),
            "c": pd.Categorical(rng.choice(["x", "y", "z"], n_left)),
        }
    )
    right = pd.DataFrame(
        {
            "k": keys(n_right),
            "b": rng.random(n_right),
            "s": pd.array([f"r{i % 5}" for i in range(n_right)], dtype="string[pyarrow]"),
        }
    )
    # Categorical keys share their categories on both sides: with categories
    # that differ, dask's meta says "str" while partitions where one side
    # is all null stay categorical, and dask's own methods (p2p, tasks) fail
    # to concatenate them.
    return left, right, draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(2, 5))


@pytest.mark.parametrize("how", HOWS)
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=join_inputs())
def test_join_matches_pandas(client, how, data):
    left, right, nleft, nright, npartitions = data
    if how == "leftsemi":
        right = right[["k"]]
    dleft = dd.from_pandas(left, npartitions=nleft, sort=False)
    dright = dd.from_pandas(right, npartitions=nright, sort=False)
    joined = dleft.merge(
        dright, on="k", how=how, npartitions=npartitions, shuffle_method="gpushuffle"
    )
    result = joined.compute()
    assert_same_rows(result, pandas_truth(left, right, how, on="k"))


# -- the join's shape and features ------------------------------------------------


def frames(n_left: int = 3000, n_right: int = 700, seed: int = 0):
    rng = np.random.default_rng(seed)
    left = pd.DataFrame(
        {
            "k1": rng.integers(0, 60, n_left),
            "k2": pd.array([f"g{v}" for v in rng.integers(0, 3, n_left)], dtype="string[pyarrow]"),
            "v": rng.random(n_left),
            "shared": rng.integers(0, 9, n_left),
        },
        index=pd.Index(np.arange(n_left) * 2, name="idx"),
    )
    right = pd.DataFrame(
        {
            "k1": rng.integers(0, 70, n_right),
            "k2": pd.array([f"g{v}" for v in rng.integers(0, 3, n_right)], dtype="string[pyarrow]"),
            "w": rng.integers(0, 100, n_right),
            "shared": rng.random(n_right),
        },
        index=pd.Index(np.arange(n_right) * 3, name="idx"),
    )
    return left, right


def test_steps_after_the_join_run_in_its_tasks(client):
    """Blockwise steps after a gpushuffle join are fused into the tasks that
    merge its outputs (no join keys of their own), and the result, also of
    a selection of partitions, is pandas'."""
    left, right = frames(seed=3)
    dleft = dd.from_pandas(left, npartitions=5, sort=False)
    dright = dd.from_pandas(right, npartitions=4, sort=False)
    joined = dleft.merge(dright, on="k1", shuffle_method="gpushuffle")
    after = joined[joined["v"] > 0.25].assign(w=lambda d: d["v"] * 2)
    prefixes = {key_split(k) for k in after.optimize().__dask_graph__()}
    assert "gpushuffle-join" not in prefixes
    assert any(p.split("-")[0] == "gpushuffle" and p != "gpushuffle-transfer" for p in prefixes)
    expected = left.merge(right, on="k1")
    expected = expected[expected["v"] > 0.25].assign(w=lambda d: d["v"] * 2)
    assert_same_rows(after.compute(), expected)
    # Each partition alone (a filtered graph each): together pandas' rows.
    singles = [after.partitions[i].compute() for i in range(after.npartitions)]
    assert_same_rows(pd.concat(singles), expected)
    assert_same_rows(after.partitions[[3, 0]].compute(), pd.concat([singles[3], singles[0]]))


def test_join_of_persisted_frames_runs_no_alias_tasks(client):
    """The transfers of both sides read persisted partitions directly (see
    ``test_transfers_read_persisted_partitions_without_alias_tasks``)."""
    from distributed import get_task_stream, wait

    left, right = frames(seed=5)
    dleft = dd.from_pandas(left, npartitions=5, sort=False).persist()
    dright = dd.from_pandas(right, npartitions=4, sort=False).persist()
    wait([dleft, dright])
    aliases = {dleft.expr._name, dright.expr._name}
    joined = dleft.merge(dright, on="k1", shuffle_method="gpushuffle")
    with get_task_stream(client) as stream:
        result = joined.compute()
    ran = [t["key"] for t in stream.data]
    assert not any(isinstance(k, tuple) and k[0] in aliases for k in ran), ran
    assert sum(key_split(k) == "gpushuffle-transfer" for k in ran) == 9
    assert_same_rows(result, left.merge(right, on="k1"))
    assert_meta_matches(joined, result)


def test_graph_is_one_fused_join(client):
    left, right = frames()
    dleft = dd.from_pandas(left, npartitions=5, sort=False)
    dright = dd.from_pandas(right, npartitions=4, sort=False)
    joined = dleft.merge(dright, on="k1", shuffle_method="gpushuffle")
    prefixes = task_prefixes(joined)
    # Two runs (one per side), one merge task per output: no separate unpack
    # tasks, no blockwise merge of shuffled sides.
    assert {"gpushuffle-transfer", "shuffle-barrier", "gpushuffle-join"} <= prefixes
    assert "gpushuffle-unpack" not in prefixes
    assert not any(p.startswith(("merge", "blockwisemerge", "hash-join")) for p in prefixes)
    graph = joined.__dask_graph__()
    assert sum(1 for k in graph if str(k).startswith("shuffle-barrier")) == 2
    expr = joined.optimize().expr
    assert isinstance(expr, GPUJoin) and isinstance(expr.join, GPUHashJoin)
    assert joined.npartitions == 5
    result = joined.compute()
    assert_same_rows(result, left.merge(right, on="k1"))
    assert_meta_matches(joined, result)


def test_outputs_line_up_with_dask_p2p_join(client):
    """Partition j holds the rows p2p's hash join puts in partition j."""
    left, right = frames(seed=1)
    dleft = dd.from_pandas(left, npartitions=4, sort=False)
    dright = dd.from_pandas(right, npartitions=3, sort=False)
    ours = dleft.merge(dright, on="k1", how="outer", shuffle_method="gpushuffle")
    p2p = dleft.merge(dright, on="k1", how="outer", shuffle_method="p2p")
    assert "hash-join-transfer" in task_prefixes(p2p)
    a, b = dask.compute(ours.to_delayed(), p2p.to_delayed())
    for i, (x, y) in enumerate(zip(dask.compute(*a), dask.compute(*b), strict=True)):
        assert len(x) == len(y), f"partition {i}"
        assert checksum(comparable(x), index=False) == checksum(comparable(y), index=False)
    pd.testing.assert_frame_equal(ours._meta, p2p._meta)


@pytest.mark.parametrize("how", ["inner", "left", "right", "outer"])
def test_several_keys_suffixes_indicator(client, how):
    left, right = frames(seed=2)
    dleft = dd.from_pandas(left, npartitions=4, sort=False)
    dright = dd.from_pandas(right, npartitions=5, sort=False)
    kwargs = dict(on=["k1", "k2"], how=how, suffixes=("_l", "_r"), indicator=True)
    joined = dleft.merge(dright, shuffle_method="gpushuffle", **kwargs)
    assert "gpushuffle-join" in task_prefixes(joined)
    result = joined.compute()
    assert "shared_l" in result.columns and "_merge" in result.columns
    assert_same_rows(result, left.merge(right, **kwargs))
    assert_meta_matches(joined, result)


def test_left_on_right_on_with_different_names_and_dtypes(client):
    left, right = frames(seed=3)
    right = right.rename(columns={"k1": "rk"})
    right["rk"] = right["rk"].astype("float64")  # int against float: dask hashes both as float
    dleft = dd.from_pandas(left, npartitions=3, sort=False)
    dright = dd.from_pandas(right, npartitions=3, sort=False)
    joined = dleft.merge(dright, left_on="k1", right_on="rk", shuffle_method="gpushuffle")
    assert "gpushuffle-join" in task_prefixes(joined)
    assert_same_rows(joined.compute(), left.merge(right, left_on="k1", right_on="rk"))


@pytest.mark.parametrize("how", ["inner", "left", "outer"])
def test_index_joins(client, how):
    left, right = frames(seed=4)
    left = left.set_index("k1")
    right = right.set_index("k1").drop(columns=["k2"])
    # Unknown divisions: dask hashes the index, as p2p does.
    dleft = dd.from_pandas(left, npartitions=4, sort=False)
    dright = dd.from_pandas(right, npartitions=3, sort=False)
    assert not dleft.known_divisions
    joined = dleft.merge(
        dright, left_index=True, right_index=True, how=how, shuffle_method="gpushuffle"
    )
    assert "gpushuffle-join" in task_prefixes(joined)
    result = joined.compute()
    expected = left.merge(right, left_index=True, right_index=True, how=how)
    # The index is the join key here: it must travel and come out right.
    assert sorted(result.index.tolist()) == sorted(expected.index.tolist())
    assert_same_rows(result.reset_index(), expected.reset_index())
    # An index on one side, a column on the other.
    mixed = dleft.merge(
        dd.from_pandas(right.reset_index(), npartitions=3, sort=False),
        left_index=True,
        right_on="k1",
        how=how,
        shuffle_method="gpushuffle",
    )
    assert "gpushuffle-join" in task_prefixes(mixed)
    expected = left.merge(right.reset_index(), left_index=True, right_on="k1", how=how)
    assert_same_rows(mixed.compute().reset_index(), expected.reset_index())


def test_join_on_index_name_and_dataframe_join(client):
    left, right = frames(seed=5)
    # Unknown divisions: the join hashes the index (known ones would align).
    dleft = dd.from_pandas(left, npartitions=3).clear_divisions()
    dright = dd.from_pandas(right[["w"]], npartitions=4).clear_divisions()
    joined = dleft.join(dright, how="left", shuffle_method="gpushuffle")
    assert "gpushuffle-join" in task_prefixes(joined)
    assert_same_rows(
        joined.compute().reset_index(), left.join(right[["w"]], how="left").reset_index()
    )
    on_name = dleft.merge(dright, on="idx", shuffle_method="gpushuffle")
    assert "gpushuffle-join" in task_prefixes(on_name)
    assert_same_rows(
        on_name.compute().reset_index(), left.merge(right[["w"]], on="idx").reset_index()
    )


def test_empty_sides_and_empty_outputs(client):
    left, right = frames(200, 50, seed=6)
    dleft = dd.from_pandas(left, npartitions=3, sort=False)
    dright = dd.from_pandas(right, npartitions=2, sort=False)
    none = dright[dright.w < 0]  # every partition empty
    for how in HOWS:
        r = none[["k1"]] if how == "leftsemi" else none
        joined = dleft.merge(r, on="k1", how=how, npartitions=6, shuffle_method="gpushuffle")
        result = joined.compute()
        assert_same_rows(result, pandas_truth(left, right.iloc[:0][r.columns], how, on="k1"))
        assert_meta_matches(joined, result)
    # Many outputs, few keys: most output partitions receive nothing.
    few = dleft.assign(k1=dleft.k1 % 2)
    joined = few.merge(dright, on="k1", npartitions=12, shuffle_method="gpushuffle")
    parts = dask.compute(*joined.to_delayed())
    assert sum(1 for p in parts if not len(p)) >= 9
    for p in parts:
        assert_meta_matches(joined, p)


def test_head_and_partitions_compute_some_outputs(client):
    left, right = frames(seed=7)
    dleft = dd.from_pandas(left, npartitions=4, sort=False)
    dright = dd.from_pandas(right, npartitions=4, sort=False)
    joined = dleft.merge(dright, on="k1", shuffle_method="gpushuffle")
    # (p2p's own `.partitions[2]` fails in dask 2026.7: its keys are numbered
    # by partition, not by position; all of p2p's outputs are the truth.)
    p2p = dask.compute(*dleft.merge(dright, on="k1", shuffle_method="p2p").to_delayed())
    for i in (2, 0):
        one = joined.partitions[i].compute()
        assert len(one) == len(p2p[i])
        assert checksum(comparable(one), index=False) == checksum(comparable(p2p[i]), index=False)
    two = joined.partitions[[1, 3]].compute()
    assert len(two) == len(p2p[1]) + len(p2p[3])
    assert len(joined.head(5, npartitions=2)) == 5


def test_config_default_method_and_len(client):
    left, right = frames(seed=8)
    dleft = dd.from_pandas(left, npartitions=4, sort=False)
    dright = dd.from_pandas(right, npartitions=4, sort=False)
    with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
        joined = dleft.merge(dright, on="k1")
        assert "gpushuffle-join" in task_prefixes(joined)
        assert len(joined) == len(left.merge(right, on="k1"))


def test_pyarrow_decimal_and_date_columns(client):
    """What dd.read_parquet gives for TPC-H's money and dates travels unchanged."""
    import datetime
    import decimal

    import pyarrow as pa

    rng = np.random.default_rng(9)
    n = 500
    left = pd.DataFrame(
        {
            "k": rng.integers(0, 40, n),
            "price": pd.array(
                [decimal.Decimal(f"{v}.25") for v in rng.integers(0, 999, n)],
                dtype=pd.ArrowDtype(pa.decimal128(15, 2)),
            ),
            "day": pd.array(
                [
                    datetime.date(1995, 1, 1) + datetime.timedelta(days=int(d))
                    for d in rng.integers(0, 900, n)
                ],
                dtype=pd.ArrowDtype(pa.date32()),
            ),
        }
    )
    right = pd.DataFrame({"k": np.arange(30), "name": [f"n{i}" for i in range(30)]})
    dleft = dd.from_pandas(left, npartitions=3, sort=False)
    dright = dd.from_pandas(right, npartitions=2, sort=False)
    joined = dleft.merge(dright, on="k", how="left", shuffle_method="gpushuffle")
    result = joined.compute()
    assert result["price"].dtype == left["price"].dtype
    assert result["day"].dtype == left["day"].dtype
    expected = left.merge(right, on="k", how="left")
    assert result["price"].sum() == expected["price"].sum()
    assert sorted(result["day"].tolist()) == sorted(expected["day"].tolist())
    assert len(result) == len(expected)


# -- dask's lowering decisions, kept ------------------------------------------------


def test_single_partition_side_is_broadcast_blockwise(client):
    left, right = frames(seed=10)
    dleft = dd.from_pandas(left, npartitions=6, sort=False)
    dright = dd.from_pandas(right, npartitions=1, sort=False)
    for method in ("gpushuffle", "tasks"):
        joined = dleft.merge(dright, on="k1", shuffle_method=method)
        prefixes = task_prefixes(joined)
        assert not any("gpushuffle" in p or p == "shuffle-barrier" for p in prefixes), method
    joined = dleft.merge(dright, on="k1", shuffle_method="gpushuffle")
    assert_same_rows(joined.compute(), left.merge(right, on="k1"))


def _is_broadcast(collection) -> bool:
    from gpushuffle._distributed import BroadcastJoin

    return any(isinstance(e, BroadcastJoin) for e in collection.optimize().expr.walk())


@pytest.mark.parametrize("how", ["inner", "left"])
def test_broadcast_join_by_bias_like_p2p(client, how):
    left, right = frames(4000, 300, seed=11)
    # 2 against 32 partitions: 2 < log2(32) * 0.5, dask's broadcast rule.
    dleft = dd.from_pandas(left, npartitions=32, sort=False)
    dright = dd.from_pandas(right, npartitions=2, sort=False)
    ours = dleft.merge(dright, on="k1", how=how, shuffle_method="gpushuffle")
    p2p = dleft.merge(dright, on="k1", how=how, shuffle_method="p2p")
    assert _is_broadcast(p2p)
    assert _is_broadcast(ours)
    prefixes = task_prefixes(ours)
    assert "gpushuffle-join" not in prefixes
    if how == "inner":
        assert not any("gpushuffle" in p for p in prefixes)
    else:
        # A non-inner broadcast join shuffles the small side first: on gpushuffle.
        assert "gpushuffle-transfer" in prefixes and "gpushuffle-unpack" in prefixes
    assert_same_rows(ours.compute(), left.merge(right, on="k1", how=how))


def test_broadcast_argument_is_obeyed(client):
    left, right = frames(seed=12)
    dleft = dd.from_pandas(left, npartitions=4, sort=False)
    dright = dd.from_pandas(right, npartitions=3, sort=False)
    forced = dleft.merge(dright, on="k1", broadcast=True, shuffle_method="gpushuffle")
    assert _is_broadcast(forced)
    assert_same_rows(forced.compute(), left.merge(right, on="k1"))
    dleft32 = dd.from_pandas(left, npartitions=32, sort=False)
    dright2 = dd.from_pandas(right, npartitions=2, sort=False)
    refused = dleft32.merge(dright2, on="k1", broadcast=False, shuffle_method="gpushuffle")
    assert not _is_broadcast(refused)
    assert "gpushuffle-join" in task_prefixes(refused)
    # A float is the bias: 0.1 * log2(32) < 2 partitions, no broadcast.
    biased = dleft32.merge(dright2, on="k1", broadcast=0.1, shuffle_method="gpushuffle")
    assert not _is_broadcast(biased)


def test_side_already_partitioned_is_not_shuffled_again(client):
    left, right = frames(seed=13)
    dleft = dd.from_pandas(left, npartitions=4, sort=False)
    dright = dd.from_pandas(right, npartitions=3, sort=False)
    shuffled = dleft.shuffle("k1", npartitions=4, shuffle_method="gpushuffle")
    joined = shuffled.merge(dright, on="k1", shuffle_method="gpushuffle")
    prefixes = task_prefixes(joined)
    # The left side's own shuffle, and the right side's: no fused join, no
    # third shuffle of the left.
    assert "gpushuffle-join" not in prefixes
    barriers = [k for k in joined.__dask_graph__() if str(k).startswith("shuffle-barrier")]
    assert len(barriers) == 2
    assert_same_rows(joined.compute(), left.merge(right, on="k1"))


def test_known_divisions_align_without_shuffle(client):
    left, right = frames(seed=14)
    dleft = dd.from_pandas(left, npartitions=4)  # sorted: known divisions
    dright = dd.from_pandas(right, npartitions=3)
    joined = dleft.merge(dright, left_index=True, right_index=True, shuffle_method="gpushuffle")
    assert not any("gpushuffle" in p for p in task_prefixes(joined))
    expected = left.merge(right, left_index=True, right_index=True)
    assert_same_rows(joined.compute().reset_index(), expected.reset_index())


def test_p2p_on_pandas_untouched_and_tasks_untouched(client):
    left, right = frames(seed=15)
    dleft = dd.from_pandas(left, npartitions=4, sort=False)
    dright = dd.from_pandas(right, npartitions=4, sort=False)
    with dask.config.set({"gpushuffle.p2p-on-cudf": True}):
        p2p = dleft.merge(dright, on="k1", shuffle_method="p2p")
        assert "hash-join-transfer" in task_prefixes(p2p)
        assert not any("gpushuffle" in p for p in task_prefixes(p2p))
    tasks = dleft.merge(dright, on="k1", shuffle_method="tasks")
    assert not any("gpushuffle" in p for p in task_prefixes(tasks))
    with pytest.raises(ValueError, match="not supported"):
        dleft.merge(dright, on="k1", shuffle_method="no-such-method").compute()


class _CudfLikeMeta:
    """TEST DOUBLE: stands in for an empty cudf.DataFrame (no GPU or cuDF on CI)."""

    __module__ = "cudf.core.dataframe"


def test_p2p_merge_on_cudf_is_routed_when_opted_in():
    # A dask_cudf merge can't be built without cuDF; the merge hook routes by
    # takes_gpushuffle(method, left meta), asserted here with a cuDF-like meta.
    cudf_meta = _CudfLikeMeta()
    assert not takes_gpushuffle("p2p", cudf_meta)
    with dask.config.set({"gpushuffle.p2p-on-cudf": True}):
        assert takes_gpushuffle("p2p", cudf_meta)
        assert not takes_gpushuffle("tasks", cudf_meta)
        assert not takes_gpushuffle("p2p", frames(1, 1)[0])


@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("dask_cudf"), reason="needs dask_cudf (GPU)"
)
@pytest.mark.gpu
def test_p2p_merge_on_cudf_graph(client):  # pragma: no cover - GPU runners only
    import cudf

    left, right = frames(seed=16)
    dleft = dd.from_pandas(cudf.from_pandas(left), npartitions=4, sort=False)
    dright = dd.from_pandas(cudf.from_pandas(right), npartitions=4, sort=False)
    with dask.config.set({"gpushuffle.p2p-on-cudf": True}):
        joined = dleft.merge(dright, on="k1", shuffle_method="p2p")
        assert "gpushuffle-join" in task_prefixes(joined)


# -- a selection of dask's own merge tests, run with gpushuffle ----------------------

try:
    from dask.dataframe.dask_expr.tests import test_merge as dask_merge_tests
except ImportError:  # pragma: no cover - dask's tests not installed
    dask_merge_tests = None

needs_dask_tests = pytest.mark.skipif(
    dask_merge_tests is None, reason="dask's test suite (dask_expr/tests) is not installed"
)


@pytest.fixture
def on_cluster(client, monkeypatch):
    """dask's tests, with their ``assert_eq`` computing on the cluster.

    dask's ``assert_eq`` computes with ``scheduler="sync"``, where no P2P
    shuffle (p2p or gpushuffle) can run; the same checks run through the
    distributed client instead.
    """
    from dask.dataframe.dask_expr.tests import _util

    def assert_eq(a, b, *args, **kwargs):
        kwargs["scheduler"] = client
        return _util.assert_eq(a, b, *args, **kwargs)

    monkeypatch.setattr(dask_merge_tests, "assert_eq", assert_eq)
    return client


@needs_dask_tests
@pytest.mark.parametrize("how", ["left", "right", "inner", "outer"])
def test_dask_merge(on_cluster, how):
    dask_merge_tests.test_merge(how, "gpushuffle")
    dask_merge_tests.test_join(how, "gpushuffle")


@needs_dask_tests
@pytest.mark.parametrize("how", ["inner", "left"])
def test_dask_merge_known_to_single(on_cluster, how):
    dask_merge_tests.test_merge_known_to_single(how, "gpushuffle")


@needs_dask_tests
@pytest.mark.parametrize(
    "name",
    [
        "test_merge_len",
        "test_merge_leftsemi",
        "test_merge_npartitions",
        "test_merge_tuple_left_on",
        "test_merged_partitions_filtered",
        "test_join_recursive",
        "test_recursive_join",
        "test_categorical_merge_with_merge_column_cat_in_one_and_not_other_upcasts",
        "test_merge_pandas_object",
        "test_merge_after_rename",
    ],
)
def test_dask_merge_default_method(on_cluster, name):
    """dask's tests that take the default method, with the default set to gpushuffle."""
    test = getattr(dask_merge_tests, name)
    with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
        if name == "test_merge_after_rename":
            for index in (True, False):
                test(index)
        else:
            test()


@needs_dask_tests
@pytest.mark.parametrize("how", ["inner", "outer"])
@pytest.mark.parametrize("on_index", [True, False])
def test_dask_merge_columns_dtypes(on_cluster, how, on_index):
    with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
        dask_merge_tests.test_merge_columns_dtypes1(how, on_index)
