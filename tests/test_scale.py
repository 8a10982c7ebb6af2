"""Shuffles larger than the cluster, and a hot key, on workers with real memory limits.

Each worker is a Nanny's process with a memory limit that distributed
enforces (a worker over 95% of it is killed and restarted).  The input is
generated inside the shuffle, never persisted, so it can be several times the
cluster's memory.  Every test runs beside busy loops on each core, as on a
crowded CI runner.  Each test counts restarts (none allowed) and compares every
output partition with a truth computed without any shuffle: each input
partition's rows grouped by the output partition dask's
``partitioning_index`` gives them, summed over the inputs.
"""

from __future__ import annotations

import contextlib

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from conftest import is_clean, worker_leftovers
from dask.dataframe.shuffle import partitioning_index
from distributed import Client, LocalCluster

import gpushuffle
from gpushuffle.bench import _output_summary, generated_frame

# Beside busy loops on every core (conftest.busy_cores): CI's runner is shared.
pytestmark = [pytest.mark.timeout(300), pytest.mark.scale, pytest.mark.usefixtures("busy_cores")]


@contextlib.contextmanager
def limited_cluster(memory_limit: str, n_workers: int = 2):
    with (
        LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            memory_limit=memory_limit,
            dashboard_address=":0",
            worker_dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


def _sample_rss(dask_worker, period: float = 0.01) -> None:
    """Record the worker's peak RSS (what the Nanny watches) until _peak_rss."""
    import threading
    import time

    import psutil

    process = psutil.Process()
    state = dask_worker._test_rss = {"peak": 0, "run": True}

    def sample() -> None:
        while state["run"]:
            state["peak"] = max(state["peak"], process.memory_info().rss)
            time.sleep(period)

    threading.Thread(target=sample, daemon=True, name="test-rss-sampler").start()


def _peak_rss(dask_worker) -> int:
    state = dask_worker._test_rss
    state["run"] = False
    return state["peak"]


def _workers(client) -> set[str]:
    return set(client.nthreads())


def _truth_of_input(part: pd.DataFrame, npartitions: int) -> pd.DataFrame:
    """Per output partition id: the rows of ``part`` it gets, and their
    columns' bit sums (as the output summaries count them)."""
    # dask's own partition ids for an int key: cast to float64 first.
    ids = np.asarray(partitioning_index(part[["key"]].astype("float64"), npartitions))
    order = np.argsort(ids, kind="stable")
    present, starts = np.unique(ids[order], return_index=True)
    out = {"rows": np.diff(np.append(starts, len(ids)))}
    for name in part.columns:
        data = np.ascontiguousarray(part[name].to_numpy())
        bits = data.view(np.int64) if data.dtype.itemsize == 8 else data.astype(np.int64)
        out[f"sum_{name}"] = np.add.reduceat(bits[order], starts) if len(starts) else bits[:0]
    return pd.DataFrame(out, index=pd.Index(present, name="partition"))


def expected_outputs(df: dd.DataFrame, npartitions: int) -> pd.DataFrame:
    meta = _truth_of_input(df._meta, npartitions)
    per_input = df.map_partitions(_truth_of_input, npartitions, meta=meta).compute()
    # int64 sums wrap, as the outputs' do.
    summed = per_input.groupby(level=0).sum()
    return summed.reindex(range(npartitions), fill_value=0).reset_index(drop=True)


def shuffled_outputs(df: dd.DataFrame, npartitions: int) -> pd.DataFrame:
    out = df.shuffle("key", npartitions=npartitions, shuffle_method="gpushuffle")
    summaries = out.map_partitions(_output_summary, meta=_output_summary(df._meta)).compute()
    return summaries.reset_index(drop=True)


def _assert_same(ours: pd.DataFrame, truth: pd.DataFrame) -> None:
    assert list(ours["rows"]) == list(truth["rows"]), "rows per output partition differ"
    pd.testing.assert_frame_equal(ours, truth[ours.columns], check_dtype=False)


def test_four_times_the_clusters_memory_with_no_restart():
    """2 workers of 550 MiB, 4 GiB of input: most of it goes through disk.
    (Input partitions of 34 MB: at the worker's 80% distributed pauses it,
    and the split and receive buffers of larger ones leave too little.)"""
    rows, partitions = 30_000_000, 120
    df = generated_frame(rows, partitions, columns=16)
    with limited_cluster("550MiB") as client:
        before = _workers(client)
        ours = shuffled_outputs(df, partitions)
        assert _workers(client) == before, "a worker was restarted"
        stats = gpushuffle.statistics(client)
        assert (stats["host_to_disk_bytes"] > 0).all(), stats
        truth = expected_outputs(df, partitions)
    assert ours["rows"].sum() == rows
    _assert_same(ours, truth)


def test_a_hot_key_of_half_a_workers_memory_is_built_with_no_restart():
    """60% of 12M rows on one key (8 columns and the index: 0.50 GiB, at most
    half the limit), workers of 1 GiB: always built, and without pausing."""
    rows, partitions = 12_000_000, 24
    df = generated_frame(rows, partitions, columns=8, skew=0.6)
    with limited_cluster("1GiB") as client:
        before = _workers(client)
        client.run(_sample_rss)
        ours = shuffled_outputs(df, partitions)
        peaks = client.run(_peak_rss)
        assert _workers(client) == before, "a worker was restarted"
        # The hot partition's worker moved what its store held in memory to
        # disk before building it: the partition, the worker's own memory and
        # a full host budget came to 0.93 of the limit (the Nanny restarts at
        # 0.95); with the move, about 0.7 (distributed pauses at 0.8).
        assert max(peaks.values()) < 0.8 * 2**30, peaks
        assert gpushuffle.statistics(client)["output_sheds"].max() > 0
        truth = expected_outputs(df, partitions)
    hot = ours["rows"].max()
    assert 0.4 * 2**30 < hot * 9 * 8 <= 0.5 * 2**30, hot  # at most half a worker
    _assert_same(ours, truth)


def _verdict(df, partitions: int) -> str | pd.DataFrame:
    """The outputs, or the error's verdict with its numbers."""
    try:
        return shuffled_outputs(df, partitions)
    except gpushuffle.ShuffleOutputTooLargeError as e:
        # The numbers, not the shuffle id and worker address.
        return str(e)[str(e).index("output partition") :]


def test_a_hot_key_near_the_line_gets_the_same_verdict_every_run():
    """70% of 12M rows on one key (0.57 GiB) on 1 GiB workers: with the
    build and the worker's reserve, 22 MiB under the line (0.9 of the limit).
    Judged by moments of RSS, 0.6 GiB partitions were built in one run and
    refused in the next; the rule on sizes gives one answer, and never a
    restart."""
    rows, partitions = 12_000_000, 24
    df = generated_frame(rows, partitions, columns=8, skew=0.7)
    with (
        limited_cluster("1GiB") as client,
        dask.config.set({"distributed.scheduler.allowed-failures": 0}),
    ):
        before = _workers(client)
        verdicts = [_verdict(df, partitions) for _ in range(3)]
        assert _workers(client) == before, "a worker was restarted"
        built = [isinstance(v, pd.DataFrame) for v in verdicts]
        assert len(set(built)) == 1, verdicts
        if built[0]:
            truth = expected_outputs(df, partitions)
            for ours in verdicts:
                _assert_same(ours, truth)
        else:
            # The same partition and size each time (the base may differ by
            # a MiB: it is measured).
            assert len({v.split(";")[0] for v in verdicts}) == 1, verdicts


def test_a_hot_key_too_large_for_its_worker_is_a_clear_error_not_restarts():
    """90% of 12M rows (8 columns: 0.78 GiB with the index) on one key, workers
    of 1 GiB: the barrier fails the shuffle, naming the partition; no worker
    is restarted and none keeps anything of the shuffle."""
    rows, partitions = 12_000_000, 24
    df = generated_frame(rows, partitions, columns=8, skew=0.9)
    with limited_cluster("1GiB") as client:
        before = _workers(client)
        with (
            dask.config.set({"distributed.scheduler.allowed-failures": 0}),
            pytest.raises(
                gpushuffle.ShuffleOutputTooLargeError, match=r"output partition \d+ holds"
            ) as info,
        ):
            shuffled_outputs(df, partitions)
        assert "salt" in str(info.value)
        assert _workers(client) == before, "a worker was restarted"
        deadline = 30
        import time

        start = time.monotonic()
        while not all(is_clean(s) for s in client.run(worker_leftovers).values()):
            assert time.monotonic() - start < deadline, client.run(worker_leftovers)
            time.sleep(0.2)
