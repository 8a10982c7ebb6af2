"""Worker loss: distributed's own P2P fault scenarios, run with shuffle_method="gpushuffle".

Borrowed from ``distributed/shuffle/tests/test_shuffle.py`` (closed and
crashed workers during transfer, barrier and unpack; input-only, bystanding
and new workers; persisted outputs lost; ``allowed-failures: 0``).  Each
test compares every output partition with dask's ``tasks`` shuffle (rows
and checksums) or expects the documented error, then checks that no run, no
store bytes and no spill file is left on any surviving worker, and that the
scheduler forgot the shuffle.

The scheduler and the ``Worker``s of ``cluster_test`` live in this process
(real TCP comms between them); a ``Nanny`` starts a real worker process,
for crashes.  In-process workers share one memory budget, gpushuffle's
per-process ``WorkerMemory``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any
from unittest import mock

import dask
import pytest
from dask.utils import key_split
from distributed import KilledWorker, Nanny, Reschedule, Worker, wait
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.worker import Status
from faults import (
    TRANSFER,
    UNPACK,
    assert_closed_worker_clean,
    assert_correct,
    assert_scheduler_clean,
    assert_workers_clean,
    cluster_test,
    count_tasks,
    frame,
    gpushuffled,
    gpushuffled_gated,
    local_directory_of,
    run_ids,
    spill_files,
    spill_files_on,
    truth,
    wait_for,
    wait_for_shuffle,
    wait_for_tasks,
)

from gpushuffle._distributed import barrier_key
from gpushuffle.backends.pandas import PandasBackend
from gpushuffle.engine.memory import reset_worker_memory, worker_memory
from gpushuffle.engine.run import GPUShuffleRun, GPUShuffleSpec

pytestmark = pytest.mark.timeout(180)

NIN, ROWS, NOUT = 40, 4000, 30
SPILL = {"gpushuffle.memory.host-limit": "1 MiB"}


@pytest.fixture(autouse=True)
def _process_state():
    # Budgets are per process (shared by this process's workers) and read
    # from the configuration on first use: forget them around each test.
    reset_worker_memory()
    yield
    reset_worker_memory()


def settings(budget: str | None) -> dict:
    return SPILL if budget == "spill" else {}


async def parts_of(c: Any, collection: Any) -> list:
    """Every output partition, computed together in one graph."""
    return await c.gather(c.compute(collection.to_delayed()))


async def finish(c: Any, s: Any) -> None:
    """Surviving workers hold nothing; once the client is gone the scheduler neither."""
    await assert_workers_clean(c)
    await c.close()
    await assert_scheduler_clean(s)


# -- closed workers -----------------------------------------------------------


# Both recovery modes (here, during the unpack and in the crash tests below):
# partial is the default, restart (p2p's way) is opt-in.
@pytest.mark.parametrize("recovery", ["partial", "restart"])
@pytest.mark.parametrize("budget", ["memory", "spill"])
@cluster_test(n_workers=2)
async def test_closed_worker_during_transfer(c, s, a, b, budget, recovery):
    expected = truth(NIN, ROWS, NOUT)
    with dask.config.set({**settings(budget), "gpushuffle.recovery": recovery}):
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        await wait_for_tasks(s, TRANSFER, "memory", 1, b.address)
        if budget == "spill":
            await wait_for(lambda: spill_files(b.local_directory), what="spill files on b")
        # Mid-transfer: some inputs are in, not all.
        assert count_tasks(s, TRANSFER, "memory") < NIN
        await b.close()
        assert_closed_worker_clean(b)

        assert_correct(await c.gather(futures), expected)
        assert len(run_ids(s, shuffle_id)) >= 2  # restarted without b
    del futures
    await finish(c, s)


@cluster_test(n_workers=2)
async def test_closed_input_only_worker_during_transfer(c, s, a, b):
    """Every output partition on a: b only sends, and leaves while sending."""
    expected = truth(NIN, ROWS, NOUT)

    def only_a(self, partition, workers):
        return a.address

    with mock.patch.object(GPUShuffleSpec, "pick_worker", only_a):
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        await wait_for_tasks(s, TRANSFER, "memory", 1, b.address)
        assert count_tasks(s, TRANSFER, "memory") < NIN
        await b.close()
        assert_closed_worker_clean(b)
        assert_correct(await c.gather(futures), expected)
    assert len(run_ids(s, shuffle_id)) >= 2
    del futures
    await finish(c, s)


@cluster_test(n_workers=3)
async def test_closed_bystanding_worker_during_shuffle(c, s, w1, w2, w3):
    """A worker outside the shuffle leaving does not restart it."""
    expected = truth(NIN, ROWS, NOUT)
    futures = c.compute(
        gpushuffled(NIN, ROWS, NOUT).to_delayed(),
        workers=[w1.address, w2.address],
        allow_other_workers=False,
    )
    shuffle_id = await wait_for_shuffle(s)
    await wait_for_tasks(s, TRANSFER, "memory", 1, w1.address)
    await wait_for_tasks(s, TRANSFER, "memory", 1, w2.address)
    await w3.close()
    assert_closed_worker_clean(w3)
    assert_correct(await c.gather(futures), expected)
    assert len(run_ids(s, shuffle_id)) == 1  # never restarted
    del futures
    await finish(c, s)


class BlockedInputsDone(GPUShuffleRun):
    """Holds every worker at the barrier until the test lets it through."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_inputs_done = asyncio.Event()
        self.block_inputs_done = asyncio.Event()

    async def inputs_done(self) -> None:
        self.in_inputs_done.set()
        await self.block_inputs_done.wait()
        await super().inputs_done()


