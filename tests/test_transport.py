"""What crosses the wire: every remote shard through its backend's serializers.

distributed chooses a serializer by the type at the top of a message; shards
must reach the ones gpushuffle registers for them (for cuDF, anything else
would pickle device addresses).  These run on real clusters over TCP; the
same checks over UCX are in test_ucx.py.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from device_stand_in import StandInTable, counts, stand_in_device
from distributed import Client
from test_memory import cluster_with
from test_shuffle import check, make_frame

import gpushuffle
from gpushuffle.backends.pandas import PandasBackend

pytestmark = pytest.mark.timeout(180)


def _wire(dask_worker=None) -> dict[str, int]:
    from gpushuffle import transport

    return transport.statistics.as_dict()


def wire_delta(client: Client, before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per worker: what its wire counters gained since ``before``."""
    after = client.run(_wire)
    return {w: {k: v - before[w][k] for k, v in after[w].items()} for w in after}


def assert_every_shard_serialized(delta: dict[str, dict[str, int]]) -> None:
    """Each shard sent was serialized by its backend and deserialized by a peer's."""
    total = {k: sum(d[k] for d in delta.values()) for k in next(iter(delta.values()))}
    assert total["wire_shards_sent"] > 0, delta
    assert total["wire_shards_serialized"] == total["wire_shards_sent"], delta
    assert total["wire_shards_deserialized"] == total["wire_shards_sent"], delta
    assert total["wire_bytes_serialized"] == total["wire_bytes_deserialized"], delta
    assert total["wire_bytes_deserialized"] == total["wire_bytes_sent"], delta
    for worker, d in delta.items():
        # Both workers hold inputs and outputs: each sent and received.
        assert d["wire_shards_serialized"] > 0 and d["wire_shards_deserialized"] > 0, worker


def _copied(dask_worker=None) -> dict[str, int]:
    from gpushuffle.engine import copies

    return copies.statistics.as_dict()


def shuffle_checking_the_wire(
    client: Client, seed: int, rows: int = 3000, inputs: int = 6, outputs: int = 4
) -> dict[str, dict[str, int]]:
    """A shuffle checked against tasks; every remote shard went through its
    backend.  Returns what each worker's wire counters gained."""
    before = client.run(_wire)
    copied_before = client.run(_copied)
    pdf = make_frame(rows, seed=seed)
    df = dd.from_pandas(pdf, npartitions=inputs, sort=False)
    check(
        df.shuffle("key", npartitions=outputs, shuffle_method="gpushuffle"),
        df.shuffle("key", npartitions=outputs, shuffle_method="tasks"),
        pdf,
    )
    delta = wire_delta(client, before)
    assert_every_shard_serialized(delta)
    # What one worker's serializer sent, a peer's deserializer received.
    after = client.run(_copied)
    sent, received = (
        sum(after[w][f"copied_{stage}_bytes"] - copied_before[w][f"copied_{stage}_bytes"]
            for w in after)
        for stage in ("send", "receive")
    )  # fmt: skip
    # Rows lent by a worker on this machine are copied once, by the receiver
    # (test_samehost.py); the rest by both ends.
    read = sum(d["wire_bytes_read_from_peers"] for d in delta.values())
    assert sent + read == received > 0
    return delta


def test_every_remote_shard_goes_through_its_backend(client):
    shuffle_checking_the_wire(client, seed=5)


def test_small_shards_to_one_worker_travel_together(client):
    """Many small input partitions: their remote shards wait for each other
    and cross the wire in a few messages, not one per transfer task."""
    delta = shuffle_checking_the_wire(client, seed=11, rows=4000, inputs=100, outputs=50)
    for worker, d in delta.items():
        # Each worker transferred about 50 inputs, each with rows for the
        # other worker; under 1 MiB in all, so they go when the inputs are
        # done, in one message (a few if distributed's buffer splits them).
        assert d["wire_shards_sent"] >= 20, (worker, d)
        assert 1 <= d["wire_messages_sent"] <= 4, (worker, d)


def test_statistics_report_the_wire(client):
    stats = gpushuffle.statistics(client)
    for column in ("wire_shards_sent", "wire_shards_serialized", "wire_shards_deserialized"):
        assert column in stats.columns


def test_backend_tables_refuse_plain_pickle():
    frame = pd.DataFrame({"k": np.arange(10), "_partitions": np.zeros(10, dtype=np.int16)})
    table, _ = PandasBackend().split(frame, "_partitions", np.zeros(1, np.int16), 1, True)
    with pytest.raises(TypeError, match=r"reached plain pickle.*serialize"):
        pickle.dumps(table)
    with pytest.raises(TypeError, match="reached plain pickle"):
        pickle.dumps(StandInTable(nrows=0, nbytes=0))


