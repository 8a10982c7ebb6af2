"""Partial recovery (``gpushuffle.recovery: partial``): a lost worker costs its share.

The pieces first (the scheduler's stable assignment, a receiver's buckets,
a store handed from a failed run to the next), then live clusters in this
process (real TCP between workers) and a ``Nanny`` whose process is killed,
at each phase: every output partition is compared with dask's ``tasks``
shuffle (rows and checksums), the recovery counters say what was kept and
sent again, and nothing is left on the workers afterwards.
"""

from __future__ import annotations

import asyncio
from typing import Any

import dask
import numpy as np
import pandas as pd
import pytest
from distributed import Nanny, Worker, wait
from faults import (
    TRANSFER,
    UNPACK,
    assert_correct,
    assert_workers_clean,
    cluster_test,
    count_tasks,
    frame,
    gpushuffled,
    make_part,
    run_ids,
    truth,
    wait_for,
    wait_for_shuffle,
    wait_for_tasks,
)
from test_faults import finish, wait_for_restart
from test_store import make_memory, store_for

from gpushuffle._distributed import HELD, ShuffleClosedError
from gpushuffle.api import partial_recovery
from gpushuffle.backends.pandas import PandasBackend
from gpushuffle.engine import recovery, worker_ops
from gpushuffle.engine.memory import reset_worker_memory
from gpushuffle.transport import Shard

pytestmark = pytest.mark.timeout(180)

NIN, ROWS, NOUT = 40, 4000, 30
PARTIAL = {"gpushuffle.recovery": "partial"}


@pytest.fixture(autouse=True)
def _process_state():
    reset_worker_memory()
    yield
    reset_worker_memory()


# -- the scheduler's assignment ------------------------------------------------------


def test_survivors_keep_their_partitions_and_share_the_lost_ones_evenly():
    previous = {p: f"w{p % 4}" for p in range(40)}
    worker_for, moved = recovery.stable_assignment(previous, ["w0", "w1", "w3", "new"], range(40))
    assert sorted(moved) == [p for p in range(40) if p % 4 == 2]
    for p, w in previous.items():
        if w != "w2":
            assert worker_for[p] == w  # nothing a survivor holds moves
    load = pd.Series(worker_for).value_counts()
    assert "new" not in load  # a worker that joined takes no partition
    assert load.max() - load.min() <= 1
    # Every caller (both sides of a join) gets the same answer.
    again, _ = recovery.stable_assignment(previous, ["new", "w3", "w1", "w0"], range(40))
    assert again == worker_for
    assert recovery.stable_assignment(previous, ["new"], range(40)) is None


def test_a_sender_splits_an_input_only_for_the_buckets_that_lack_it():
    a = recovery.Buckets(
        partitions={0: np.array([0, 1]), 2: np.array([4])},
        complete={0: frozenset({7}), 2: frozenset()},
    )
    b = recovery.Buckets.from_message(
        recovery.fresh_buckets([2, 3]).as_message()
    )  # through the wire format
    plan = recovery.SendPlan(6, {"b": b, "a": a})
    held = plan.for_input(7)
    assert [(g[0], g[1]) for g in held.groups] == [("a", 2), ("b", 0)]
    assert held.rank.tolist() == [3, 3, 1, 2, 0, 3]  # 3 (nranks): not sent
    fresh = plan.for_input(8)
    assert [(g[0], g[1]) for g in fresh.groups] == [("a", 0), ("a", 2), ("b", 0)]
    assert plan.for_input(9) is fresh  # one layout per set of groups


def test_a_bad_recovery_setting_names_the_fix():
    with (
        dask.config.set({"gpushuffle.recovery": "sometimes"}),
        pytest.raises(ValueError, match=r"'partial' or 'restart'.*dask.config.set"),
    ):
        partial_recovery()
    with dask.config.set(PARTIAL):
        assert partial_recovery()


# -- a store handed from one run to the next ---------------------------------------