class BlockedUnpack(GPUShuffleRun):
    """Holds every unpack until the test lets it through."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_unpack = threading.Event()
        self.release_unpack = threading.Event()

    def _get_output_partition(self, partition_id: int, key: Any, **kwargs: Any) -> Any:
        self.in_unpack.set()
        self.release_unpack.wait(60)
        return super()._get_output_partition(partition_id, key, **kwargs)


@mock.patch("gpushuffle.engine.run.GPUShuffleRun", BlockedUnpack)
@cluster_test(n_workers=2, timeout=90)
async def test_output_asked_of_another_worker_is_rescheduled_to_its_own(c, s, a, b):
    """An output partition asked of a worker it is not assigned to is sent
    back to the scheduler (restricted to its worker) without being built; the
    check is made in the task's thread (only a reschedule goes through the
    event loop)."""
    expected = truth(NIN, ROWS, NOUT)
    futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
    shuffle_id = await wait_for_shuffle(s)
    try:
        await wait_for(
            lambda: (
                shuffle_id in a.plugins["shuffle"].shuffle_runs._active_runs
                and active_run(a, shuffle_id).in_unpack.is_set()
            ),
            what="an unpack on a",
        )
        run = active_run(a, shuffle_id)
        elsewhere = next(p for p, w in sorted(run.worker_for.items()) if w != a.address)
        (key,) = (
            ts.key
            for ts in s.tasks.values()
            if key_split(ts.key) == UNPACK and isinstance(ts.key, tuple) and ts.key[1] == elsewhere
        )
        # Sent back at once: building it would block in _get_output_partition.
        with pytest.raises(Reschedule):
            await asyncio.wait_for(
                asyncio.to_thread(run.get_output_partition, elsewhere, key), timeout=20
            )
        assert s.tasks[key].worker_restrictions == {run.worker_for[elsewhere]}
    finally:
        for w in (a, b):
            for r in w.plugins["shuffle"].shuffle_runs._active_runs.values():
                r.release_unpack.set()
    assert_correct(await c.gather(futures), expected)
    del futures
    await assert_workers_clean(c)
    await finish(c, s)


class CountReschedules(SchedulerPlugin):
    """Counts output tasks sent back from processing (``Reschedule``)."""

    name = "count-reschedules"

    def __init__(self) -> None:
        self.count = 0

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        name = key_split(key)
        output = name.split("-")[0] == "gpushuffle" and name != TRANSFER  # unpack, maybe fused
        if output and (start, finish) == ("processing", "released"):
            self.count += 1


def _identity(part: Any) -> Any:
    return part


@pytest.mark.parametrize("fused", [False, True])
@cluster_test(n_workers=2, timeout=90)
async def test_output_tasks_are_pinned_to_their_workers_as_the_run_starts(c, s, a, b, fused):
    """When the scheduler creates a run, every output task (alone or fused
    with a step after it) is restricted to its output's worker: none first
    runs on another worker only to be sent back (distributed's way, which
    with two workers ran about half of them twice).  The restrictions are
    distributed's, and are lifted as it lifts them when the run ends."""
    expected = truth(NIN, ROWS, NOUT)
    counter = CountReschedules()
    s.add_plugin(counter)
    shuffled = gpushuffled(NIN, ROWS, NOUT)
    if fused:
        shuffled = shuffled.map_partitions(_identity)
    futures = c.compute(shuffled.to_delayed())
    shuffle_id = await wait_for_shuffle(s)
    # Checked in the same turn of the event loop as the run was created.
    worker_for = s.plugins["shuffle"].active_shuffles[shuffle_id].run_spec.worker_for
    outputs = s.tasks[barrier_key(shuffle_id)].dependents
    assert len(outputs) == NOUT
    assert all((key_split(ts.key) == UNPACK) != fused for ts in outputs)
    assert {ts.key[1]: ts.worker_restrictions for ts in outputs} == {
        p: {w} for p, w in worker_for.items()
    }
    assert len(set(worker_for.values())) == 2
    parts = await c.gather(futures)
    assert_correct(parts, expected)
    assert counter.count == 0
    del futures
    await assert_workers_clean(c)
    await finish(c, s)


