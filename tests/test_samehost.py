"""Workers on one machine lend each other shards (gpushuffle.samehost).

The reads are real ``process_vm_readv`` calls: between the worker processes
of a real cluster, and from this process's own memory in the unit tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

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
    gpushuffled_gated,
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
        ({"pid_namespace": "pid:[1]"}, "another PID namespace"),
        ({"pid_namespace": None}, "another PID namespace"),
        ({"token": "00" * samehost.TOKEN_BYTES}, "identity token does not match"),
        ({"token": "00"}, "malformed"),
        ({"pid": 2**31 - 1}, "No such process"),  # ESRCH
        ({"token_address": 4096}, "Bad address"),  # unmapped: EFAULT
        # The token read, then an unmapped frame: a short read.
        ({"frames": [[0, 4096, 100_000, 0]]}, "read 32 of 100032 bytes"),
    ],
)
def test_what_cannot_be_read_is_refused(change, message):
    lender, carried, _ = _lent([np.arange(100_000, dtype=np.int64)])
    with pytest.raises(samehost.LendRefused, match=message):
        samehost.read({**lender, **change}, carried)


def test_the_token_is_read_in_every_call_of_a_message_with_many_frames():
    """More frames than one process_vm_readv call takes: each call proves the
    sender again, and a wrong token fails the message whatever call reads it."""
    frames = [np.full(samehost.LEND_MIN_BYTES // 8, i, dtype=np.int64) for i in range(1500)]
    lender, carried, _ = _lent(frames)
    got = samehost.read(lender, carried)
    assert all(
        np.array_equal(np.frombuffer(g, np.int64), f) for g, f in zip(got, frames, strict=True)
    )
    with pytest.raises(samehost.LendRefused, match="token"):
        samehost.read({**lender, "token": "11" * samehost.TOKEN_BYTES}, carried)


def test_a_withdrawn_lease_voids_what_was_read():
    """A sender withdraws its lease before it lets go of what it lent: a
    read that finds the lease withdrawn (or its cell taken by another lease)
    is refused, in every call of a message with many frames."""
    frames = [np.full(samehost.LEND_MIN_BYTES // 8, i, dtype=np.int64) for i in range(1100)]
    lease = samehost.new_lease()
    lender, carried, _ = _lent(frames)
    lender["lease"] = lease.as_message()
    got = samehost.read(lender, carried)
    assert np.array_equal(np.frombuffer(got[-1], np.int64), frames[-1])
    lease.withdraw()
    with pytest.raises(samehost.LendWithdrawn, match="let go of the frames"):
        samehost.read(lender, carried)
    other = samehost.new_lease()  # most likely the same cell, another value
    try:
        with pytest.raises(samehost.LendWithdrawn):
            samehost.read(lender, carried)
        assert samehost.read({**lender, "lease": other.as_message()}, carried)
    finally:
        other.withdraw()


def test_a_forked_child_has_a_token_of_its_own():
    """And no lease of its parent's: one inherited and withdrawn there does
    not give its cell out twice."""
    parent = dict(samehost.identity())
    inherited = samehost.new_lease()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        child = samehost.identity()
        same = child["token"] == parent["token"] or child["pid"] == parent["pid"]
        inherited.withdraw()
        cells = [samehost.new_lease() for _ in range(samehost._LEASE_CELLS)]
        same = same or len({lease.address for lease in cells}) < len(cells)
        os.write(write, b"same" if same else b"new")
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"new"
    os.waitpid(pid, 0)
    os.close(read)
    assert samehost.identity()["token"] == parent["token"]
    inherited.withdraw()


# A process that lends one frame of FILL and waits until its stdin closes;
# with a third argument "0" it is not dumpable (prctl PR_SET_DUMPABLE): only
# a reader with CAP_SYS_PTRACE may read it.
_LENDER = """
import ctypes, json, sys
import numpy as np
from gpushuffle import samehost
if sys.argv[2:] == ["0"]:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
frame = np.full(200_000, int(sys.argv[1]), dtype=np.int64)
lent, carried, kept = samehost.lend([frame])
print(json.dumps({**samehost.identity(), "frames": lent}), flush=True)
sys.stdin.read()
"""


_NO_PTRACE = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"]
needs_setpriv = pytest.mark.skipif(
    shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"
)


@contextlib.contextmanager
def _lender(fill: int, dumpable: bool = True):
    """A process lending a frame of ``fill``.  It runs without
    CAP_SYS_PTRACE, as the reader of the test below: the kernel lets a
    reader read only processes whose capabilities it has too."""
    command = [*_NO_PTRACE, sys.executable, "-c", _LENDER, str(fill), str(int(dumpable))]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as p:
        try:
            yield json.loads(p.stdout.readline()), p.pid
        finally:
            p.stdin.close()
            p.wait(timeout=30)


@needs_setpriv
def test_a_process_id_that_names_another_process_is_refused():
    """Two processes of the same program: the message of one, read under the
    other's process id (a recycled pid, or containers where every worker is
    process 1), is refused.  The message is the worst case: the token's and
    the frame's addresses are those of the other process, so every read
    succeeds (as when two processes are laid out alike, with address-space
    randomization off) and only the token's value tells them apart."""
    with _lender(1) as (sender, _), _lender(2) as (other, other_pid):
        (frame,) = samehost.read(sender, [])
        assert (np.frombuffer(frame, np.int64) == 1).all()
        (theirs,) = samehost.read(other, [])
        assert (np.frombuffer(theirs, np.int64) == 2).all()
        impostor = {**other, "token": sender["token"]}  # all the rest is the other's
        with pytest.raises(samehost.LendRefused, match=f"process {other_pid} is not the sender"):
            samehost.read(impostor, [])