def _shard(backend: PandasBackend, input_partition: int, chunk: int = 0, chunks: int = 1) -> Shard:
    """Rows of ``input_partition`` for output partitions 0 and 1 (bucket 0)."""
    frame = pd.DataFrame(
        {"v": np.arange(10, dtype=np.float64) + 100 * input_partition + 1000 * chunk}
    )
    frame["_p"] = np.repeat(np.arange(2, dtype=np.int16), 5)
    table, offsets = backend.split(frame, "_p", np.arange(2, dtype=np.int16), 2, False)
    return Shard(
        "pandas",
        input_partition,
        np.arange(2),
        offsets,
        table,
        backend.nbytes(table),
        chunk=chunk,
        chunks=chunks,
    )


def test_an_adopted_store_keeps_whole_inputs_and_drops_partial_ones(tmp_path):
    backend = PandasBackend()
    store = store_for(backend, make_memory(host=None), tmp_path)
    old, new = object(), object()
    store.hand_over(old)

    async def scenario() -> tuple:
        await store.put(_shard(backend, 1), owner=old)  # whole
        await store.put(_shard(backend, 2, chunk=0, chunks=2), owner=old)  # half of it
        await store.put(_shard(backend, 3), owner=old)
        store.hand_over(None)  # the old run failed: its puts are refused now
        with pytest.raises(ShuffleClosedError, match="handed over"):
            await store.put(_shard(backend, 4), owner=old)
        _, pieces = store.read(1)  # an unpack had started on partition 1
        list(pieces)
        return await store.adopt({0, 1}, {0: 0, 1: 0}, new, store._offload, "next run")

    complete, emptied, kept, dropped = asyncio.run(scenario())
    assert complete == {0: frozenset({1, 3})}
    assert emptied == {1}
    assert dropped > 0 and kept > 0
    assert store.receipt_keys() == {(1, 0, 0), (3, 0, 0)}
    nrows, pieces = store.read(0)
    out = backend.assemble(pieces, nrows, pd.DataFrame({"v": np.array([], "f8")}), False)
    # Inputs 1 and 3 once each, in input order; input 2's half is gone.
    assert out["v"].tolist() == [100.0 + i for i in range(5)] + [300.0 + i for i in range(5)]
    store.close()


def test_an_unpack_of_the_run_before_cannot_take_what_the_next_run_kept(tmp_path):
    """An output task of a failed run that passed its run's own check just
    before the failure reaches the store after the next run adopted it: it
    is refused (the next run counts partition 0's pieces as kept and asks
    nobody to send them again), and the pieces stay for the next run."""
    backend = PandasBackend()
    store = store_for(backend, make_memory(host=None), tmp_path)
    old, new = object(), object()
    store.hand_over(old)

    async def scenario() -> tuple:
        await store.put(_shard(backend, 1), owner=old)
        store.hand_over(None)
        return await store.adopt({0, 1}, {0: 0, 1: 0}, new, store._offload, "next run")

    complete, emptied, _, _ = asyncio.run(scenario())
    assert complete == {0: frozenset({1})} and not emptied
    with pytest.raises(ShuffleClosedError, match="handed over"):
        store.start_unpack(owner=old)
    with pytest.raises(ShuffleClosedError, match="handed over"):
        store.read(0, owner=old)
    assert store.start_unpack(owner=new)
    nrows, pieces = store.read(0, owner=new)
    assert nrows == 5 and len(list(pieces)) == 1
    store.close()