class SchedulerWithoutInstances:
    """distributed's ``Scheduler`` as an upgrade might leave it: no ``_instances``."""


@mock.patch("gpushuffle._distributed.Scheduler", SchedulerWithoutInstances)
@cluster_test(n_workers=2, timeout=90)
async def test_a_run_starts_when_output_tasks_cannot_be_pinned(c, s, a, b, caplog):
    """Pinning reaches into the scheduler plugin's private API; where a
    distributed upgrade changes it (simulated: ``Scheduler._instances`` gone),
    the run still starts, says why in one warning, and its output tasks go
    distributed's way (restricted on first run, rescheduled), with every
    row delivered once."""
    expected = truth(NIN, ROWS, NOUT)
    with caplog.at_level("WARNING", logger="gpushuffle._distributed"):
        parts = await c.gather(c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed()))
    assert_correct(parts, expected)
    warnings = [r for r in caplog.records if "could not pin the output tasks" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].exc_info is not None
    await assert_workers_clean(c)
    await finish(c, s)


class InputsDoneTwice(GPUShuffleRun):
    """The scheduler's barrier retried while the first call still drains the
    shards held back for peers (it retries a worker that answered with an
    OSError): both calls overlap, the first one slowed while it hands them
    to the comm buffer."""

    async def _write_to_comm(self, data: Any) -> None:
        if self._inputs_done_started:
            await asyncio.sleep(0.05)
        await super()._write_to_comm(data)

    async def inputs_done(self) -> None:
        await asyncio.gather(super().inputs_done(), super().inputs_done())


@mock.patch("gpushuffle.engine.run.GPUShuffleRun", InputsDoneTwice)
@cluster_test(n_workers=2, timeout=90)
async def test_overlapping_inputs_done_loses_no_held_back_shard(c, s, a, b):
    expected = truth(NIN, ROWS, NOUT)
    assert_correct(await c.gather(c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())), expected)
    await assert_workers_clean(c)
    await finish(c, s)


def active_run(worker: Any, shuffle_id: str) -> Any:
    return worker.plugins["shuffle"].shuffle_runs._active_runs[shuffle_id]


async def held_at_barrier(c: Any, s: Any, workers: tuple[Any, ...]) -> tuple[Any, str, dict]:
    """Compute the standard shuffle under ``BlockedInputsDone`` until every
    worker is held in its barrier; the futures, the shuffle id and each
    worker's run."""
    futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
    shuffle_id = await wait_for_shuffle(s)
    key = barrier_key(shuffle_id)
    await wait_for(lambda: key in s.tasks and s.tasks[key].state == "processing")
    runs = {w: active_run(w, shuffle_id) for w in workers}
    for run in runs.values():
        await run.in_inputs_done.wait()
    return futures, shuffle_id, runs


