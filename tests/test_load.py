"""Load: many partitions, shuffles at once and in a row, random frames against pandas.

Timings are printed at the end of the pytest run ("gpushuffle load
timings"), not asserted: the machine is shared and noisy.
"""

from __future__ import annotations

import time
import uuid

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from conftest import assert_nothing_left_behind
from distributed import Event, wait
from faults import frame, make_part
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_memory import _rss, cluster_with
from test_shuffle import check
from truth import assert_same_partitions, checksum, partitions_of

pytestmark = pytest.mark.timeout(300)


def _partition_of_each_row(pdf: pd.DataFrame, on: str, npartitions: int) -> pd.Series:
    """dask's own assignment of rows to output partitions (what ``tasks`` and ``p2p`` use)."""
    from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex

    assigned = AssignPartitioningIndex.operation(pdf, [on], "_p", npartitions, pdf.iloc[:0], False)
    return assigned["_p"]


def test_thousand_by_thousand_partitions(client, load_report):
    """1,000 inputs to 1,000 outputs of about 50 rows: fixed costs per partition only."""
    nin = nout = 1000
    rows = 50
    df = frame(nin, rows)
    start = time.perf_counter()
    parts = partitions_of(df.shuffle("key", npartitions=nout, shuffle_method="gpushuffle"))
    elapsed = time.perf_counter() - start
    load_report(
        f"{nin:,} x {nout:,} partitions, {nin * rows:,} rows: {elapsed:.1f} s "
        f"({elapsed / (nin + nout) * 1e3:.1f} ms per transfer or unpack task; "
        "2 workers x 2 threads)"
    )
    # The truth: pandas, with rows assigned to partitions by dask's own function
    # (dask's tasks shuffle takes about 100 s here at this partition count).
    source = pd.concat([make_part(i, rows) for i in range(nin)])
    assigned = _partition_of_each_row(source, "key", nout)
    assert len(parts) == nout
    by_partition = dict(list(source.groupby(assigned.to_numpy())))
    for i, part in enumerate(parts):
        expected = by_partition.get(i, source.iloc[:0])
        assert len(part) == len(expected), i
        assert checksum(part) == checksum(expected), i
        assert part["row"].is_monotonic_increasing
    whole = pd.concat(parts)
    assert len(whole) == len(source) and checksum(whole) == checksum(source)


def _wait_for_gate(name: str) -> int:
    Event(name).wait()
    return 0


def _gated_part(i: int, rows: int, gate: int | None) -> pd.DataFrame:
    return make_part(i, rows)


def _active_shuffles(dask_scheduler) -> int:
    return len(dask_scheduler.plugins["shuffle"].active_shuffles)


def test_four_shuffles_at_once(client):
    """Four shuffles of one frame, all running at the same time, each equal to the truth."""
    nin, rows = 24, 2000
    # Input partition 0 is ready at once; the others wait for a gate, opened
    # only when all four shuffles are running (each started by a transfer of
    # partition 0), so none can finish before the last one starts.
    gate = Event(f"four-at-once-{uuid.uuid4()}", client=client)
    opened = dask.delayed(_wait_for_gate, pure=False)(gate.name)
    inputs = [dask.delayed(_gated_part)(i, rows, None if i == 0 else opened) for i in range(nin)]
    df = dd.from_delayed(inputs, meta=make_part(0, 0), verify_meta=False)
    cases = [("key", 7), ("s", 11), ("n", 3), (["key", "s"], 16)]
    ours = [df.shuffle(on, npartitions=n, shuffle_method="gpushuffle") for on, n in cases]
    futures = client.compute([o.to_delayed() for o in ours])
    try:
        deadline = time.monotonic() + 60
        while client.run_on_scheduler(_active_shuffles) < 4:
            assert time.monotonic() < deadline, "four shuffles never ran at once"
            time.sleep(0.01)
    finally:
        gate.set()
    computed = client.gather(futures)

    source = pd.concat([make_part(i, rows) for i in range(nin)])
    for parts, (on, n) in zip(computed, cases, strict=True):
        truth = frame(nin, rows).shuffle(on, npartitions=n, shuffle_method="tasks")
        assert_same_partitions(list(parts), partitions_of(truth))
        whole = pd.concat(parts)
        assert len(whole) == len(source) and checksum(whole) == checksum(source)


def _memory_in_use(dask_worker) -> dict:
    from gpushuffle.engine.memory import worker_memory

    row = worker_memory().snapshot()
    return {"host_bytes": row["host_bytes"], "disk_bytes": row["disk_bytes"], "runs": row["runs"]}