def test_a_run_failed_before_its_adoption_hands_on_the_buckets_of_the_run_before(tmp_path):
    """Run 2 took output partition 2 over from a lost worker, and failed (a
    second loss) while its adoption still waited for the store's lock: the
    store still holds run 1's shards, input 1 whole for partitions 0 and 1.
    What it hands to run 3 must say so; run 2's own buckets (every
    partition in bucket 0 until adopted) would say partition 2 holds input
    1 too, and no sender would send input 1's rows for it again."""
    from types import SimpleNamespace

    backend = PandasBackend()
    store = store_for(backend, make_memory(host=None), tmp_path)
    run1, address = object(), "tcp://survivor:1"
    store.hand_over(run1)

    async def scenario() -> recovery.Buckets:
        await store.put(_shard(backend, 1), owner=run1)
        store.hand_over(None)
        held = recovery.Holding(run_id=1, store=store, bucket_of={0: 0, 1: 0})
        run2 = SimpleNamespace(
            spec=SimpleNamespace(generation=1),
            id="s",
            run_id=2,
            local_address=address,
            received=set(),
            store=store,
            offload=store._offload,
        )
        async with store._evicting:  # a move to disk under way: the adoption waits
            kept = recovery.RunRecovery(run2, [0, 1, 2], held)
            await asyncio.sleep(0.01)
            assert kept.adoption is not None and not kept.adoption.done()
            assert kept.hand_over(store, SimpleNamespace(plugins={}), hold_s=60)
        await asyncio.sleep(0.01)
        assert kept.adoption.cancelled()
        handed = recovery.holdings.take(address, "s")
        assert handed is not None and handed.bucket_of == {0: 0, 1: 0}
        buckets, _ = await recovery.adopt(handed, [0, 1, 2], 2, owner=run2)
        return buckets

    buckets = asyncio.run(scenario())
    # Input 1: whole in partitions 0 and 1; wanted again for partition 2 only.
    assert [buckets.partitions[b].tolist() for b in buckets.wants(1)] == [[2]]
    store.close()


# -- live clusters ----------------------------------------------------------------------


def _recovered() -> dict[str, int]:
    return dict(recovery.statistics.as_dict())


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in recovery.statistics.as_dict().items()}


def _last_spec(s: Any, shuffle_id: str) -> Any:
    runs = s.plugins["shuffle"]._shuffles[shuffle_id]
    return max(runs, key=lambda state: state.run_id).run_spec.spec


