"""What distributed's own P2P tests check, checked for gpushuffle.

distributed's shuffle tests (``distributed/shuffle/tests/`` at 2026.7.1)
ship in neither its wheel nor its sdist, so they cannot run in CI as dask's
do (``ci/upstream_tests.py``).  These are gpushuffle's own tests of the
behaviours they check that apply to any P2P-style method used through
dask's API; each names the upstream test it follows.  Worker loss in every
phase is in ``test_faults.py``, floats in int meta in
``test_dask_semantics.py``.
"""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.dataframe.utils import assert_eq
from dask.utils import key_split
from distributed import Event
from distributed.core import Status
from faults import (
    TRANSFER,
    UNPACK,
    assert_correct,
    assert_scheduler_clean,
    cluster_test,
    gpushuffled,
    truth,
    wait_for,
    wait_for_shuffle,
    wait_for_tasks,
)
from test_faults import NIN, NOUT, ROWS, BlockedInputsDone, finish, held_at_barrier, parts_of

from gpushuffle.backends.pandas import PandasBackend
from gpushuffle.engine.memory import reset_worker_memory, worker_memory
from gpushuffle.engine.run import GPUShuffleRun

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _process_state():
    reset_worker_memory()
    yield
    reset_worker_memory()


def _p2p_failures(s: Any) -> int:
    return sum(e["action"] == "p2p-failed" for _, e in s.get_events("p2p"))


# -- the scheduler's p2p events ----------------------------------------------------


def _failing_part(i: int, rows: int) -> pd.DataFrame:
    from distributed import Event, get_client
    from faults import make_part

    if i == 3:
        Event("fail-input", client=get_client()).wait(60)
        raise RuntimeError("test error")
    return make_part(i, rows)


@cluster_test(n_workers=2, config={"distributed.scheduler.allowed-failures": 0})
async def test_an_error_before_the_shuffle_reaches_the_user_and_logs_no_p2p_failure(c, s, a, b):
    """test_erred_task_before_p2p_does_not_log_event"""
    from faults import make_part

    meta = make_part(0, 0)
    df = dd.from_map(_failing_part, range(NIN), [ROWS] * NIN, meta=meta, enforce_metadata=False)
    futures = c.compute(df.shuffle("key", npartitions=NOUT, shuffle_method="gpushuffle"))
    await wait_for_shuffle(s)
    await Event("fail-input", client=c).set()
    with pytest.raises(RuntimeError, match="test error"):
        await futures
    assert _p2p_failures(s) == 0
    del futures
    await finish(c, s)


@cluster_test(n_workers=2, config={"distributed.scheduler.allowed-failures": 1})
async def test_a_restart_that_recovers_logs_no_p2p_failure(c, s, a, b):
    """test_restarting_does_not_log_p2p_failed"""
    expected = truth(NIN, ROWS, NOUT)
    futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
    await wait_for_shuffle(s)
    await wait_for_tasks(s, TRANSFER, "memory", 1, b.address)
    await b.close()
    assert_correct(await c.gather(futures), expected)
    assert not s.get_events("p2p"), s.get_events("p2p")
    del futures
    await finish(c, s)


# -- errors keep their cause ---------------------------------------------------------


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise ValueError("boom: not a gpushuffle error")


@pytest.mark.parametrize("phase, target", [("transfer", "split_groups"), ("unpack", "assemble")])
@cluster_test(n_workers=2)
async def test_an_unexpected_error_reaches_the_user_with_its_cause(c, s, a, b, phase, target):
    """raises_with_cause(RuntimeError, "P2P .* failed", ...), as upstream checks."""
    with mock.patch.object(PandasBackend, target, _boom):
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT))
        with pytest.raises(RuntimeError, match=rf"^P2P \w+ failed during {phase} phase") as info:
            await futures
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and "boom" in str(cause), repr(cause)
    del futures
    await finish(c, s)


@pytest.mark.parametrize("recovery", ["partial", "restart"])
@cluster_test(n_workers=3)
async def test_a_shuffle_failed_before_a_worker_took_part_leaves_that_worker_connected(
    c, s, a, b, w, recovery
):
    """The one transfer fails before it sends anything: two of the three
    participating workers never created a run, so they do not know
    gpushuffle's stream ops, and what the scheduler tells a failed run's
    workers (release, drop what was kept) must not reach them: an op a
    worker does not know breaks its stream and cuts it off."""
    with (
        dask.config.set({"gpushuffle.recovery": recovery}),
        mock.patch.object(PandasBackend, "split_groups", _boom),
    ):
        futures = c.compute(gpushuffled(1, ROWS, NOUT))
        with pytest.raises(RuntimeError, match=r"P2P .* failed"):
            await futures
    del futures
    # A worker cut off closes; a shuffle over all three takes long enough to see it.
    expected = truth(NIN, ROWS, NOUT)
    assert_correct(await c.gather(c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())), expected)
    assert set(s.workers) == {a.address, b.address, w.address}
    assert all(worker.status == Status.running for worker in (a, b, w))
    await finish(c, s)


