"""End to end on a real cluster: gpushuffle against pandas and dask's tasks shuffle."""

from __future__ import annotations

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.utils import key_split
from truth import (
    assert_meta_dtypes,
    assert_same_partitions,
    canonical,
    checksum,
    partitions_of,
)

import gpushuffle

pytestmark = pytest.mark.timeout(120)


def make_frame(n: int = 2000, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    key = rng.integers(0, 50, n)
    ints = pd.array(rng.integers(-5, 5, n), dtype="Int64")
    ints[rng.random(n) < 0.2] = pd.NA
    strings = np.array([f"s{i % 37}" for i in range(n)], dtype=object)
    df = pd.DataFrame(
        {
            "key": key,
            "row": np.arange(n),
            "f": rng.random(n),
            "b": rng.random(n) < 0.5,
            "obj": strings,
            "str": pd.array(strings, dtype="string[pyarrow]"),
            "cat": pd.Categorical(rng.choice(["x", "y", "z"], n)),
            "ts": pd.date_range("2020-01-01", periods=n, freq="h", tz="Europe/Berlin"),
            "nullable": ints,
        },
        index=pd.Index(np.arange(n) * 3, name="idx"),
    )
    # pandas 3 infers "str" for object arrays of strings; keep one object column.
    df["obj"] = df["obj"].astype(object)
    return df


def check(ours, truth_ddf, source: pd.DataFrame) -> list[pd.DataFrame]:
    """Partition by partition equal to ``truth``; all of ``source`` present once."""
    parts = partitions_of(ours)
    assert_same_partitions(parts, partitions_of(truth_ddf))
    assert_meta_dtypes(parts, ours._meta)
    whole = pd.concat(parts)
    assert len(whole) == len(source)
    assert checksum(whole) == checksum(source)
    return parts


def test_all_dtypes_match_tasks_and_pandas(client):
    pdf = make_frame()
    df = dd.from_pandas(pdf, npartitions=6, sort=False)
    ours = df.shuffle("key", npartitions=5, shuffle_method="gpushuffle")
    truth = df.shuffle("key", npartitions=5, shuffle_method="tasks")
    parts = check(ours, truth, pdf)
    # Grouped by input partition, in input order: "row" increases in every output.
    for part in parts:
        assert part["row"].is_monotonic_increasing
    # dask turns object strings into string[pyarrow]; values must match pandas.
    pd.testing.assert_frame_equal(canonical(pd.concat(parts)), canonical(pdf), check_dtype=False)


def test_object_strings_without_conversion(client):
    pdf = make_frame(700, seed=11)
    with dask.config.set({"dataframe.convert-string": False}):
        df = dd.from_pandas(pdf, npartitions=4, sort=False)
        assert df._meta["obj"].dtype == object
        ours = df.shuffle("obj", npartitions=3, shuffle_method="gpushuffle")
        parts = check(ours, df.shuffle("obj", npartitions=3, shuffle_method="tasks"), pdf)
    assert all(p["obj"].dtype == object for p in parts)
    pd.testing.assert_frame_equal(canonical(pd.concat(parts)), canonical(pdf))


def test_public_function_equals_method(client):
    pdf = make_frame(500)
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    a = partitions_of(gpushuffle.shuffle(df, "key", npartitions=3))
    b = partitions_of(df.shuffle("key", npartitions=3, shuffle_method="gpushuffle"))
    for x, y in zip(a, b, strict=True):
        pd.testing.assert_frame_equal(x, y)


@pytest.mark.parametrize(
    "on",
    [["key"], ["key", "cat"], ["str", "b"], ["ts"], ["nullable"]],
    ids=lambda on: "+".join(on),
)
def test_key_columns(client, on):
    pdf = make_frame(1500, seed=1)
    df = dd.from_pandas(pdf, npartitions=5, sort=False)
    check(
        df.shuffle(on, npartitions=4, shuffle_method="gpushuffle"),
        df.shuffle(on, npartitions=4, shuffle_method="tasks"),
        pdf,
    )


def test_nulls_in_key(client):
    pdf = make_frame(1200, seed=2)
    pdf["fkey"] = np.where(np.arange(len(pdf)) % 7 == 0, np.nan, pdf["key"].astype(float))
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    check(
        df.shuffle("fkey", npartitions=6, shuffle_method="gpushuffle"),
        df.shuffle("fkey", npartitions=6, shuffle_method="tasks"),
        pdf,
    )
    check(
        df.shuffle("nullable", npartitions=3, shuffle_method="gpushuffle"),
        df.shuffle("nullable", npartitions=3, shuffle_method="tasks"),
        pdf,
    )


def test_shuffle_on_index(client):
    pdf = make_frame(1000, seed=3)
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    check(
        df.shuffle("idx", npartitions=3, shuffle_method="gpushuffle"),
        df.shuffle("idx", npartitions=3, shuffle_method="tasks"),
        pdf,
    )
    check(
        df.shuffle(on=df.index, npartitions=5, shuffle_method="gpushuffle"),
        df.shuffle(on=df.index, npartitions=5, shuffle_method="tasks"),
        pdf,
    )


@pytest.mark.parametrize(
    ("nin", "nout"), [(3, 8), (8, 3), (1, 6), (6, 1), (1, 1)], ids=lambda v: str(v)
)
def test_partition_counts(client, nin, nout):
    pdf = make_frame(900, seed=nin * 10 + nout)
    df = dd.from_pandas(pdf, npartitions=nin, sort=False)
    parts = check(
        df.shuffle("key", npartitions=nout, shuffle_method="gpushuffle"),
        df.shuffle("key", npartitions=nout, shuffle_method="tasks"),
        pdf,
    )
    assert len(parts) == nout


def test_empty_inputs_and_empty_outputs(client):
    pdf = make_frame(400, seed=4)
    # Few distinct keys and many outputs: most outputs receive nothing.
    pdf["key"] = pdf["key"] % 3
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    # Filtering empties some input partitions entirely.
    df = df[df["row"] >= 250]
    sub = pdf[pdf["row"] >= 250]
    assert 0 in df.map_partitions(len).compute().tolist()
    ours = df.shuffle("key", npartitions=20, shuffle_method="gpushuffle")
    parts = check(ours, df.shuffle("key", npartitions=20, shuffle_method="tasks"), sub)
    empty = [p for p in parts if not len(p)]
    assert len(empty) >= 17
    # An output that received nothing is meta: same columns, dtypes, index dtype.
    for p in empty:
        assert p.index.name == "idx"
        assert p.index.dtype == pdf.index.dtype


def test_all_inputs_empty(client):
    pdf = make_frame(100).iloc[:0]
    df = dd.from_pandas(pdf, npartitions=1)
    parts = partitions_of(df.shuffle("key", npartitions=3, shuffle_method="gpushuffle"))
    assert [len(p) for p in parts] == [0, 0, 0]
    assert_meta_dtypes(parts, df._meta)


def test_ignore_index(client):
    """A named index stays, as dask's meta (and p2p) say; a plain one is
    dropped (tests/test_dask_semantics.py)."""
    pdf = make_frame(600, seed=5)
    df = dd.from_pandas(pdf, npartitions=3, sort=False)
    ours = df.shuffle("key", npartitions=4, ignore_index=True, shuffle_method="gpushuffle")
    assert ours._meta.index.name == "idx"
    parts = partitions_of(ours)
    truth = partitions_of(df.shuffle("key", npartitions=4, shuffle_method="tasks"))
    for a, b in zip(parts, truth, strict=True):
        assert a.index.name == "idx" and a.index.dtype == ours._meta.index.dtype
        assert checksum(a) == checksum(b)


def test_two_shuffles_at_once_and_twice(client):
    pdf = make_frame(800, seed=6)
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    a = df.shuffle("key", npartitions=3, shuffle_method="gpushuffle")
    b = df.shuffle("str", npartitions=5, shuffle_method="gpushuffle")
    la, lb = dask.compute(a.map_partitions(len), b.map_partitions(len))
    assert la.sum() == lb.sum() == len(pdf)
    ta = df.shuffle("key", npartitions=3, shuffle_method="tasks")
    tb = df.shuffle("str", npartitions=5, shuffle_method="tasks")
    assert la.tolist() == ta.map_partitions(len).compute().tolist()
    assert lb.tolist() == tb.map_partitions(len).compute().tolist()
    # The same shuffle again: a new run, the same answer.
    first = partitions_of(a)
    second = partitions_of(a)
    for x, y in zip(first, second, strict=True):
        pd.testing.assert_frame_equal(x, y)


def _in_chunks(part: pd.DataFrame, rows: int = 2_000) -> pd.DataFrame:
    return pd.concat([part.iloc[i : i + rows] for i in range(0, len(part), rows)])


def test_inputs_whose_arrow_columns_come_in_chunks(client):
    """Arrow columns in several chunks (pd.concat, a shuffle's outputs) in
    persisted inputs: the rows a worker keeps are taken chunk by chunk."""
    pdf = make_frame(40_000, seed=11)
    df = dd.from_pandas(pdf, npartitions=4, sort=False).map_partitions(_in_chunks).persist()
    chunks = client.compute(df.map_partitions(lambda p: pd.Series([_chunks(p["str"])]))).result()
    assert (chunks == 5).all()
    ours = df.shuffle("key", shuffle_method="gpushuffle")
    check(ours, df.shuffle("key", shuffle_method="tasks"), pdf)


def _chunks(column: pd.Series) -> int:
    return column.array._pa_array.num_chunks


def test_head_computes_some_outputs(client):
    pdf = make_frame(1000, seed=7)
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    ours = df.shuffle("key", npartitions=6, shuffle_method="gpushuffle")
    truth = df.shuffle("key", npartitions=6, shuffle_method="tasks")
    head = ours.head(5, npartitions=2)
    assert len(head) == 5
    expected = pd.concat(partitions_of(truth)[:2])
    assert set(head["row"]) <= set(expected["row"])
    one = ours.partitions[4].compute()
    assert checksum(one) == checksum(truth.partitions[4].compute())


def test_config_default_method(client):
    pdf = make_frame(500, seed=8)
    df = dd.from_pandas(pdf, npartitions=3, sort=False)
    with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
        ours = df.shuffle("key", npartitions=4)
        keys = ours.__dask_graph__().keys()
        assert any(str(k).startswith("('gpushuffle-transfer") for k in map(str, keys))
        parts = partitions_of(ours)
    truth = partitions_of(df.shuffle("key", npartitions=4, shuffle_method="tasks"))
    assert_same_partitions(parts, truth)


def test_other_methods_untouched(client):
    pdf = make_frame(300, seed=9)
    df = dd.from_pandas(pdf, npartitions=3, sort=False)
    for method in ("tasks", "p2p", "disk"):
        graph = df.shuffle("key", npartitions=2, shuffle_method=method).__dask_graph__()
        assert not any("gpushuffle" in str(k) for k in graph), method
    with pytest.raises(ValueError, match="not supported"):
        df.shuffle("key", shuffle_method="no-such-method").compute()
    gpushuffle.api.install()  # idempotent: a second install must not wrap twice
    graph = df.shuffle("key", npartitions=2, shuffle_method="tasks").__dask_graph__()
    assert not any("gpushuffle" in str(k) for k in graph)


def test_task_names(client):
    df = dd.from_pandas(make_frame(100), npartitions=2)
    keys = [str(k) for k in df.shuffle("key", shuffle_method="gpushuffle").__dask_graph__()]
    assert any("gpushuffle-transfer-" in k for k in keys)
    assert any("gpushuffle-unpack-" in k for k in keys)
    assert any(k.startswith("shuffle-barrier-") for k in keys)


def _add_one_and_tag(part: pd.DataFrame) -> pd.DataFrame:
    return part.assign(f=part["f"] + 1, rows=len(part))


def test_unpack_fuses_with_the_blockwise_steps_after_it(client):
    """Blockwise steps after the shuffle run in the unpack tasks (dask's
    blockwise fusion): no unpack keys of their own in the optimized graph,
    and partitions, including a selection of them, equal those of the
    ``tasks`` method's shuffle followed by the same steps."""
    pdf = make_frame(1500, seed=11)
    df = dd.from_pandas(pdf, npartitions=5, sort=False)

    def after(method: str) -> dd.DataFrame:
        shuffled = df.shuffle("key", npartitions=7, shuffle_method=method)
        return shuffled.map_partitions(_add_one_and_tag)[lambda d: d["row"] % 3 != 0]

    ours, truth = after("gpushuffle"), after("tasks")
    names = {key_split(k) for k in ours.optimize().__dask_graph__()}
    assert "gpushuffle-unpack" not in names
    fused = {n for n in names if n.split("-")[0] == "gpushuffle" and n != "gpushuffle-transfer"}
    assert len(fused) == 1, names
    parts = partitions_of(ours)
    assert_same_partitions(parts, partitions_of(truth))
    assert sum(map(len, parts)) == int((pdf["row"] % 3 != 0).sum())
    # Partitions selected after the fused steps: only those are built.
    some = ours.partitions[[5, 1]]
    assert some.npartitions == 2
    assert_same_partitions(partitions_of(some), partitions_of(truth.partitions[[5, 1]]))


@pytest.mark.parametrize("upstream", ["none", "blockwise"])
def test_partitioning_index_is_computed_inside_the_transfer_tasks(client, upstream):
    """dask's partitioning-index step runs in the transfer task, not as a
    task of its own per input partition (with many small partitions the task
    is the cost); where dask fused blockwise steps into it (``persist`` and
    ``optimize`` fuse), those run in the transfer task too."""
    from distributed import get_task_stream

    source = make_frame(3000, seed=4)
    df = dd.from_pandas(source, npartitions=6)
    if upstream == "blockwise":
        df = df[df.f > 0.25].assign(g=lambda d: d.f * 2)
        source = source[source.f > 0.25].assign(g=lambda d: d.f * 2)
    ours = df.shuffle("key", npartitions=4, shuffle_method="gpushuffle")
    truth = df.shuffle("key", npartitions=4, shuffle_method="tasks")
    with get_task_stream(client) as stream:
        ours.compute()
    ran = {key_split(t["key"]) for t in stream.data}
    assert {"gpushuffle-transfer", "gpushuffle-unpack", "shuffle-barrier"} <= ran
    # AssignPartitioningIndex's tasks are called "operation".
    assert not any("operation" in k for k in ran), ran
    check(ours, truth, source)

    # The fused graph (what persist computes): transfers read the input itself.
    graph = dict(ours.optimize().__dask_graph__())
    transfers = [k for k in graph if key_split(k) == "gpushuffle-transfer"]
    assert len(transfers) == 6
    for key in transfers:
        deps = {key_split(d) for d in graph[key].dependencies}
        assert deps == {"frompandas"}, deps
    check(ours.persist(), truth, source)


def test_transfers_read_persisted_partitions_without_alias_tasks(client):
    """dask names a persisted frame's partitions anew and maps each name to
    the persisted key with an alias task, which nothing fuses: one task per
    input partition on every computation (``tasks`` and ``p2p`` run them).
    gpushuffle's transfers read the persisted keys: no alias task runs, and
    the result is the ``tasks`` method's."""
    from distributed import get_task_stream, wait

    pdf = make_frame(2400, seed=8)
    persisted = dd.from_pandas(pdf, npartitions=6, sort=False).persist()
    wait(persisted)
    alias_name = persisted.expr._name
    ours = persisted.shuffle("key", npartitions=4, shuffle_method="gpushuffle")
    truth = persisted.shuffle("key", npartitions=4, shuffle_method="tasks")
    with get_task_stream(client) as stream:
        truth.compute()
    assert sum(t["key"][0] == alias_name for t in stream.data) == 6  # dask's way
    with get_task_stream(client) as stream:
        ours.compute()
    ran = [t["key"] for t in stream.data]
    assert not any(k[0] == alias_name for k in ran), ran
    assert sum(key_split(k) == "gpushuffle-transfer" for k in ran) == 6
    check(ours, truth, pdf)
    # The persisted partitions are still there, and read again on the next run.
    check(ours, truth, pdf)
    del persisted


def test_unsupported_frame_type_fails_at_graph_construction():
    from gpushuffle.backends import backend_for

    with pytest.raises(TypeError, match="cannot shuffle"):
        backend_for(np.zeros(3))


def test_npartitions_must_be_positive():
    df = dd.from_pandas(make_frame(10), npartitions=1)
    with pytest.raises(ValueError, match="at least 1"):
        gpushuffle.shuffle(df, "key", npartitions=0)


def _send_every_input_twice(dask_worker) -> None:
    """Make transfer tasks hand their partition to the run twice, as a retry would."""
    import gpushuffle.engine.tasks as tasks

    original = tasks.transfer

    def transfer_twice(input, id, input_partition):
        original(input, id, input_partition)
        return original(input, id, input_partition)

    transfer_twice.original = original  # type: ignore[attr-defined]
    tasks.transfer = transfer_twice


def _restore_transfer(dask_worker) -> None:
    import gpushuffle.engine.tasks as tasks

    tasks.transfer = getattr(tasks.transfer, "original", tasks.transfer)


def test_resent_input_partitions_are_ignored(client):
    """Shards of an input partition that arrive twice, locally or remotely, count once."""
    pdf = make_frame(1500, seed=12)
    df = dd.from_pandas(pdf, npartitions=5, sort=False)
    client.run(_send_every_input_twice)
    try:
        # The graph refers to gpushuffle.engine.tasks.transfer by name, so
        # workers pick up the patched function when they unpickle tasks.
        parts = check(
            df.shuffle("key", npartitions=4, shuffle_method="gpushuffle"),
            df.shuffle("key", npartitions=4, shuffle_method="tasks"),
            pdf,
        )
    finally:
        client.run(_restore_transfer)
    assert sum(len(p) for p in parts) == len(pdf)


def _phase_metrics(dask_worker, span_id):
    return [k for k in dask_worker.digests_total if isinstance(k, tuple) and span_id in k]


def test_phase_timings_reach_fine_performance_metrics(client):
    # The dashboard's "Fine Performance Metrics" shows what workers digest
    # under the task's prefix ("execute") and, for shuffles, under "p2p".
    from distributed import span

    df = dd.from_pandas(make_frame(400), npartitions=4)
    out = df.shuffle("key", shuffle_method="gpushuffle").map_partitions(len)
    with span("phase metrics") as span_id:
        total = client.compute(out).result().sum()
    assert total == 400
    keys = {k for ks in client.run(_phase_metrics, span_id=span_id).values() for k in ks}
    for prefix, label in [
        ("gpushuffle-transfer", "p2p-shard-partition-cpu"),
        ("gpushuffle-transfer", "p2p-shards"),
        ("gpushuffle-unpack", "p2p-get-output-cpu"),
    ]:
        assert any(k[0] == "execute" and k[2] == prefix and k[3] == label for k in keys), label
    for label in ["shard-partition-cpu", "get-output-cpu"]:
        assert ("p2p", span_id, "foreground", label, "seconds") in keys


class _CudfLikeMeta:
    """TEST DOUBLE: stands in for an empty cudf.DataFrame (no GPU on CI)."""

    __module__ = "cudf.core.dataframe"


def test_p2p_on_cudf_opt_in_is_off_by_default_and_leaves_pandas_alone():
    from gpushuffle.api import takes_gpushuffle

    cudf_meta, pandas_meta = _CudfLikeMeta(), make_frame(0)
    assert takes_gpushuffle("gpushuffle", pandas_meta)
    assert not takes_gpushuffle("p2p", cudf_meta)
    with dask.config.set({"gpushuffle.p2p-on-cudf": True}):
        assert takes_gpushuffle("p2p", cudf_meta)
        assert not takes_gpushuffle("p2p", pandas_meta)
        assert not takes_gpushuffle("tasks", cudf_meta)
        df = dd.from_pandas(make_frame(100), npartitions=2)
        graph = df.shuffle("key", shuffle_method="p2p").__dask_graph__()
        assert not any("gpushuffle" in str(k) for k in graph)