async def restarted_run(worker: Any, shuffle_id: str, old: Any) -> Any:
    runs = worker.plugins["shuffle"].shuffle_runs._active_runs

    def restarted() -> bool:
        run = runs.get(shuffle_id)
        return run is not None and run.run_id > old.run_id

    await wait_for(restarted, what="the shuffle to restart")
    return runs[shuffle_id]


@pytest.mark.parametrize("close", ["barrier-worker", "other-worker"])
@mock.patch("gpushuffle.engine.run.GPUShuffleRun", BlockedInputsDone)
@cluster_test(n_workers=2)
async def test_closed_worker_during_barrier(c, s, a, b, close):
    expected = truth(NIN, ROWS, NOUT)
    futures, shuffle_id, runs = await held_at_barrier(c, s, (a, b))
    # Every input transferred; both workers are inside the barrier.
    assert count_tasks(s, TRANSFER, "memory") == NIN
    on = s.tasks[barrier_key(shuffle_id)].processing_on.address
    barrier_worker, other = (a, b) if on == a.address else (b, a)
    closing, alive = (
        (barrier_worker, other) if close == "barrier-worker" else (other, barrier_worker)
    )

    await closing.close()
    assert_closed_worker_clean(closing)
    runs[alive].block_inputs_done.set()
    restarted = await restarted_run(alive, shuffle_id, runs[alive])
    restarted.block_inputs_done.set()

    assert_correct(await c.gather(futures), expected)
    del futures
    await finish(c, s)


@mock.patch("gpushuffle.engine.run.GPUShuffleRun", BlockedInputsDone)
@cluster_test(n_workers=2)
async def test_no_sent_shard_stays_in_memory_until_the_barrier(c, s, a, b):
    """distributed's comm buffer keeps the last message each of its send
    tasks sent until that task has another: on a worker that distributed
    paused (it runs no transfer) that memory never went, and the worker
    never resumed (a shuffle hung so on 500 MiB workers).  Once every input
    is transferred, no shard that was sent or received holds its rows."""
    import gc

    from gpushuffle.transport import Shard

    expected = truth(NIN, ROWS, NOUT)
    # Messages so small that no shard waits on its sender for others.
    with dask.config.set({"gpushuffle.comm.message-bytes-limit": "1 KiB"}):
        futures, _, runs = await held_at_barrier(c, s, (a, b))
        assert count_tasks(s, TRANSFER, "memory") == NIN
        assert sum(run.total_recvd for run in runs.values()) > 0  # shards crossed
        alive = [o for o in gc.get_objects() if isinstance(o, Shard) and o.table is not None]
        for run in runs.values():
            run.block_inputs_done.set()
        assert not alive, f"{len(alive)} shards still hold their rows at the barrier"
        assert_correct(await c.gather(futures), expected)
    del futures
    await finish(c, s)


@mock.patch("gpushuffle.engine.run.GPUShuffleRun", BlockedInputsDone)
# The test pauses the worker itself: distributed's memory monitor, which
# would resume it within 100 ms (its memory is low), is off.
@cluster_test(n_workers=2, config={"distributed.worker.memory.pause": False})
async def test_a_paused_worker_moves_the_shards_its_store_holds_to_disk(c, s, a, b):
    """distributed pauses a worker whose memory passes its pause threshold:
    it runs no task until its memory drops.  A store within its budget kept
    what it held, so a paused worker with transfers left never resumed (a
    shuffle hung so on 600 MiB workers).  Paused, it moves its received
    shards to disk; a worker left running keeps its own; every row comes out."""
    expected = truth(NIN, ROWS, NOUT)
    futures, _, runs = await held_at_barrier(c, s, (a, b))
    paused, running = runs[a].store.statistics, runs[b].store.statistics
    assert paused.host_bytes > 0 and paused.disk_bytes == 0
    a.status = Status.paused
    try:
        await wait_for(lambda: paused.host_bytes == 0, timeout=10, what="the paused store to shed")
    finally:
        a.status = Status.running
    assert paused.disk_bytes > 0 and paused.groups_shed > 0
    assert running.disk_bytes == 0 and running.groups_shed == 0 and running.host_bytes > 0
    # Both workers share this process's budgets (and the count that
    # gpushuffle.statistics reports): it is the paused one's.
    assert worker_memory().snapshot()["pause_sheds"] == paused.groups_shed
    for run in runs.values():
        run.block_inputs_done.set()
    assert_correct(await c.gather(futures), expected)
    del futures
    await finish(c, s)