# -- part of the outputs, twice ------------------------------------------------------


@cluster_test(n_workers=2)
async def test_half_the_outputs_then_all_of_them_on_one_shuffle(c, s, a, b):
    """test_add_some_results and test_delete_some_results"""
    expected = truth(NIN, ROWS, NOUT)
    out = gpushuffled(NIN, ROWS, NOUT)
    half = c.persist(out.partitions[: NOUT // 2])
    await wait_for(lambda: any(ts.state == "memory" for ts in s.tasks.values()))
    everything = c.persist(out)
    parts = await parts_of(c, everything)
    assert_correct(parts, expected)
    first = await parts_of(c, half)
    for i, part in enumerate(first):
        pd.testing.assert_frame_equal(part, parts[i])
    del half, everything, out
    await finish(c, s)


# -- merges: one shuffle per side and parameters ------------------------------------


def test_a_frame_merged_twice_gets_a_shuffle_of_its_own_each_time(client):
    """test_merge_p2p_shuffle_reused_dataframe_with_different_parameters"""
    pdf1 = pd.DataFrame({"a": range(100), "b": range(0, 200, 2)})
    pdf2 = pd.DataFrame({"x": range(200), "y": [1, 2, 3, 4] * 50})
    ddf1 = dd.from_pandas(pdf1, npartitions=5)
    ddf2 = dd.from_pandas(pdf2, npartitions=10)
    with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
        out = (
            ddf1.merge(ddf2, left_on="a", right_on="x")
            .repartition(npartitions=20)
            .merge(ddf2, left_on="b", right_on="x")
        )
        barriers = {k for k in out.dask if str(k).startswith("shuffle-barrier-")}
        assert len(barriers) == 4, barriers
        result = out.compute()
    expected = pdf1.merge(pdf2, left_on="a", right_on="x").merge(pdf2, left_on="b", right_on="x")
    assert_eq(result, expected, check_index=False)


# -- data p2p's tests found hard -------------------------------------------------------


def test_partitions_with_categories_of_their_own(client):
    """test_handle_categorical_data (distributed issue 8186)"""
    df = dd.from_dict({"a": [1, 2, 3, 4, 5], "b": ["x", "y", "x", "y", "z"]}, npartitions=2)
    df["b"] = df.b.astype("category")
    shuffled = df.shuffle("a", shuffle_method="gpushuffle")
    result, expected = dask.compute(shuffled, df)
    assert_eq(result, expected, check_categorical=False)
    assert sorted(result["b"].astype(str)) == ["x", "x", "y", "y", "z"]


def test_lists_of_dicts_and_a_partition_of_nulls(client):
    """test_handle_null_partitions"""
    data = [
        {"companies": [], "id": "a", "x": None},
        {"companies": [{"id": 3}, {"id": 5}], "id": "b", "x": None},
        {"companies": [{"id": 3}, {"id": 4}, {"id": 5}], "id": "c", "x": "b"},
        {"companies": [{"id": 9}], "id": "a", "x": "a"},
    ]
    df = pd.DataFrame(data)
    out = dd.from_pandas(df, npartitions=2).shuffle(
        on="id", ignore_index=True, shuffle_method="gpushuffle"
    )
    # A plain RangeIndex with ignore_index: fresh indexes, as tasks gives
    # (p2p keeps the input's; meta says RangeIndex either way).
    assert_eq(out.compute(), df, check_index=False)


def _null_every_other(i: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    if i % 2 == 1:
        return pd.DataFrame({"a": rng.random(10), "b": [None] * 10})
    return pd.DataFrame({"a": rng.random(10), "b": rng.random(10)})


def test_float_meta_with_partitions_of_nothing_but_none(client):
    """test_handle_null_partitions_2 (xfail for p2p on pandas 3: dask/distributed#9184)"""
    with dask.config.set({"dataframe.convert-string": False}):
        ddf = dd.from_map(_null_every_other, range(5), meta={"a": float, "b": float})
    out = ddf.shuffle(on="a", ignore_index=True, shuffle_method="gpushuffle")
    expected, result = dask.compute(ddf, out)
    assert len(result) == len(expected) == 50
    assert result["b"].isna().sum() == expected["b"].isna().sum() == 20
    got = result.sort_values("a").reset_index(drop=True)
    want = expected.sort_values("a").reset_index(drop=True)
    np.testing.assert_array_equal(got["a"], want["a"])
    np.testing.assert_array_equal(got["b"].astype(float), want["b"].astype(float))


def _mismatched(i: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    if i % 2 == 1:
        return pd.DataFrame({"a": rng.random(10), "b": rng.integers(1, 10, 10)})
    return pd.DataFrame({"a": rng.random(10), "b": rng.random(10)})


def test_int_and_float_partitions_under_float_meta(client):
    """test_reconcile_partitions"""
    ddf = dd.from_map(_mismatched, range(50), meta={"a": float, "b": float})
    out = ddf.shuffle(on="a", ignore_index=True, shuffle_method="gpushuffle")
    expected, result = dask.compute(ddf, out)
    assert_eq(result, expected, check_index=False)  # fresh indexes, as with tasks


def test_numpy_arrays_in_an_object_column(client):
    """test_handle_object_columns"""
    with dask.config.set({"dataframe.convert-string": False}):
        df = pd.DataFrame(
            {
                "a": [1, 2, 3],
                "b": [np.asarray([1, 2, 3]), np.asarray([4, 5, 6]), np.asarray([7, 8, 9])],
                "c": ["foo", "bar", "baz"],
            }
        )
        shuffled = dd.from_pandas(df, npartitions=2).shuffle(on="a", shuffle_method="gpushuffle")
        result = shuffled.compute()
    assert_eq(result, df)


@pytest.mark.parametrize("keep", ["first", "last"])
def test_drop_duplicates_keeps_the_row_pandas_keeps(client, keep):
    """test_drop_duplicates_stable_ordering"""
    df = dask.datasets.timeseries(end="2000-01-05")
    with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
        result, expected = dask.compute(
            df.drop_duplicates(subset=["name"], keep=keep, split_out=df.npartitions), df
        )
    assert_eq(result, expected.drop_duplicates(subset=["name"], keep=keep))


# -- a stale run replaced by a newer one ---------------------------------------------


def _run_manager_blocking_tasks_and_fails() -> type:
    from distributed.shuffle._worker_plugin import _ShuffleRunManager

    class BlockedTasksAndFails(_ShuffleRunManager):
        """TEST DOUBLE around distributed's real run manager, as upstream's
        ``BlockedShuffleAccessAndFailShuffleRunManager``: task-side lookups
        wait until released, and the scheduler's "fail" is ignored until
        allowed (a message that has not arrived yet)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            import asyncio

            self.release_tasks = asyncio.Event()
            self.release_receives = asyncio.Event()
            self.received = asyncio.Event()
            self.allow_fail = False

        async def get_or_create(self, *args: Any, **kwargs: Any) -> Any:
            await self.release_tasks.wait()
            return await super().get_or_create(*args, **kwargs)

        async def get_with_run_id(self, *args: Any, **kwargs: Any) -> Any:
            await self.release_receives.wait()
            run = await super().get_with_run_id(*args, **kwargs)
            self.received.set()
            return run

        def fail(self, *args: Any, **kwargs: Any) -> None:
            if self.allow_fail:
                super().fail(*args, **kwargs)

    return BlockedTasksAndFails


@mock.patch(
    "distributed.shuffle._worker_plugin._ShuffleRunManager", _run_manager_blocking_tasks_and_fails()
)
@cluster_test(n_workers=2)
async def test_a_stale_run_is_replaced_when_a_peer_sends_for_a_newer_one(c, s, a, b):
    """test_replace_stale_shuffle: B still holds a run the scheduler has
    failed (the message has not reached it) when the shuffle runs again; the
    first shard A sends for the new run replaces it, and the result is right.
    (Upstream's own test, run with gpushuffle substituted, hung; probably in
    its wait for tasks named ``shuffle-transfer``, which gpushuffle names
    ``gpushuffle-transfer``: this port passes with the same blocking.)"""
    runs_a, runs_b = (w.plugins["shuffle"].shuffle_runs for w in (a, b))
    runs_a.allow_fail = True
    runs_a.release_tasks.set()
    runs_a.release_receives.set()
    runs_b.release_receives.set()  # B takes shards but runs none of its tasks

    expected = truth(NIN, ROWS, NOUT)
    out = c.persist(gpushuffled(NIN, ROWS, NOUT))
    shuffle_id = await wait_for_shuffle(s)
    await wait_for_tasks(s, TRANSFER, "memory", 1, a.address)
    await runs_b.received.wait()
    stale = runs_b._active_runs[shuffle_id]

    del out
    await wait_for(lambda: not s.tasks, what="the scheduler to forget the shuffle")
    await wait_for(lambda: shuffle_id not in runs_a._active_runs, what="A to close its run")
    assert runs_b._active_runs.get(shuffle_id) is stale and not stale.closed

    runs_b.received.clear()
    runs_b.allow_fail = True
    out = c.persist(gpushuffled(NIN, ROWS, NOUT))
    await runs_b.received.wait()
    run = runs_b._active_runs[shuffle_id]
    assert run is not stale and run.run_id > stale.run_id
    await stale._closed_event.wait()

    runs_b.release_tasks.set()
    assert_correct(await parts_of(c, out), expected)
    del out
    await finish(c, s)


# -- a worker that joins during the shuffle ------------------------------------------


@mock.patch("gpushuffle.engine.run.GPUShuffleRun", BlockedInputsDone)
@cluster_test(n_workers=1)
async def test_an_output_restricted_to_a_worker_that_joined_late_is_built_where_it_belongs(c, s, a):
    """test_unpack_gets_rescheduled_from_non_participating_worker: a worker
    that joins at the barrier takes no part in the run; an output task
    restricted to it is sent back to the worker that holds its shards."""
    from distributed import Worker

    expected = truth(NIN, ROWS, NOUT)
    futures, shuffle_id, runs = await held_at_barrier(c, s, (a,))
    async with Worker(s.address, nthreads=1) as late:
        key = next(k for k in s.tasks if key_split(k) == UNPACK)
        s.set_restrictions({key: {late.address}})
        runs[a].block_inputs_done.set()
        assert_correct(await c.gather(futures), expected)
        assert shuffle_id not in late.plugins["shuffle"].shuffle_runs._active_runs
        del futures
        await finish(c, s)


# -- the disk taken away ------------------------------------------------------------


@cluster_test(n_workers=2, config={"gpushuffle.memory.host-limit": "1 MiB"})
async def test_local_directories_removed_during_the_shuffle(c, s, a, b):
    """test_bad_disk: both workers' local directories are deleted (a scratch
    cleaner, a reset mount) as the run starts, before shards spill to them.
    p2p fails the shuffle; gpushuffle makes its spill directory when it first
    spills, so the shuffle succeeds, with every row once and nothing left."""
    import shutil

    out = c.persist(gpushuffled(NIN, ROWS, NOUT))
    shuffle_id = await wait_for_shuffle(s)
    for w in (a, b):
        await wait_for(lambda w=w: shuffle_id in w.plugins["shuffle"].shuffle_runs._active_runs)
        shutil.rmtree(w.local_directory)
    assert_correct(await parts_of(c, out), truth(NIN, ROWS, NOUT))
    assert worker_memory().snapshot()["host_to_disk_bytes"] > 0, "nothing spilled"
    del out
    await finish(c, s)


# -- an error where shards are received ----------------------------------------------

#: The worker whose receipt of shards fails (set by the test).
_FAILING_RECEIVER: list[str] = []


class _ReceiveFails(GPUShuffleRun):
    """A run whose receipt of shards from peers raises on one worker."""

    async def _receive(self, data: Any) -> None:
        if self.local_address in _FAILING_RECEIVER:
            raise ValueError("boom: receiving failed")
        await super()._receive(data)


@mock.patch("gpushuffle.engine.run.GPUShuffleRun", _ReceiveFails)
@cluster_test(n_workers=2, config={"gpushuffle.comm.same-host-reads": False})
async def test_an_error_receiving_shards_fails_the_shuffle_with_its_cause(c, s, a, b):
    """test_error_receive: the shuffle fails, in p2p's words, with the
    receiver's error in its causes, and nothing is left behind."""
    _FAILING_RECEIVER[:] = [b.address]
    try:
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT))
        # Small shards wait for more until the inputs are done (the barrier):
        # the receiver's error may come back from there.
        phase = r"^P2P \w+ failed during (transfer|barrier) phase"
        with pytest.raises(RuntimeError, match=phase) as info:
            await futures
    finally:
        _FAILING_RECEIVER.clear()
    causes = []
    error: BaseException | None = info.value
    while error is not None:
        causes.append(error)
        error = error.__cause__
    assert any("boom: receiving failed" in str(e) for e in causes), causes
    # The scheduler keeps the shuffle, and the workers their failed runs,
    # until the erred tasks are forgotten (distributed's plugin, as for p2p):
    # here when the client goes.  The runs' received shards and spill files
    # are released as the barrier errs, while the failed future is held.
    await wait_for(
        lambda: worker_memory().snapshot()["host_bytes"] == 0,
        what="the failed runs to release their shards",
    )
    # (Where the error came back in the transfer phase, distributed may have
    # closed the runs already: then none is left to check.)
    runs = [r for w in (a, b) for r in w.plugins["shuffle"].shuffle_runs._active_runs.values()]
    assert all(r.store.closed for r in runs), runs
    assert all(not os.path.exists(r.store._directory) for r in runs)
    del futures, info, causes, error, runs
    await c.close()
    await wait_for(
        lambda: not any(w.plugins["shuffle"].shuffle_runs._active_runs for w in (a, b)),
        what="the failed runs to close",
    )
    assert worker_memory().snapshot()["host_bytes"] == 0
    await assert_scheduler_clean(s)