def stand_in_shuffle(client: Client, npartitions_in: int = 6, n: int = 4000) -> None:
    """A shuffle through the device stand-in, checked against tasks and pandas."""
    pdf = make_frame(n, seed=9)
    df = dd.from_pandas(pdf, npartitions=npartitions_in, sort=False)
    with stand_in_device(client):
        ours = df.shuffle(["key", "str"], npartitions=5, shuffle_method="gpushuffle")
        parts = check(ours, df.shuffle(["key", "str"], npartitions=5, shuffle_method="tasks"), pdf)
    for part in parts:
        assert part["row"].is_monotonic_increasing


def test_device_tier_down_to_disk_and_back_on_a_cluster():
    """Tiny device and host budgets: device -> host -> disk -> device, as on a GPU."""
    settings = {
        "gpushuffle.memory.device-limit": "32 KiB",
        "gpushuffle.memory.host-limit": "32 KiB",
    }
    with cluster_with(settings) as client:
        before = client.run(_wire)
        stand_in_shuffle(client)
        assert_every_shard_serialized(wire_delta(client, before))
        stats = gpushuffle.statistics(client)
        calls = client.run(counts)
        for worker, row in stats.iterrows():
            assert row["device_to_host_bytes"] > 0, row
            assert row["host_to_disk_bytes"] > 0, row
            # Spill files are read back straight onto the "device".
            assert row["disk_to_host_bytes"] == row["host_to_disk_bytes"], row
            assert row["host_to_device_bytes"] > 0, row
            assert row["device_bytes"] == row["host_bytes"] == row["disk_bytes"] == 0
            assert calls[worker]["to_host"] > 0 and calls[worker]["deserialize"] > 0


@pytest.mark.parametrize("device", [False, True], ids=["pandas", "device-stand-in"])
def test_only_the_key_without_the_index(client, device):
    """Tables without columns: only row counts travel."""
    pdf = make_frame(2000, seed=13)[["key"]]
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    with stand_in_device(client) if device else contextlib.nullcontext():
        ours = df.shuffle("key", npartitions=3, ignore_index=True, shuffle_method="gpushuffle")
        parts = dask.compute(*ours.to_delayed())
    truth = dask.compute(
        *df.shuffle("key", npartitions=3, ignore_index=True, shuffle_method="tasks").to_delayed()
    )
    assert [len(p) for p in parts] == [len(t) for t in truth]
    assert sum(len(p) for p in parts) == len(pdf)


def test_cpu_runs_never_ask_for_the_device(monkeypatch):
    """A pandas shuffle reads no device budget (which would open a CUDA context).

    The device stand-in's runs do ask, once per worker.
    """
    from faults import cluster_test

    from gpushuffle import config
    from gpushuffle.engine import memory

    asked: list[int] = []

    def device_memory_total() -> int:
        asked.append(1)
        return 1 << 30

    monkeypatch.setattr(config, "device_memory_total", device_memory_total)
    memory.reset_worker_memory()

    @cluster_test()
    async def run(c, s, a, b):
        pdf = make_frame(1000, seed=3)
        df = dd.from_pandas(pdf, npartitions=4, sort=False)
        out = df.shuffle("key", npartitions=3, shuffle_method="gpushuffle")
        assert len(await c.compute(out)) == len(pdf)
        assert not asked
        with stand_in_device():
            # Other output keys than above, or the scheduler may hand back those.
            out = df.shuffle("key", npartitions=5, shuffle_method="gpushuffle")
            assert len(await c.compute(out)) == len(pdf)
        assert len(asked) == 1  # workers share this process: one WorkerMemory
        limit = memory.worker_memory().device.limit
        # 0.25 of the device, shared by the two workers on this host's "GPU".
        assert limit == (1 << 30) // 2 // 4, limit

    try:
        run()
    finally:
        memory.reset_worker_memory()


# -- small shards held back: bounded whatever the number of peers -------------