@pytest.mark.parametrize("recovery", ["partial", "restart"])
@pytest.mark.parametrize("budget", ["memory", "spill"])
@cluster_test(n_workers=2)
async def test_closed_worker_during_unpack(c, s, a, b, budget, recovery):
    expected = truth(NIN, ROWS, NOUT)
    with dask.config.set({**settings(budget), "gpushuffle.recovery": recovery}):
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        await wait_for_tasks(s, UNPACK, "memory", 1, b.address)
        assert count_tasks(s, UNPACK, "memory") < NOUT
        await b.close()
        assert_closed_worker_clean(b)
        assert_correct(await c.gather(futures), expected)
    assert len(run_ids(s, shuffle_id)) >= 2
    del futures
    await finish(c, s)


@cluster_test(n_workers=3)
async def test_closed_worker_between_repeats(c, s, w1, w2, w3):
    """The same shuffle computed again after workers left runs on the ones left."""
    expected = truth(NIN, ROWS, NOUT)
    out = gpushuffled(NIN, ROWS, NOUT)
    assert_correct(await parts_of(c, out), expected)
    await assert_workers_clean(c)
    await w3.close()
    assert_correct(await parts_of(c, out), expected)
    await assert_workers_clean(c)
    await w2.close()
    assert_correct(await parts_of(c, out), expected)
    await finish(c, s)


@cluster_test(n_workers=2)
async def test_new_worker_during_shuffle(c, s, a, b):
    expected = truth(NIN, ROWS, NOUT)
    futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
    shuffle_id = await wait_for_shuffle(s)
    async with Worker(s.address, nthreads=1) as w:
        assert_correct(await c.gather(futures), expected)
        assert len(run_ids(s, shuffle_id)) == 1  # a worker joining restarts nothing
        del futures
        assert w.address in s.workers
        await assert_workers_clean(c)  # the new worker included
    await finish(c, s)


@cluster_test(
    n_workers=0,
    # Keep the memory monitor from resetting the status set by hand below.
    config={"distributed.worker.memory.monitor-interval": "60s"},
)
async def test_restarting_does_not_deadlock(c, s):
    """distributed#8088: the only input worker pauses while the other worker leaves."""
    expected = truth(NIN, ROWS, NOUT)
    async with Worker(s.address, nthreads=1) as a:
        # a holds every input; b joins later and holds none.
        inputs = c.persist(frame(NIN, ROWS))
        await wait(inputs)
        async with Worker(s.address, nthreads=1) as b:
            assert not s.workers[b.address].has_what
            out = inputs.shuffle("key", npartitions=NOUT, shuffle_method="gpushuffle")
            futures = c.compute(out.to_delayed())
            await wait_for_shuffle(s)
            a.status = Status.paused
            await wait_for(lambda: len(s.running) == 1, what="a to pause")
            b.batched_stream.close()
            await wait_for(lambda: not s.running, what="b to leave")
            a.status = Status.running
            await wait_for(lambda: s.running, what="a to run")
            assert_correct(await c.gather(futures), expected)
            del futures, inputs
            await assert_workers_clean(c)
    await c.close()
    await assert_scheduler_clean(s)


# -- allowed-failures: 0 -> KilledWorker, not a hang ------------------------


@pytest.mark.parametrize("phase", [TRANSFER, UNPACK])
@cluster_test(n_workers=2, config={"distributed.scheduler.allowed-failures": 0})
async def test_closed_worker_with_no_allowed_failures_raises_killed_worker(c, s, a, b, phase):
    futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
    await wait_for_shuffle(s)
    # b is running a task of this phase when it goes.
    await wait_for_tasks(s, phase, "processing", 1, b.address)
    await b.close()
    with pytest.raises(KilledWorker):
        await c.gather(futures)
    assert sum(e["action"] == "p2p-failed" for _, e in s.get_events("p2p")) == 1
    del futures
    await finish(c, s)