@pytest.mark.parametrize("budget", ["memory", "spill"])
@pytest.mark.recovery
@cluster_test(n_workers=3, config=PARTIAL)
async def test_a_worker_closed_mid_transfer_costs_only_its_share(c, s, a, b, w3, budget):
    expected = truth(NIN, ROWS, NOUT)
    before = _recovered()
    # Shards small enough to wait for more to the same worker (under 1/16
    # of a message) would be lost with the run that held them back: these
    # go at once, and arrive before the loss.
    settings = {"gpushuffle.comm.message-bytes-limit": "256 KiB"}
    if budget == "spill":
        settings["gpushuffle.memory.host-limit"] = "1 MiB"
    with dask.config.set(settings):
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        await wait_for_tasks(s, TRANSFER, "memory", NIN // 2)
        assert count_tasks(s, TRANSFER, "memory") < NIN
        await b.close()
        assert_correct(await c.gather(futures), expected)
    spec = _last_spec(s, shuffle_id)
    assert spec.generation >= 1
    got = _delta(before)
    assert got["recovery_runs"] >= 2  # both survivors adopted what they held
    assert got["recovery_partitions_taken"] == NOUT // 3
    assert got["recovery_bytes_kept"] > 0
    # Sent again: the lost worker's share, what was not in yet and what was
    # lent but not yet read when the runs closed (refused: samehost.Lease),
    # not all.  About two thirds here; 0.83 was seen once in a full CI run.
    total = sum(make_part(i, ROWS).memory_usage(deep=True).sum() for i in range(NIN))
    print(got, total)
    assert got["recovery_bytes_resent"] < 0.9 * total
    del futures
    await finish(c, s)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.recovery
@cluster_test(n_workers=2, config=PARTIAL)
async def test_a_worker_crashed_mid_transfer_is_recovered_exactly_once(c, s, a, b, chunked):
    """A real process killed; with small messages many inputs are half sent."""
    expected = truth(NIN, ROWS, NOUT)
    before = _recovered()
    settings = {"gpushuffle.comm.message-bytes-limit": "8 KiB"} if chunked else {}
    with dask.config.set(settings):
        async with Nanny(s.address, nthreads=1) as n:
            crashed = n.worker_address
            futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
            await wait_for_shuffle(s)
            await wait_for_tasks(s, TRANSFER, "memory", 2, crashed)
            await n.process.process.kill()
            assert_correct(await c.gather(futures), expected)
            assert _delta(before)["recovery_runs"] >= 1
            del futures
            await wait_for_restart(s, n, crashed)
            await assert_workers_clean(c)
    await finish(c, s)


@pytest.mark.parametrize("two", [False, True])
@pytest.mark.recovery
@cluster_test(n_workers=4, config=PARTIAL)
async def test_workers_lost_together_or_during_a_recovery(c, s, a, b, w3, w4, two):
    expected = truth(NIN, ROWS, NOUT)
    futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
    shuffle_id = await wait_for_shuffle(s)
    await wait_for_tasks(s, TRANSFER, "memory", NIN // 3)
    if two:
        await asyncio.gather(b.close(), w3.close())
    else:
        await b.close()
        # The next run has started when the second loss comes.
        await wait_for(lambda: len(run_ids(s, shuffle_id)) >= 2, what="the next run")
        await w3.close()
    assert_correct(await c.gather(futures), expected)
    assert _last_spec(s, shuffle_id).generation >= 1
    del futures
    await finish(c, s)


@pytest.mark.parametrize("rows", [ROWS])
@pytest.mark.recovery
@cluster_test(n_workers=3, config=PARTIAL, timeout=90)
async def test_outputs_built_before_a_loss_are_kept(c, s, a, b, w3, rows):
    expected = truth(NIN, rows, NOUT)
    futures = c.compute(gpushuffled(NIN, rows, NOUT).to_delayed())
    shuffle_id = await wait_for_shuffle(s)
    await wait_for_tasks(s, UNPACK, "memory", NOUT // 3)
    survivors = {a.address, w3.address}
    built_on_survivors = {
        ts.key[1]
        for ts in s.tasks.values()
        if ts.state == "memory"
        and ts.key[0].startswith(UNPACK)
        and {ws.address for ws in ts.who_has or ()} & survivors
    }
    await b.close()
    assert_correct(await c.gather(futures), expected)
    spec = _last_spec(s, shuffle_id)
    if spec.generation:  # the loss came before the last output was built
        # Outputs built on a survivor were not built again.
        assert built_on_survivors and spec.done >= built_on_survivors
    del futures
    await finish(c, s)


@pytest.mark.recovery
@cluster_test(n_workers=1, config=PARTIAL, timeout=90)
async def test_a_crash_during_the_unpack_rebuilds_only_the_lost_outputs(c, s, a):
    expected = truth(NIN, ROWS, NOUT)
    async with Nanny(s.address, nthreads=1) as n:
        crashed = n.worker_address
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        await wait_for_tasks(s, UNPACK, "memory", 1, crashed)
        await wait_for(lambda: count_tasks(s, UNPACK, "memory", a.address) >= 1)
        await n.process.process.kill()
        assert_correct(await c.gather(futures), expected)
        assert _last_spec(s, shuffle_id).done  # a's outputs stayed
        del futures
        await wait_for_restart(s, n, crashed)
        await assert_workers_clean(c)
    await finish(c, s)


@pytest.mark.recovery
@cluster_test(n_workers=1, config=PARTIAL)
async def test_other_shuffles_send_no_gpushuffle_op_to_workers(c, s, a):
    """The recovering scheduler plugin sends its stream ops only to the
    workers of gpushuffle's partial shuffles: another worker does not know
    them, and an unknown op breaks its stream with the scheduler."""
    await c.gather(c.compute(gpushuffled(8, 1000, 4).to_delayed()))  # installs the plugin
    async with Worker(s.address, nthreads=1) as w:
        out = frame(8, 1000).shuffle("key", npartitions=4, shuffle_method="p2p")
        parts = await c.gather(c.compute(out.to_delayed()))
        assert sum(len(p) for p in parts) == 8000
        del parts, out
        await asyncio.sleep(1)  # the shuffle is forgotten meanwhile
        assert w.address in s.workers and w.status.name == "running"
        assert w.batched_stream is not None and not w.batched_stream.comm.closed()


@pytest.mark.recovery
@cluster_test(n_workers=1, config=PARTIAL)
async def test_every_worker_knows_gpushuffles_ops_before_its_first_run(c, s, a):
    """The workers there as the first run is created, and those that join
    later, get gpushuffle's handlers from its worker plugin, not as they
    create a run of their own."""
    await c.gather(c.compute(gpushuffled(8, 1000, 4).to_delayed()))
    await wait_for(lambda: worker_ops.WorkerOps.name in a.plugins, what="the plugin on a")
    async with Worker(s.address, nthreads=1) as w:
        assert worker_ops.WorkerOps.name in w.plugins
        assert HELD in w.handlers and not w.plugins["shuffle"].shuffle_runs._runs
        await wait_for(lambda: w.address in s.plugins["gpushuffle-ops-known"].workers)
    await finish(c, s)


@pytest.mark.parametrize("plugin_reached", [True, False])
@pytest.mark.recovery
@cluster_test(n_workers=3, config={**PARTIAL, "distributed.scheduler.work-stealing": False})
async def test_a_survivor_that_has_no_run_yet_is_asked_what_it_holds(
    c, s, a, b, w3, plugin_reached
):
    """w3 computes no input and its first shard is held up, so it has not
    created the run when b leaves: the next run's senders still learn what
    it holds (nothing) and send it its share, and every row arrives once.
    Without gpushuffle's worker plugin on w3 (``plugin_reached=False``: as
    if it had not reached w3 yet) the senders ask again until w3 knows."""
    expected = truth(NIN, ROWS, NOUT)
    inputs = c.persist(frame(NIN, ROWS), workers=[a.address, b.address])
    await wait(inputs)
    released = asyncio.Event()
    receive = w3.handlers["shuffle_receive"]

    async def held_up_receive(**kwargs: Any) -> Any:
        await released.wait()
        return await receive(**kwargs)

    w3.handlers["shuffle_receive"] = held_up_receive
    with dask.config.set({"gpushuffle.comm.message-bytes-limit": "256 KiB"}):
        out = inputs.shuffle("key", npartitions=NOUT, shuffle_method="gpushuffle")
        futures = c.compute(out.to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        await wait_for_tasks(s, TRANSFER, "memory", 4)
        assert not w3.plugins["shuffle"].shuffle_runs._active_runs
        if not plugin_reached:  # once it did (it would give the handler back)
            await wait_for(lambda: worker_ops.WorkerOps.name in w3.plugins)
            assert w3.handlers.pop(HELD)
        await b.close()
        await wait_for(lambda: len(run_ids(s, shuffle_id)) >= 2, what="the next run")
        if plugin_reached:
            # Held up until a sent an input in the next run, i.e. asked w3
            # what it holds: a shard of the run before let in creates w3's run.
            await wait_for(
                lambda: count_tasks(s, TRANSFER, "memory") or count_tasks(s, TRANSFER, "erred"),
                what="an input sent in the next run",
            )
        else:  # a asks meanwhile and is answered None
            await asyncio.sleep(0.5)
            assert not count_tasks(s, TRANSFER, "memory")
        released.set()
        assert_correct(await c.gather(futures), expected)
    assert _last_spec(s, shuffle_id).generation >= 1
    del futures, inputs, out
    await finish(c, s)
