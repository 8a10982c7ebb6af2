"""Workers on one machine lend each other shards (gpushuffle.samehost).

The reads are real ``process_vm_readv`` calls: between the worker processes
of a real cluster, and from this process's own memory in the unit tests.
"""

from __future__ import annotations

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Nanny
from faults import (
    UNPACK,
    assert_correct,
    assert_scheduler_clean,
    assert_workers_clean,
    cluster_test,
    count_tasks,
    gpushuffled,
    run_ids,
    truth,
    wait_for,
    wait_for_shuffle,
)
from pandas_versions import arrow_str
from test_faults import wait_for_restart
from test_memory import cluster_with
from test_shuffle import check, make_frame
from test_transport import _copied, _wire, assert_every_shard_serialized, wire_delta

from gpushuffle import samehost
from gpushuffle.backends import arrow
from gpushuffle.backends.base import OWN_FRAMES
from gpushuffle.backends.pandas import PandasBackend

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(samehost.identity() is None, reason="no process_vm_readv here"),
]


def _lent(frames):
    lent, carried, kept = samehost.lend(frames)
    return {**samehost.identity(), "frames": lent}, carried, kept


def test_large_frames_are_read_back_small_ones_travel():
    frames = [
        b"header",
        np.arange(100_000, dtype=np.int64),
        bytearray(b"x" * 70_000),
        np.arange(10, dtype=np.float64),
        memoryview(np.arange(50_000, dtype=np.int32)),
    ]
    lender, carried, kept = _lent(frames)
    assert [position for position, *_ in lender["frames"]] == [1, 2, 4]
    assert [bytes(f) for f in carried] == [bytes(frames[0]), bytes(frames[3])]
    assert len(kept) == 3
    got = samehost.read(lender, carried)
    assert [bytes(memoryview(f)) for f in got] == [bytes(memoryview(f)) for f in frames]
    # The lent frames share one buffer, each on a cache line of its own.
    lent = [np.frombuffer(got[p], np.uint8) for p in (1, 2, 4)]
    assert all(a.ctypes.data % 64 == 0 for a in lent)
    assert all(np.shares_memory(lent[0].base, a) for a in lent[1:])


def test_reads_go_to_the_buffer_the_receiver_gives():
    given = []

    def allocate(nbytes):
        given.append(np.zeros(nbytes, np.uint8))
        return given[-1]

    frames = [np.arange(30_000, dtype=np.int64), np.arange(20_000, dtype=np.int64)]
    lender, carried, _ = _lent(frames)
    got = samehost.read(lender, carried, allocate)
    assert len(given) == 1 and given[0].nbytes >= sum(f.nbytes for f in frames)
    assert np.array_equal(np.frombuffer(got[1], np.int64), frames[1])
    assert np.shares_memory(np.frombuffer(got[0], np.uint8), given[0])


@arrow_str
def test_string_chunks_read_from_a_peer_are_kept_as_they_arrived():
    """The pandas backend marks the buffers of Arrow chunks: the receiver
    reads them into memory of their own, so the unpack keeps such a chunk
    instead of copying it (arrow.made_of), while numpy columns share one
    pooled buffer."""
    n = 20_000
    frame = pd.DataFrame(
        {
            "p": np.zeros(n, dtype=np.int64),
            "x": np.arange(n, dtype=np.float64),
            "s": pd.array([f"value {i:08d}" for i in range(n)], dtype="str"),
        }
    )
    backend = PandasBackend()
    table, _ = backend.split(frame, "p", np.zeros(1, np.int16), 1, False)
    header, frames = backend.serialize(table)
    assert header[OWN_FRAMES], header
    lent, carried, _ = samehost.lend(frames, own=header[OWN_FRAMES])
    assert {position for position, *_, own in lent if own} == set(header[OWN_FRAMES])
    got = samehost.read({**samehost.identity(), "frames": lent}, carried)
    received = backend.deserialize(header, got)
    strings = received.columns[1]
    pd.testing.assert_extension_array_equal(strings, frame["s"].array)
    (chunk,) = strings._pa_array.chunks
    assert arrow.made_of(chunk, received.standalone)
    for position, *_, own in lent:
        # Own frames are allocations of their own; the others views of one.
        assert (got[position].base is None) == bool(own), (position, own)
    np.testing.assert_array_equal(received.columns[0], frame["x"].to_numpy())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"boot": "another-kernel"}, "another kernel"),
        ({"start": -1}, "not the sender"),
        ({"pid": 2**31 - 1}, "no process"),
        ({"frames": [[0, 4096, 100_000, 0]]}, "process_vm_readv"),  # unmapped: EFAULT
    ],
)
def test_what_cannot_be_read_is_refused(change, message):
    lender, carried, _ = _lent([np.arange(100_000, dtype=np.int64)])
    with pytest.raises(samehost.LendRefused, match=message):
        samehost.read({**lender, **change}, carried)