@mock.patch("gpushuffle.engine.run.GPUShuffleRun", BlockedInputsDone)
@cluster_test(n_workers=2, config={"distributed.scheduler.allowed-failures": 0})
async def test_closed_barrier_worker_with_no_allowed_failures_raises_killed_worker(c, s, a, b):
    futures, shuffle_id, runs = await held_at_barrier(c, s, (a, b))
    closing = a if s.tasks[barrier_key(shuffle_id)].processing_on.address == a.address else b
    alive = b if closing is a else a
    await closing.close()
    with pytest.raises(KilledWorker):
        await c.gather(futures)
    assert sum(e["action"] == "p2p-failed" for _, e in s.get_events("p2p")) == 1
    runs[alive].block_inputs_done.set()
    del futures
    await finish(c, s)


# -- crashed worker processes (a Nanny restarts them) -------------------------


async def wait_for_restart(s: Any, nanny: Nanny, old: str) -> None:
    await wait_for(
        lambda: nanny.worker_address not in (None, old) and nanny.worker_address in s.workers,
        what="the nanny to restart its worker",
    )


@pytest.mark.parametrize("budget", ["memory", "spill"])
@cluster_test(n_workers=1, timeout=90)
async def test_crashed_worker_during_transfer(c, s, a, budget, tmp_path):
    expected = truth(NIN, ROWS, NOUT)
    # Worker a waits at its third input until the crash: a transfer is
    # still to come when the crash comes, whatever the machine's speed.
    gate = str(tmp_path / "crashed")
    with dask.config.set(settings(budget)):
        async with Nanny(s.address, nthreads=1) as n:
            crashed = n.worker_address
            directory = await local_directory_of(c, crashed)
            futures = c.compute(gpushuffled_gated(NIN, ROWS, NOUT, gate, a.address).to_delayed())
            shuffle_id = await wait_for_shuffle(s)
            await wait_for_tasks(s, TRANSFER, "memory", 1, crashed)
            if budget == "spill":
                deadline = asyncio.get_running_loop().time() + 30
                while not await spill_files_on(c, crashed):
                    assert asyncio.get_running_loop().time() < deadline, "nothing spilled"
            assert count_tasks(s, TRANSFER, "memory") < NIN
            await n.process.process.kill()
            open(gate, "w").close()

            assert_correct(await c.gather(futures), expected)
            assert len(run_ids(s, shuffle_id)) >= 2
            del futures
            # The worker the Nanny started in its place purged the dead one's
            # directory, spill files included (distributed's WorkSpace does).
            await wait_for_restart(s, n, crashed)
            assert not os.path.exists(directory)
            await assert_workers_clean(c)
    await finish(c, s)


@pytest.mark.parametrize("recovery", ["partial", "restart"])
@pytest.mark.parametrize("budget", ["memory", "spill"])
@cluster_test(n_workers=1, timeout=90)
async def test_crashed_worker_during_unpack(c, s, a, budget, recovery):
    expected = truth(NIN, ROWS, NOUT)
    with dask.config.set({**settings(budget), "gpushuffle.recovery": recovery}):
        async with Nanny(s.address, nthreads=1) as n:
            crashed = n.worker_address
            futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
            shuffle_id = await wait_for_shuffle(s)
            await wait_for_tasks(s, UNPACK, "memory", 1, crashed)
            assert count_tasks(s, UNPACK, "memory") < NOUT
            await n.process.process.kill()

            assert_correct(await c.gather(futures), expected)
            assert len(run_ids(s, shuffle_id)) >= 2
            del futures
            await wait_for_restart(s, n, crashed)
            await assert_workers_clean(c)
    await finish(c, s)


@mock.patch("gpushuffle.engine.run.GPUShuffleRun", BlockedInputsDone)
@cluster_test(n_workers=1, timeout=90)
async def test_crashed_other_worker_during_barrier(c, s, a):
    expected = truth(NIN, ROWS, NOUT)
    async with Nanny(s.address, nthreads=1) as n:
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        key = barrier_key(shuffle_id)
        # The barrier runs on a (in this process, where the run is blocked).
        s.set_restrictions({key: {a.address}})
        await wait_for(lambda: key in s.tasks and s.tasks[key].state == "processing")
        run = active_run(a, shuffle_id)
        await run.in_inputs_done.wait()
        await n.process.process.kill()
        run.block_inputs_done.set()
        restarted = await restarted_run(a, shuffle_id, run)
        restarted.block_inputs_done.set()

        assert_correct(await c.gather(futures), expected)
        del futures
        await assert_workers_clean(c)
    await finish(c, s)


