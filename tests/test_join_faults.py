"""Worker loss during a gpushuffle join: transfer and unpack, closed and crashed workers.

Every output partition is compared with dask's ``tasks`` join of the same
inputs (rows and checksums, computed locally), then the surviving workers
must hold nothing and the scheduler must forget both shuffles.
"""

from __future__ import annotations

import functools
import threading
from typing import Any
from unittest import mock

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.utils import key_split
from distributed import Nanny, wait
from distributed.diagnostics.plugin import SchedulerPlugin
from faults import (
    TRANSFER,
    assert_closed_worker_clean,
    assert_scheduler_clean,
    assert_workers_clean,
    cluster_test,
    count_tasks,
    frame,
    wait_for,
    wait_for_tasks,
)
from truth import checksum

from gpushuffle._distributed import barrier_key
from gpushuffle.backends.pandas import PandasBackend
from gpushuffle.engine.memory import reset_worker_memory

pytestmark = pytest.mark.timeout(180)

# As many inputs on both sides (see test_closed_worker_during_join_transfer).
NLEFT = NRIGHT = 24
ROWS, NOUT = 8000, 16
JOIN = "gpushuffle-join"


@pytest.fixture(autouse=True)
def _process_state():
    reset_worker_memory()
    yield
    reset_worker_memory()


def make_right(i: int, rows: int) -> pd.DataFrame:
    """Right input partition ``i``: the same rows wherever it is computed."""
    rng = np.random.default_rng(1000 + i)
    return pd.DataFrame(
        {
            # Sparse keys: about one match per left row (left keys are < 1000).
            "key": rng.integers(0, NRIGHT * rows, rows),
            "rrow": np.arange(i * rows, (i + 1) * rows),
            "y": pd.array([f"r{v}" for v in rng.integers(0, 9, rows)], dtype="string[pyarrow]"),
        }
    )


def joined(how: str = "inner", method: str = "gpushuffle") -> dd.DataFrame:
    right = dd.from_map(make_right, range(NRIGHT), rows=ROWS, meta=make_right(0, 0))
    return frame(NLEFT, ROWS).merge(
        right, on="key", how=how, npartitions=NOUT, shuffle_method=method
    )


@functools.cache
def truth(how: str) -> tuple[tuple[int, int], ...]:
    """(rows, checksum) of each output partition of dask's ``tasks`` join, computed locally."""
    parts = dask.compute(*joined(how, "tasks").to_delayed(), scheduler="sync")
    return tuple((len(p), checksum(p, index=False)) for p in parts)


def assert_correct(parts: list[pd.DataFrame], how: str) -> None:
    expected = truth(how)
    assert len(parts) == len(expected)
    for i, (part, (nrows, digest)) in enumerate(zip(parts, expected, strict=True)):
        assert len(part) == nrows, f"output partition {i}: {len(part)} rows, truth {nrows}"
        assert checksum(part, index=False) == digest, f"output partition {i} differs"


async def wait_for_join(s) -> list[str]:
    """The ids of the join's two shuffles, once both are active."""
    plugin = s.plugins["shuffle"]
    await wait_for(lambda: len(plugin.active_shuffles) == 2, what="both sides' shuffles")
    return sorted(plugin.active_shuffles)


def restarted(s, ids: list[str]) -> bool:
    shuffles = s.plugins["shuffle"]._shuffles
    return all(len({state.run_id for state in shuffles[i]}) >= 2 for i in ids)


async def finish(c, s) -> None:
    await assert_workers_clean(c)
    await c.close()
    await assert_scheduler_clean(s)


def transfers_done(s, shuffle_id: str) -> int:
    """Transfer tasks of one side (one shuffle) whose result is in memory."""
    return sum(
        1
        for ts in s.tasks.values()
        if ts.state == "memory" and f"transfer-{shuffle_id}" in str(ts.key)
    )


@cluster_test(n_workers=2)
async def test_join_outputs_are_pinned_to_their_workers_as_the_runs_start(c, s, a, b):
    """Both sides' runs map every output partition to the same worker, and
    the join's output tasks are restricted to it as the first run is
    created: none runs elsewhere first only to be rescheduled."""
    truth("inner")
    sent_back = []

    class CountReschedules(SchedulerPlugin):
        def transition(self, key, start, finish, *args, **kwargs):
            if key_split(key) == JOIN and (start, finish) == ("processing", "released"):
                sent_back.append(key)

    s.add_plugin(CountReschedules(), name="count-reschedules")
    futures = c.compute(joined("inner").to_delayed())
    plugin = s.plugins["shuffle"]
    await wait_for(lambda: plugin.active_shuffles, what="a side's shuffle")
    (first,) = plugin.active_shuffles
    worker_for = plugin.active_shuffles[first].run_spec.worker_for
    outputs = [ts for ts in s.tasks.values() if key_split(ts.key) == JOIN]
    assert len(outputs) == NOUT
    assert {ts.key[1]: ts.worker_restrictions for ts in outputs} == {
        p: {w} for p, w in worker_for.items()
    }
    ids = await wait_for_join(s)
    assert all(plugin.active_shuffles[i].run_spec.worker_for == worker_for for i in ids)
    assert_correct(await c.gather(futures), "inner")
    assert sent_back == []
    del futures
    await finish(c, s)