@pytest.fixture
def runs_made(monkeypatch):
    from gpushuffle.engine import run as run_module

    made: list[Any] = []
    init = run_module.GPUShuffleRun.__init__

    def recording_init(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(run_module.GPUShuffleRun, "__init__", recording_init)
    # A quarter of a message in all (256 KiB with 1 MiB messages, whose
    # shards under 64 KiB wait): 8 peers could hold 512 KiB without the cap.
    from gpushuffle.engine import linger

    monkeypatch.setattr(linger, "LINGER_MESSAGES", 0.25)
    return made


@pytest.mark.usefixtures("runs_made")
@pytest.mark.parametrize("reorder", ["auto", "scatter"])
def test_small_shards_held_back_stay_under_the_cap_with_many_peers(runs_made, reorder):
    """With ``scatter`` every destination's rows share one block per input:
    a shard held back is copied out of it first, so that it keeps only its
    own rows alive (``auto`` gathers partitions this small)."""
    from faults import assert_correct, cluster_test, gpushuffled, truth

    nin, rows, nout = 36, 5_000, 18
    config = {"gpushuffle.comm.message-bytes-limit": "1 MiB", "gpushuffle.split.reorder": reorder}

    @cluster_test(n_workers=9, config=config)
    async def run(c, s, *workers):
        parts = await c.gather(c.compute(gpushuffled(nin, rows, nout).to_delayed()))
        assert_correct(parts, truth(nin, rows, nout))

    run()
    assert runs_made
    for made in runs_made:
        held = made.held_back
        assert held.limit == (1 << 20) // 4
        # At most the cap and the one shard that passed it.
        assert held.peak <= held.limit + held.per_peer, held.peak
    # The cap was reached (shards of ~25 KiB for 8 peers, 64 KiB each before
    # they go): without it, the peaks would pass it.
    assert max(m.held_back.peak for m in runs_made) > held.limit // 2
    assert sum(m.held_back.sheds for m in runs_made) > 0
    detached = sum(m.held_back.detached for m in runs_made)
    assert detached > 0 if reorder == "scatter" else detached == 0


def test_a_stage_under_way_in_overlapping_blocks_counts_its_time_once():
    """``copies.timed`` measures how long a stage was under way and the time
    spent in it: two blocks at once (two sends, two task threads) count
    their overlap once as under way, twice as spent."""
    import threading
    import time

    from gpushuffle.engine import copies

    stage = "move"  # no other test moves device tables on this CPU machine
    assert copies._running[stage] == 0
    busy, spent = copies.busy.move, copies.spent.move
    inner_started = threading.Event()
    inner_took: list[int] = []

    def inner() -> None:
        start = time.perf_counter_ns()
        with copies.timed(stage):
            inner_started.set()
            time.sleep(0.05)
        inner_took.append(time.perf_counter_ns() - start)

    start = time.perf_counter_ns()
    with copies.timed(stage):
        thread = threading.Thread(target=inner)
        thread.start()
        inner_started.wait()
        time.sleep(0.1)
        thread.join()
    outer = time.perf_counter_ns() - start
    # Bounds from sleeps (a busy machine only lengthens them) and from the
    # clocks read around each block.  Under way: the outer block, which
    # holds the inner one; spent: both, so at least the inner 50 ms more.
    busy_added, spent_added = copies.busy.move - busy, copies.spent.move - spent
    assert 100_000_000 <= busy_added <= outer
    assert 50_000_000 <= spent_added - busy_added <= inner_took[0]


def test_held_back_shards_go_per_peer_at_a_messages_worth_and_the_most_first_past_the_cap():
    import numpy as np

    from gpushuffle.engine.linger import LINGER_FRACTION, LINGER_MESSAGES, HeldBack
    from gpushuffle.transport import Shard

    def shard(i: int, nbytes: int) -> Shard:
        return Shard("pandas", i, np.array([0]), np.array([0, 1]), None, nbytes)

    held = HeldBack(message_bytes=16 << 10, on_device=False)
    assert (held.per_peer, held.limit) == (
        (16 << 10) // LINGER_FRACTION,
        LINGER_MESSAGES * (16 << 10),
    )
    big = shard(0, held.per_peer)
    assert not held.waits("a", big)  # a message's worth goes at once ...
    small = [shard(i, 300) for i in range(1, 4)]
    held.add("a", small[0])
    assert held.waits("a", big)  # ... unless shards for its peer wait: no overtaking
    assert not held.ready("a")
    held.add("a", small[1])
    held.add("b", small[2])
    assert (held.held("a"), held.held("b"), held.total) == (600, 300, 900)
    assert held.most_first() == ["a", "b"]
    assert held.excess() == 0
    assert held.take("a") == small[:2]  # in the order they came
    assert (held.total, held.peers(), held.take("a")) == (300, ["b"], [])
    while not held.excess():
        held.add("c", shard(9, held.per_peer - 1))
    assert held.total > held.limit
    assert held.excess() == held.total - held.limit // 2
    assert held.peak == held.total
    assert HeldBack(message_bytes=16 << 10, on_device=True).per_peer == 0  # cuDF: none wait
    held.clear()
    assert (held.total, held.peers(), held.sizes()) == (0, [], {})