@pytest.mark.parametrize("recovery", ["partial", "restart"])
@cluster_test(n_workers=2, config={"distributed.comm.timeouts.connect": "60s"}, timeout=150)
async def test_worker_gone_after_a_failed_barrier_broadcast(c, s, a, b, recovery):
    """The barrier's broadcast to b fails with an OSError and b leaves before
    distributed's retry: the barrier gives up at once.  Retried, it would
    connect to b's closed address for the whole connect timeout (60 s here)
    while the run that follows waits for the old barrier task on a."""
    expected = truth(NIN, ROWS, NOUT)
    closing: list[asyncio.Task] = []

    def reset_then_leave(comm: Any, **kwargs: Any) -> None:
        # The scheduler's broadcast reads a closed comm (an OSError), and b
        # leaves while the barrier waits to retry.
        comm.abort()
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, lambda: closing.append(asyncio.ensure_future(b.close())))

    b.handlers["shuffle_inputs_done"] = reset_then_leave
    with dask.config.set({"gpushuffle.recovery": recovery}):
        started = time.monotonic()
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        # The barrier runs on a, which stays.
        s.set_restrictions({barrier_key(shuffle_id): {a.address}})
        assert_correct(await c.gather(futures), expected)
        took = time.monotonic() - started
    assert closing and b.status == Status.closed
    assert len(run_ids(s, shuffle_id)) >= 2
    assert took < 30, f"the shuffle took {took:.1f} s: the barrier waited for b's address"
    del futures
    await finish(c, s)


@cluster_test(n_workers=1, timeout=90)
async def test_crashed_worker_after_shuffle_persisted(c, s, a):
    """Outputs lost with their worker are recomputed: the shuffle runs again."""
    expected = truth(NIN, ROWS, NOUT)
    async with Nanny(s.address, nthreads=1) as n:
        out = c.persist(gpushuffled(NIN, ROWS, NOUT))
        await wait(out)
        await assert_workers_clean(c)
        lost = count_tasks(s, UNPACK, "memory", n.worker_address)
        assert lost > 0
        await n.process.process.kill()
        await wait_for(lambda: count_tasks(s, UNPACK, "memory") == NOUT - lost, what="outputs lost")
        assert_correct(await parts_of(c, out), expected)
        del out
        await assert_workers_clean(c)
    await finish(c, s)


@cluster_test(n_workers=1, config={"distributed.scheduler.allowed-failures": 0}, timeout=90)
async def test_crashed_worker_with_no_allowed_failures_raises_killed_worker(c, s, a):
    async with Nanny(s.address, nthreads=1) as n:
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        await wait_for_shuffle(s)
        await wait_for_tasks(s, UNPACK, "processing", 1, n.worker_address)
        await n.process.process.kill()
        with pytest.raises(KilledWorker):
            await c.gather(futures)
        del futures
        await assert_workers_clean(c)
    await finish(c, s)


@pytest.mark.parametrize("recovery", ["partial", "restart"])
@cluster_test(n_workers=2)
async def test_an_output_task_tried_again_after_its_read_is_built_from_another_run(
    c, s, a, b, recovery
):
    """An output's first try fails after taking its rows out of the store
    (``retries=1`` tries it again): the second try does not build it from
    what is left (nothing) but has the scheduler run the shuffle again."""
    expected = truth(NIN, ROWS, NOUT)
    failed: list[int] = []
    assemble = PandasBackend.assemble

    def assemble_failing_once(self: PandasBackend, tables: Any, *args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(len(list(tables)))  # every piece read
            raise MemoryError("the first try failed after its read")
        return assemble(self, tables, *args, **kwargs)

    settings = {"gpushuffle.recovery": recovery}
    with (
        dask.config.set(settings),
        mock.patch.object(PandasBackend, "assemble", assemble_failing_once),
    ):
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed(), retries=1)
        shuffle_id = await wait_for_shuffle(s)
        assert_correct(await c.gather(futures), expected)
    assert failed and failed[0] > 0
    assert len(run_ids(s, shuffle_id)) >= 2
    del futures
    await finish(c, s)