def test_twenty_shuffles_in_a_row_do_not_leak(load_report):
    """Worker memory after 20 more shuffles is within 10% of what it was before them."""
    n = 400_000  # 16 MB: about 8 MB received per worker per shuffle
    rng = np.random.default_rng(20)
    pdf = pd.DataFrame(
        {"key": rng.integers(0, 10**5, n), "a": rng.random(n), "b": rng.integers(0, 9, n)}
    )
    # Pooled buffers go back to the OS after 200 ms unused.
    with cluster_with({"gpushuffle.memory.host-pool.idle-release": "200ms"}) as client:
        df = dd.from_pandas(pdf, npartitions=8, sort=False).persist()
        wait(df)

        shuffles = iter(range(8, 100))

        def one_shuffle() -> None:
            # A different partition count each time: a new graph, so a new
            # shuffle runs (the same graph again could reuse results in memory).
            out = df.shuffle("key", npartitions=next(shuffles), shuffle_method="gpushuffle")
            assert out.map_partitions(len).compute().sum() == n

        for _ in range(2):  # the first ones pay for imports and first-time allocations
            one_shuffle()
        time.sleep(1)
        before = client.run(_rss)
        start = time.perf_counter()
        for _ in range(20):
            one_shuffle()
        elapsed = time.perf_counter() - start
        assert_nothing_left_behind(client)
        time.sleep(1)  # past idle-release: pooled buffers are back with the OS
        after = client.run(_rss)
        load_report(
            f"20 shuffles in a row, {n:,} rows each: {elapsed:.1f} s; worker RSS "
            + ", ".join(f"{before[w] / 2**20:.0f} -> {after[w] / 2**20:.0f} MiB" for w in before)
        )
        for worker, rss in after.items():
            assert rss <= before[worker] * 1.10, (worker, before[worker], rss)
        for state in client.run(_memory_in_use).values():
            assert state["host_bytes"] == state["disk_bytes"] == 0
            assert state["runs"] == 22  # each worker took part in every shuffle


# -- random frames against pandas and dask's tasks shuffle ----------------------

_VALUE_KINDS = ["int", "float", "bool", "string", "nullable-int", "datetime", "category"]


def _column(kind: str, n: int, rng: np.random.Generator, nulls: float) -> pd.Series:
    missing = rng.random(n) < nulls
    if kind == "int":
        return pd.Series(rng.integers(-(2**40), 2**40, n))
    if kind == "float":
        return pd.Series(np.where(missing, np.nan, rng.normal(size=n)))
    if kind == "bool":
        return pd.Series(rng.random(n) < 0.5)
    if kind == "string":
        values = np.array([f"s{v}" for v in rng.integers(0, 30, n)], dtype=object)
        values[missing] = None
        return pd.Series(values, dtype=object)
    if kind == "nullable-int":
        values = pd.array(rng.integers(-5, 5, n), dtype="Int64")
        values[missing] = pd.NA
        return pd.Series(values)
    if kind == "datetime":
        values = pd.Series(
            pd.Timestamp("2021-03-04") + pd.to_timedelta(rng.integers(0, 10**6, n), "s")
        )
        values[missing] = pd.NaT
        return values
    assert kind == "category"
    return pd.Series(pd.Categorical(rng.choice(["x", "y", "z"], n)))


@st.composite
def random_frames(draw):
    n = draw(st.integers(0, 400))
    seed = draw(st.integers(0, 2**32 - 1))
    nulls = draw(st.sampled_from([0.0, 0.2, 0.9]))
    kinds = draw(st.lists(st.sampled_from(_VALUE_KINDS), min_size=1, max_size=4))
    key_kind = draw(st.sampled_from(["int", "float", "string", "nullable-int"]))
    # Skew: one key holding most rows, or spread over few or many keys.
    skew = draw(st.sampled_from(["uniform", "few-keys", "one-key-most-rows"]))
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 3 if skew == "few-keys" else 1000, n)
    if skew == "one-key-most-rows":
        keys[rng.random(n) < 0.9] = 7
    key_null = rng.random(n) < nulls
    if key_kind == "int":
        key: pd.Series = pd.Series(keys)
    elif key_kind == "float":
        key = pd.Series(np.where(key_null, np.nan, keys.astype(float)))
    elif key_kind == "string":
        key = pd.Series(np.where(key_null, None, np.char.add("k", keys.astype(str))), dtype=object)
    else:
        key = pd.Series(pd.array(keys, dtype="Int64"))
        key[key_null] = pd.NA
    pdf = pd.DataFrame({"key": key, "row": np.arange(n)})
    for i, kind in enumerate(kinds):
        pdf[f"c{i}_{kind}"] = _column(kind, n, rng, nulls)
    pdf.index = pd.Index(rng.permutation(n) * 3, name="ix")
    return pdf, draw(st.integers(1, 8)), draw(st.integers(1, 12))


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=random_frames())
def test_random_frames_match_pandas_and_tasks(client, case):
    pdf, nin, nout = case
    df = dd.from_pandas(pdf, npartitions=nin, sort=False)
    parts = check(
        df.shuffle("key", npartitions=nout, shuffle_method="gpushuffle"),
        df.shuffle("key", npartitions=nout, shuffle_method="tasks"),
        pdf,
    )
    assert len(parts) == nout
    for part in parts:
        assert part["row"].is_monotonic_increasing  # input order kept within a partition