# Reads a lender's message (stdin) and says what came of it.
_READER = """
import json, sys
from gpushuffle import samehost
try:
    samehost.read(json.loads(sys.stdin.read()), [])
    print("read")
except samehost.LendRefused as e:
    print("refused:", e)
"""


@needs_setpriv
@pytest.mark.parametrize("dumpable", [True, False], ids=["allowed", "refused"])
def test_a_reader_the_kernel_refuses_gets_a_refusal_not_an_error(dumpable):
    """A reader without CAP_SYS_PTRACE may read a process of its own user only
    while that process is dumpable; otherwise the kernel says EPERM (as under
    another user, or a seccomp profile such as Docker's default)."""
    with _lender(7, dumpable=dumpable) as (lender, pid):
        done = subprocess.run(
            [*_NO_PTRACE, sys.executable, "-c", _READER],
            input=json.dumps(lender),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    expected = (
        "read"
        if dumpable
        else (f"refused: process_vm_readv from process {pid}: Operation not permitted")
    )
    assert done.stdout.strip() == expected, done


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


# -- a lend read after its sender's run closed --------------------------------------


def _lent_shard(sender: str, partition: int, input_partition: int, lease) -> object:
    """A shard of 20,000 rows lent by this process under ``lease``, as its
    receiver gets it (deserialized, its large frames not read yet)."""
    from gpushuffle import transport

    n = 20_000
    frame = pd.DataFrame({"p": np.zeros(n, dtype=np.int64), "x": np.arange(n, dtype=np.float64)})
    backend = PandasBackend()
    table, offsets = backend.split(frame, "p", np.zeros(1, np.int16), 1, False)
    shard = transport.Shard(
        backend=backend.name,
        input_partition=input_partition,
        partitions=np.array([partition]),
        offsets=np.asarray(offsets, dtype=np.int64),
        table=table,
        nbytes=backend.nbytes(table),
        sender=sender,
        lend=True,
        lease=lease,
    )
    message, frames = transport._serialize(shard)
    assert message["lender"]["lease"] == lease.as_message()
    received = transport._deserialize(message, frames)
    assert isinstance(received.table, transport.LentTable)
    return received


@cluster_test(n_workers=2, timeout=120)
async def test_a_lend_read_after_its_senders_run_closed_is_not_stored(c, s, a, b, tmp_path):
    """A sender's run that closes (the shuffle failed) withdraws its lease
    before it lets go of what it lent; a receiver not yet told of the
    failure that reads such a message afterwards may have read rows the
    sender wrote since: it must not store them (partial recovery would
    adopt them).  A message under a lease still held is stored."""
    from gpushuffle import transport

    gate = str(tmp_path / "gate")
    out = c.persist(gpushuffled_gated(NIN, ROWS, NOUT, gate, a.address))
    shuffle_id = await wait_for_shuffle(s)
    runs = [w.plugins["shuffle"].shuffle_runs._active_runs for w in (a, b)]
    await wait_for(lambda: all(shuffle_id in r for r in runs), what="a run on both workers")
    run_a, run_b = (r[shuffle_id] for r in runs)
    mine = next(p for p, w in sorted(run_b.worker_for.items()) if w == b.address)
    withdrawn_before = transport.statistics.reads_withdrawn

    held = samehost.new_lease()
    response = await run_b.receive([_lent_shard(a.address, mine, NIN + 1, held)])
    assert response["status"] == "OK", response
    assert (NIN + 1, 0, 0) in run_b.store.receipt_keys()

    withdrawn = samehost.new_lease()
    shard = _lent_shard(a.address, mine, NIN + 2, withdrawn)
    withdrawn.withdraw()
    response = await run_b.receive([shard])
    assert response["status"] == "error", response
    assert (NIN + 2, 0, 0) not in run_b.store.receipt_keys()
    assert (NIN + 2, 0, 0) not in run_b.received
    assert transport.statistics.reads_withdrawn == withdrawn_before + 1
    held.withdraw()

    # The shuffle (with a shard it never sent) is given up: both runs close,
    # their leases withdrawn, nothing left behind.
    assert not run_a._lease.withdrawn
    del out
    open(gate, "w").close()
    await wait_for(lambda: run_a.closed and run_b.closed, what="both runs to close")
    assert run_a._lease.withdrawn and run_b._lease.withdrawn
    await assert_workers_clean(c)