@pytest.mark.parametrize("how", ["inner", "outer"])
@cluster_test(n_workers=2)
async def test_closed_worker_during_join_transfer(c, s, a, b, how):
    truth(how)
    futures = c.compute(joined(how).to_delayed())
    ids = await wait_for_join(s)
    # Mid-transfer on both sides: neither side's barrier can have started.
    # (A barrier whose broadcast reaches a worker that is closing its shuffle
    # plugin but still answers fails with "Unexpected error encountered during
    # P2P barrier: ShuffleClosedError" instead of restarting: a race in
    # distributed's barrier, for p2p as for gpushuffle.)
    await wait_for(
        lambda: (
            count_tasks(s, TRANSFER, "memory", b.address) >= 1
            and all(transfers_done(s, i) < NLEFT for i in ids)
        ),
        what="a transfer done on b while both sides still transfer",
    )
    await b.close()
    assert_closed_worker_clean(b)
    assert_correct(await c.gather(futures), how)
    # Both sides ran again without b: their outputs must stay aligned.
    assert restarted(s, ids)
    del futures
    await finish(c, s)


@cluster_test(n_workers=2)
async def test_closed_worker_during_join_unpack(c, s, a, b):
    truth("left")
    futures = c.compute(joined("left").to_delayed())
    ids = await wait_for_join(s)
    await wait_for_tasks(s, JOIN, "memory", 1, b.address)
    assert count_tasks(s, JOIN, "memory") < NOUT
    await b.close()
    assert_closed_worker_clean(b)
    assert_correct(await c.gather(futures), "left")
    assert restarted(s, ids)
    del futures
    await finish(c, s)


@cluster_test(n_workers=1, timeout=90)
async def test_crashed_worker_during_join_unpack(c, s, a):
    truth("inner")
    async with Nanny(s.address, nthreads=1) as n:
        crashed = n.worker_address
        futures = c.compute(joined("inner").to_delayed())
        ids = await wait_for_join(s)
        await wait_for_tasks(s, JOIN, "memory", 1, crashed)
        assert count_tasks(s, JOIN, "memory") < NOUT
        await n.process.process.kill()
        assert_correct(await c.gather(futures), "inner")
        assert restarted(s, ids)
        del futures
        await wait_for(
            lambda: n.worker_address not in (None, crashed) and n.worker_address in s.workers,
            what="the nanny to restart its worker",
        )
        await assert_workers_clean(c)
    await finish(c, s)


@pytest.mark.parametrize("recovery", ["partial", "restart"])
@cluster_test(n_workers=3, config={"distributed.scheduler.work-stealing": False}, timeout=120)
async def test_one_side_restarted_while_the_join_builds_its_outputs(c, s, a, b, w3, recovery):
    """The worker that owns no output (3 workers, 2 outputs) holds left
    transfers only, and leaves while every output task has read both sides
    and merges them: the left side runs again, the right side does not, and
    the output tasks run again.  The right side's rows were taken out of its
    store by their first read: its run must not build them again from what
    is left (nothing: every output came out empty), but run again itself."""
    nout, workers = 2, {w.address: w for w in (a, b, w3)}
    owners, idle = sorted(workers)[:2], sorted(workers)[-1]
    right = dd.from_map(make_right, range(NRIGHT), rows=ROWS, meta=make_right(0, 0))
    tasks = frame(NLEFT, ROWS).merge(right, on="key", npartitions=nout, shuffle_method="tasks")
    expected = dask.compute(*tasks.to_delayed(), scheduler="sync")
    right = c.persist(right, workers=owners)
    left = c.persist(frame(NLEFT, ROWS), workers=[idle], allow_other_workers=True)
    await wait([left, right])
    gate, merging = threading.Event(), []
    merge = PandasBackend.merge

    def held_merge(self: PandasBackend, *args: Any, **kwargs: Any) -> Any:
        merging.append(1)
        gate.wait(60)
        return merge(self, *args, **kwargs)

    settings = {"gpushuffle.recovery": recovery}
    with dask.config.set(settings), mock.patch.object(PandasBackend, "merge", held_merge):
        out = left.merge(right, on="key", npartitions=nout, shuffle_method="gpushuffle")
        futures = c.compute(out.to_delayed())
        ids = await wait_for_join(s)
        await wait_for(lambda: len(merging) == nout, what="both outputs merging")
        # idle ran left transfers only: it takes part in the left side's run.
        active = s.plugins["shuffle"].active_shuffles
        (left_id,) = [i for i in ids if idle in active[i].participating_workers]
        await workers[idle].close()
        # The left side's barrier released (restarting it), and with it the
        # output tasks; the merges under way then end, their results unwanted.
        await wait_for(lambda: s.tasks[barrier_key(left_id)].state != "memory")
        gate.set()
        got = await c.gather(futures)
    assert [len(p) for p in got] == [len(p) for p in expected]
    for part, truth_part in zip(got, expected, strict=True):
        assert checksum(part, index=False) == checksum(truth_part, index=False)
    assert restarted(s, ids)  # the right side too, once its rows were found gone
    del futures, left, right, out
    await finish(c, s)