def test_nothing_is_lent_where_yama_restricts_ptrace(tmp_path):
    scope = tmp_path / "ptrace_scope"
    for value, restricted in (("0\n", False), ("1\n", True), ("3\n", True)):
        scope.write_text(value)
        assert samehost._ptrace_restricted(str(scope)) is restricted
    assert samehost._ptrace_restricted(str(tmp_path / "absent")) is False


def _frame(n: int = 240_000) -> pd.DataFrame:
    # Columns of an input's remote rows well over samehost.LEND_MIN_BYTES.
    return make_frame(n, seed=21)


def _shuffle_and_check(client, npartitions: int = 4, refusals: bool = False) -> dict:
    before = client.run(_wire)
    copied_before = client.run(_copied)
    pdf = _frame()
    df = dd.from_pandas(pdf, npartitions=npartitions, sort=False).persist()
    check(
        df.shuffle("key", npartitions=6, shuffle_method="gpushuffle"),
        df.shuffle("key", npartitions=6, shuffle_method="tasks"),
        pdf,
    )
    delta = wire_delta(client, before)
    if not refusals:
        # A refused message's shards are serialized twice, deserialized once.
        assert_every_shard_serialized(delta)
    after = client.run(_copied)
    copied = {
        stage: sum(
            after[w][f"copied_{stage}_bytes"] - copied_before[w][f"copied_{stage}_bytes"]
            for w in after
        )
        for stage in ("send", "receive")
    }
    # Bytes read from a peer are copied once, by the receiver; the rest by
    # both comms.
    read = sum(d["wire_bytes_read_from_peers"] for d in delta.values())
    assert copied["send"] + read == copied["receive"] > 0, (copied, read)
    return delta


def test_workers_on_one_machine_read_each_others_shards():
    with cluster_with({}) as client:
        delta = _shuffle_and_check(client)
        for worker, d in delta.items():
            assert d["wire_bytes_lent"] > 0, (worker, d)
            assert d["wire_lends_refused"] == 0, (worker, d)
        lent = sum(d["wire_bytes_lent"] for d in delta.values())
        assert lent == sum(d["wire_bytes_read_from_peers"] for d in delta.values())


def _pretend_another_kernel(dask_worker=None) -> None:
    # A kernel of its own for each worker, as on two machines.
    samehost._identity = {**samehost.identity(), "boot": f"kernel of {dask_worker.address}"}


def test_a_receiver_that_cannot_read_is_sent_the_bytes():
    """Each worker claims another kernel: every lent message is refused by its
    receiver, then sent as bytes, and later ones are not lent at all."""
    with cluster_with({}) as client:
        client.run(_pretend_another_kernel)
        delta = _shuffle_and_check(client, refusals=True)
        for worker, d in delta.items():
            assert d["wire_lends_refused"] >= 1, (worker, d)
            assert d["wire_bytes_read_from_peers"] == 0, (worker, d)
        # The refusal is remembered: the next shuffle lends nothing.
        delta = _shuffle_and_check(client)
        for worker, d in delta.items():
            assert d["wire_lends_refused"] == d["wire_bytes_lent"] == 0, (worker, d)


def test_same_host_reads_can_be_turned_off():
    with cluster_with({"gpushuffle.comm.same-host-reads": False}) as client:
        delta = _shuffle_and_check(client)
        assert all(d["wire_bytes_lent"] == 0 for d in delta.values()), delta
        assert all(d["wire_bytes_read_from_peers"] == 0 for d in delta.values()), delta


# -- a sender lost while it lends ----------------------------------------------

NIN, ROWS, NOUT = 16, 40_000, 6  # an input's remote rows: columns of ~160 KB, lent


@cluster_test(n_workers=1, timeout=120)
async def test_a_sender_killed_while_it_lends(c, s, a):
    """The Nanny's worker lends its shards to ``a`` (in this process) and is
    killed as soon as ``a`` has read some: the shuffle restarts and every
    row arrives once."""
    from gpushuffle import transport

    expected = truth(NIN, ROWS, NOUT)
    read_before = transport.statistics.bytes_read_from_peers
    async with Nanny(s.address, nthreads=1) as n:
        crashed = n.worker_address
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        await wait_for(
            lambda: transport.statistics.bytes_read_from_peers > read_before,
            what="a to read rows the Nanny's worker lent",
        )
        # Before the shuffle is done (reads come with the transfers, or
        # when the inputs are done and held-back shards go).
        assert count_tasks(s, UNPACK, "memory") < NOUT
        await n.process.process.kill()

        assert_correct(await c.gather(futures), expected)
        assert len(run_ids(s, shuffle_id)) >= 2
        del futures
        await wait_for_restart(s, n, crashed)
        await assert_workers_clean(c)
    await assert_workers_clean(c)
    await c.close()
    await assert_scheduler_clean(s)
