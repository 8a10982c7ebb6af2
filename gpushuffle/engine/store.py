"""Received shards of one run on one worker, within the worker's memory budget.

Tiers: device memory (cuDF shards), host memory (pandas shards, and device
shards moved off the GPU), disk (files under the worker's local directory).

A shard of rows *borrowed* from an input partition the worker holds anyway
(:meth:`~gpushuffle.engine.tables.TableBackend.unshared_bytes`) is charged
only what it alone keeps alive: nothing while the worker holds the input.
Puts charge such groups anew as they make room (every put while there are
few; with many, every so many puts, so that a put's checks stay a constant
number), so an input the worker let go of counts against the budget (and
is spilled like any other group: its rows copied out, then written).

What is stored are *pieces*: the rows of one output partition that came from
one input partition.  A received shard is not copied into pieces; its pieces
are views of its buffers (a shard's columns arrive as one buffer each, and on
TCP all of a message's frames share one receive buffer).  Memory is therefore
accounted, and released, by *group*: the buffers of one received shard, freed
when the last of its pieces is consumed or moved.  When a tier is over its
limit the store moves whole groups down, oldest first, each piece to the
next tier on its own (device -> host copies a piece into its own host
buffers; host -> disk appends it to its output partition's file), skipping
pieces an unpack task is reading.  Reading brings pieces back up one at a
time, in input-partition order, so an unpack holds at most its output plus
one piece.

A shard's rows go to every output partition of the worker, so without more
the store would hold its whole in-memory tier until the last output is
built, beside the outputs built so far (seen: with the shuffled frame
persisted, a worker peaked 0.3 GiB above the outputs themselves).  Once
unpacks have read at least half of a large host group's bytes, and the
outputs still held show that they are being kept, the reading thread
copies what is left of it together into memory of its own
(:meth:`~gpushuffle.engine.tables.TableBackend.compacted`) and lets the
shard go: the store shrinks as outputs are built, for copies of at most
about what it holds (each copy is of at most half a group).

A tier that cannot get under its limit (disk disabled, or every piece being
read) makes the receiver wait for other shuffles on the worker to release
memory, up to ``gpushuffle.memory.wait-timeout``; a run that alone exceeds
the budget fails at once with :class:`~gpushuffle.errors.ShuffleMemoryError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpushuffle._distributed import ShuffleClosedError
from gpushuffle.engine import copies
from gpushuffle.engine.memory import DEVICE, DISK, HOST, WorkerMemory
from gpushuffle.engine.outputs import OutputSize
from gpushuffle.engine.pool import host_pool, trim_allocators
from gpushuffle.engine.tables import TableBackend
from gpushuffle.errors import ShuffleDiskFullError, ShuffleMemoryError
from gpushuffle.samehost import IOV_MAX
from gpushuffle.transport import Shard

logger = logging.getLogger(__name__)

#: Borrowed groups a put checks, on average: with more than this, a put
#: checks them all only every ``len(borrowed) / _RECHARGE_PER_PUT`` puts.
#: Checking every group on every put made a run's checks grow with the
#: square of its inputs: at 1,000 input partitions, a second of the event
#: loop's time per worker and run.
_RECHARGE_PER_PUT = 32

#: Host groups at least this large are compacted once unpacks read
#: :data:`_COMPACT_READ_SHARE` of their bytes (see the module docstring);
#: smaller ones are not worth a copy's fixed costs.
_COMPACT_MIN_BYTES = 4 << 20
_COMPACT_READ_SHARE = 0.5
#: ... and only while outputs held add up to this many of the largest,
#: plus two for each being built (:meth:`ShardStore._compact_due_groups`).
_COMPACT_HELD_OUTPUTS = 4

#: A reader that does not say which run it is (tests, tools): not checked.
_ANY_OWNER = object()


@dataclass(frozen=True)
class _DiskLocation:
    path: str
    offset: int
    lengths: tuple[int, ...]
    header: dict[str, Any]


@dataclass(eq=False)
class _Group:
    """Buffers shared by pieces: one received shard, or one piece moved down."""

    tier: str
    nbytes: int
    pieces: list[_Piece] = field(default_factory=list)
    live: int = 0
    #: Of ``nbytes``: the share of the pieces not yet read or moved.
    live_nbytes: int = 0
    key: int = -1
    #: A table of borrowed rows covering the group (None: the group owns its buffers).
    borrowed: Any = None
    #: For borrowed rows: the bytes a copy of them takes.
    copy_nbytes: int = 0


@dataclass(eq=False, slots=True)
class _Piece:
    """One output partition's rows of a group (a view, or on disk).

    With many output partitions a store holds tens of thousands of pieces:
    slots, so that each is one object for the garbage collector to walk
    rather than two.
    """

    partition: int
    input_partition: int
    chunk: int
    nrows: int
    nbytes: int
    #: Of ``nbytes``: what an assembly concatenates (TableBackend.concat_nbytes).
    concat_nbytes: int = 0
    table: Any = None
    group: _Group | None = None
    disk: _DiskLocation | None = None
    reading: bool = False


@dataclass
class StoreStatistics:
    """What one run's store received and read, and its bytes per tier."""

    bytes_in: int = 0
    shards_in: int = 0
    #: Of ``bytes_in``: rows left in input partitions the worker held (not copied).
    bytes_borrowed: int = 0
    #: Groups moved to disk while distributed had the worker paused (:meth:`ShardStore.shed_host`).
    groups_shed: int = 0
    #: Groups moved to disk before the first output was built, to make room for it.
    groups_shed_for_outputs: int = 0
    partitions_read: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0
    device_peak_bytes: int = 0
    host_peak_bytes: int = 0
    disk_peak_bytes: int = 0
    #: Host groups whose rest was copied together once half read, and the
    #: bytes of the pieces moved (:meth:`ShardStore._compact_due_groups`).
    compactions: int = 0
    bytes_compacted: int = 0
    #: Bytes written to the spill files and read back from them, and the
    #: seconds each write of a group of pieces took (a moving average, as
    #: distributed's buffers keep one for its dashboard).
    bytes_spilled: int = 0
    bytes_read_back: int = 0
    spills: int = 0
    spill_avg_bytes: float = 0.0
    spill_avg_seconds: float = 0.0

    def add(self, tier: str, nbytes: int) -> None:
        now = getattr(self, f"{tier}_bytes") + nbytes
        setattr(self, f"{tier}_bytes", now)
        if now > getattr(self, f"{tier}_peak_bytes"):
            setattr(self, f"{tier}_peak_bytes", now)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class ShardStore:
    """Pieces by output partition, tagged with their input partition.

    Parameters
    ----------
    backend
        Splits, moves and serializes the tables.
    memory
        The worker's budgets, shared with other runs.
    directory
        Where spilled pieces go; created on first use, removed on close.
    offload
        Runs blocking work (file writes) off the event loop.
    wait_timeout
        Seconds a receiver waits for other runs to free memory.
    describe
        Names the run in error messages.
    host_sharers
        The run's workers on this machine, this one included: an ``auto``
        host budget is the machine's divided among them.
    """

    def __init__(
        self,
        backend: TableBackend,
        memory: WorkerMemory,
        directory: str,
        offload: Callable[..., Awaitable[Any]],
        wait_timeout: float,
        describe: str = "gpushuffle",
        host_sharers: int = 1,
    ) -> None:
        self._backend = backend
        # What spilled pieces share (a pandas store's dtypes): pickled once.
        self._spill_memo = backend.new_memo()
        self._memory = memory
        self._directory = directory
        self._directory_made = False  # made on the first spill, under the lock
        self._offload = offload
        self._wait_timeout = wait_timeout
        self._describe = describe
        self._pieces: dict[int, list[_Piece]] = {}
        self._groups: dict[int, _Group] = {}  # insertion order is age
        self._borrowed: dict[int, _Group] = {}  # the groups of borrowed rows
        self._next_group = 0
        self._puts_unchecked = 0  # puts since the borrowed groups were last checked
        self._lock = threading.Lock()  # accounting, shared with unpack threads
        self._evicting = asyncio.Lock()
        self._closed = False
        self._unpacking = False
        #: Which run may put: a run that handed the store over (partial
        #: recovery) must not add rows the adopting run does not know of.
        self._owner: object | None = None
        #: (input partition, bucket) -> [chunks of the shard, chunks held].
        self._receipts: dict[tuple[int, int], tuple[int, set[int]]] = {}
        #: Output partitions an unpack has read (their pieces are gone).
        self._read: set[int] = set()
        #: Host groups half read, for the reading thread to compact.
        self._compact_due: dict[int, _Group] = {}
        #: Bytes of the largest output partition read, and how many are
        #: being read now.
        self._largest_output = 0
        self._reading = 0
        #: A backend that failed to copy once is not asked again: the
        #: failure is a bug to report (logged), and only memory is at stake.
        self._compact_failed = False
        self.statistics = StoreStatistics()
        # Free pool blocks stay while a run is open, for its next split or
        # unpack; the last run closing starts the pool's countdown to release.
        host_pool().hold()
        memory.start_run(host_sharers)

    # -- receiving (event loop) --------------------------------------------

    async def put(self, shard: Shard, owner: object | None = None) -> None:
        """Store a received or local shard, then get back within budget.

        ``owner``: the run putting it; a store handed over to another run
        refuses it (:class:`ShuffleClosedError`).
        """
        total_rows = int(shard.offsets[-1] - shard.offsets[0])
        if not total_rows:
            return
        tier = self._backend.tier
        unshared = self._backend.unshared_bytes(shard.table)
        concat_nbytes = self._backend.concat_nbytes(shard.table)
        keep_rows = self._backend.keep_rows
        kept_nbytes = self._backend.kept_nbytes(shard.table) if keep_rows else 0
        group = _Group(
            tier=tier,
            nbytes=shard.nbytes if unshared is None else unshared,
            borrowed=None if unshared is None else shard.table,
            copy_nbytes=shard.nbytes,
        )
        # Only the partitions with rows: with many output partitions most of
        # a small shard's are empty, and this runs on the event loop.
        offsets = np.asarray(shard.offsets)
        nonempty = np.flatnonzero(offsets[1:] > offsets[:-1])
        for partition, start, stop in zip(
            np.asarray(shard.partitions)[nonempty].tolist(),
            offsets[nonempty].tolist(),
            offsets[nonempty + 1].tolist(),
            strict=True,
        ):
            piece = _Piece(
                partition=partition,
                input_partition=shard.input_partition,
                chunk=shard.chunk,
                nrows=stop - start,
                nbytes=shard.nbytes * (stop - start) // total_rows,
                concat_nbytes=(
                    concat_nbytes - (kept_nbytes if stop - start >= keep_rows > 0 else 0)
                )
                * (stop - start)
                // total_rows,
                table=self._backend.slice(shard.table, start, stop),
                group=group,
            )
            group.pieces.append(piece)
        group.live = len(group.pieces)
        group.live_nbytes = sum(p.nbytes for p in group.pieces)
        # One shard at a time: a receiver waits here while an earlier one
        # makes room, so the store holds at most its budget plus one shard
        # (and senders wait for the reply: back-pressure).
        self._memory.wait(group.nbytes)
        try:
            await self._evicting.acquire()
        finally:
            self._memory.wait(-group.nbytes)
        try:
            with self._lock:
                # A closed store (its run failed or was restarted after a
                # worker left) must not take bytes that nobody will release.
                self._raise_if_closed()
                if owner is not self._owner:
                    raise ShuffleClosedError(f"{self._describe} was handed over to another run")
                self._add_group(group)
                for piece in group.pieces:
                    self._pieces.setdefault(piece.partition, []).append(piece)
                self._receipts.setdefault(
                    (shard.input_partition, shard.bucket), (shard.chunks, set())
                )[1].add(shard.chunk)
                if group.borrowed is not None:
                    self._borrowed[group.key] = group
                    self.statistics.bytes_borrowed += shard.nbytes
                self._charge(tier, group.nbytes)
                self.statistics.bytes_in += shard.nbytes
                self.statistics.shards_in += 1
            await self._make_room()
            # Closed while making room: what was put is gone with the store.
            self._raise_if_closed()
        finally:
            self._evicting.release()

    async def _make_room(self) -> None:
        self._recharge_borrowed(every_time=False)
        await self._move_down_while_over()
        await self._wait_until_within(HOST)

    async def _move_down_while_over(self) -> None:
        for tier in (DEVICE, HOST):
            while self._memory.tier(tier).over > 0:
                group = self._oldest_movable(tier)
                if group is None:
                    break
                await self._move_down(group)

    async def release_let_go_inputs(self) -> None:
        """Charge borrowed rows for the inputs the worker let go of since the
        last put, and move them down if that puts the store over budget.

        Puts do this as they come; the unpack phase has none, and an input
        that distributed spilled to disk meanwhile would stay in memory,
        held by the rows borrowed from it, with nobody counting it.  Unlike
        a put, this does not wait for other shuffles to free memory: it only
        gives memory back.
        """
        if not self._borrowed:
            return
        async with self._evicting:
            if self._closed:
                return
            self._recharge_borrowed()
            await self._move_down_while_over()

    async def shed_host(self, for_outputs: bool = False) -> int:
        """Move to disk every host group whose move frees memory; returns how
        many groups moved.

        For a worker distributed paused for its memory: it runs no task (no
        transfer, no unpack) until its memory drops, and a store within its
        budget would keep what it holds, so the shuffle would never go on
        (seen on 600 MiB workers: paused at 87% with 237 MB of received
        shards in memory, under a 256 MiB budget).  And ``for_outputs``, for
        a worker about to build an output partition that, with what the
        store holds in memory, would leave it too little.  Rows borrowed from
        an input the worker still holds stay: moving them would copy them out
        and free nothing.
        """
        if not self._memory.disk_enabled or not self._groups:
            return 0
        moved = 0
        async with self._evicting:
            if self._closed:
                return 0
            self._recharge_borrowed()
            while (group := self._oldest_movable(HOST, fallback=False)) is not None:
                await self._move_down(group)
                moved += 1
                if for_outputs:
                    self.statistics.groups_shed_for_outputs += 1
                else:
                    self.statistics.groups_shed += 1
                self._memory.shed(for_outputs)
        return moved

    def _recharge_borrowed(self, every_time: bool = True) -> None:
        """Charge groups of borrowed rows for what of their input the worker let go of.

        Without ``every_time`` (a put), only once the puts since the last
        check make up for their number (:data:`_RECHARGE_PER_PUT`).
        """
        with self._lock:
            if not every_time:
                self._puts_unchecked += 1
                if self._puts_unchecked * _RECHARGE_PER_PUT < len(self._borrowed):
                    return
            self._puts_unchecked = 0
            for group in self._borrowed.values():
                unshared = self._backend.unshared_bytes(group.borrowed) or 0
                if unshared > group.nbytes:
                    self._charge(group.tier, unshared - group.nbytes)
                    group.nbytes = unshared

    def _oldest_movable(self, tier: str, fallback: bool = True) -> _Group | None:
        """The oldest group of ``tier`` that can move down; with ``fallback``,
        rows borrowed from an input the worker holds when nothing else can."""
        if tier == HOST and not self._memory.disk_enabled:
            return None
        # Moving borrowed rows copies them out of their input to free what
        # the input holds beyond the worker's own copy: worth it once that is
        # as much as the copy (the worker let go of the input), and otherwise
        # only when nothing else can move (a budget smaller than what borrowed
        # rows are charged for while their input is held: the partition
        # column, a copied index).
        held = None
        # A snapshot: unpack threads add and remove groups meanwhile (list()
        # copies the dict in one step under the GIL).
        for group in list(self._groups.values()):
            if group.tier != tier or not group.nbytes:
                continue
            if not any(p.group is group and not p.reading for p in group.pieces):
                continue
            if group.borrowed is None or group.nbytes >= group.copy_nbytes:
                return group
            if held is None and fallback:
                held = group
        return held

    async def _move_down(self, group: _Group) -> None:
        if group.tier == HOST:
            await self._move_to_disk(group)
            return
        for piece in list(group.pieces):
            if piece.group is not group or piece.reading:
                continue
            start = time.perf_counter()
            # Off the event loop: a device -> host copy takes as long as
            # its bytes need, and receives must go on meanwhile.
            host_table = await self._offload(self._to_host, piece.table)
            copies.count("move", piece.nbytes)
            moved = _Group(
                tier=HOST, nbytes=piece.nbytes, pieces=[piece], live=1, live_nbytes=piece.nbytes
            )
            with self._lock:
                if piece.group is not group or piece.reading:
                    continue  # read or released meanwhile: keep it where it is
                piece.table, piece.group = host_table, moved
                self._add_group(moved)
                self._charge(HOST, piece.nbytes)
                self._memory.moved(DEVICE, HOST, piece.nbytes, time.perf_counter() - start)
            self._unref(group, piece.nbytes)

    async def _move_to_disk(self, group: _Group) -> None:
        """Append each piece of ``group`` to its partition's file, in one trip
        to the offload thread (a group holds a piece for every partition)."""
        start = time.perf_counter()
        pieces = [p for p in group.pieces if p.group is group and not p.reading]
        items = [(p.partition, p.table) for p in pieces]
        locations = await self._offload(self._append_all, items)
        elapsed = time.perf_counter() - start
        seconds = elapsed / max(len(pieces), 1)
        with self._lock:
            written = sum(p.nbytes for p in pieces)
            stats = self.statistics
            stats.bytes_spilled += written
            stats.spills += 1
            stats.spill_avg_bytes = 0.98 * stats.spill_avg_bytes + 0.02 * written
            stats.spill_avg_seconds = 0.98 * stats.spill_avg_seconds + 0.02 * elapsed
            for piece, location in zip(pieces, locations, strict=True):
                if piece.reading or piece.group is not group:
                    continue  # an unpack took it meanwhile: it reads the memory copy
                piece.table, piece.group, piece.disk = None, None, location
                self._charge(DISK, piece.nbytes)
                self._memory.moved(HOST, DISK, piece.nbytes, seconds)
                self._unref_locked(group, piece.nbytes)

    async def _wait_until_within(self, tier: str) -> None:
        usage = self._memory.tier(tier)
        if not usage.over:
            return
        deadline = time.monotonic() + self._wait_timeout
        while usage.over:
            # Closed while waiting: distributed restarts the run, which a
            # ShuffleMemoryError would fail instead.
            self._raise_if_closed()
            mine = getattr(self.statistics, f"{tier}_bytes")
            others = usage.bytes - mine
            if others <= 0 or time.monotonic() > deadline:
                raise ShuffleMemoryError(
                    f"{self._describe}: received shards need more host memory than "
                    f"gpushuffle.memory.host-limit allows ({_gib(usage.limit)} per worker, "
                    f"{_gib(mine)} held by this shuffle, {_gib(max(others, 0))} by others) "
                    f"and gpushuffle.storage.disk is "
                    f"{'true but nothing can move' if self._memory.disk_enabled else 'false'}. "
                    "Raise gpushuffle.memory.host-limit, set gpushuffle.storage.disk: true, "
                    "or add workers."
                )
            # Another shuffle on this worker holds memory it will release when
            # its outputs are read: hold the sender until then.
            await asyncio.sleep(0.05)

    def _append_all(self, items: list[tuple[int, Any]]) -> list[_DiskLocation]:
        # Serializing (pickling, for pandas) happens here, off the event loop.
        return [self._append(partition, *self._serialized(table)) for partition, table in items]

    def _to_host(self, table: Any) -> Any:
        with copies.timed("move"):
            return self._backend.to_host(table)

    def _serialized(self, table: Any) -> tuple[dict[str, Any], list[Any]]:
        with copies.timed("serialize"):
            if self._spill_memo is None:  # backends without one may not take it
                return self._backend.serialize(table)
            return self._backend.serialize(table, memo=self._spill_memo)

    def _append(self, partition: int, header: dict[str, Any], frames: list[Any]) -> _DiskLocation:
        path = os.path.join(self._directory, f"{partition}.bin")
        lengths = tuple(memoryview(f).nbytes for f in frames)
        try:
            # Creating the file under the lock that close() takes before it
            # removes the directory: a write racing a close can never recreate
            # the directory after it was removed.
            with self._lock:
                self._raise_if_closed()
                if not self._directory_made:
                    os.makedirs(self._directory, exist_ok=True)
                    self._directory_made = True
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                with copies.timed("spill"):
                    offset = os.lseek(fd, 0, os.SEEK_END)
                    _write_all(fd, frames)
            finally:
                os.close(fd)
            copies.count("spill", sum(lengths))
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ShuffleDiskFullError(self._directory) from e
            raise
        return _DiskLocation(path, offset, lengths, header)

    # -- reading (task thread, after the barrier) ---------------------------

    def start_unpack(self, owner: object = _ANY_OWNER) -> bool:
        """The run's first unpack: once every shuffle on the worker unpacks,
        malloc gives back what the transfer left in its heaps, and the pool
        starts dropping free blocks the outputs do not take up.

        True for the first call only; ``owner``: as for :meth:`read`.
        """
        pool = host_pool()
        with self._lock:
            self._raise_unless_owner(owner)
            if self._unpacking or self._closed:
                return False
            # Counted under the store's lock, which close() takes before it
            # reads _unpacking: the pool's count always matches.
            self._unpacking = True
            every = pool.count_unpack()
        if every:
            # pyarrow's goes in the output check, on the event loop too
            # (budget.make_room).
            trim_allocators(arrow=False)
        return True

    def partition_sizes(self) -> dict[int, OutputSize]:
        """Rows and bytes held for each output partition not yet read."""
        with self._lock:
            return {
                partition: OutputSize(
                    nrows=sum(p.nrows for p in pieces),
                    nbytes=sum(p.nbytes for p in pieces),
                    largest_piece=max((p.nbytes for p in pieces), default=0),
                    concat_bytes=sum(p.concat_nbytes for p in pieces),
                )
                for partition, pieces in self._pieces.items()
            }

    def partitions_held(self) -> int:
        """Output partitions with pieces not yet read."""
        with self._lock:
            return len(self._pieces)

    def read(self, partition: int, owner: object = _ANY_OWNER) -> tuple[int, Iterator[Any]]:
        """Rows and pieces of ``partition``, in input-partition order.

        Pieces are brought up one at a time and released as soon as the
        consumer asks for the next one.  ``owner``, the run reading: a store
        handed over since refuses it (:class:`ShuffleClosedError`), so an
        unpack of a failed run that passed its own check just before the
        failure cannot take pieces the next run counts as kept.
        """
        with self._lock:
            self._raise_unless_owner(owner)
            pieces = self._pieces.pop(partition, [])
            self._read.add(partition)
            for piece in pieces:
                piece.reading = True
            self.statistics.partitions_read += 1
            self._largest_output = max(self._largest_output, sum(p.nbytes for p in pieces))
        pieces.sort(key=lambda piece: (piece.input_partition, piece.chunk))
        return sum(p.nrows for p in pieces), self._bring_up(partition, pieces)

    def _bring_up(self, partition: int, pieces: list[_Piece]) -> Iterator[Any]:
        # The partition's spill file, mapped once: pieces read from it are
        # views of the page cache, copied straight into the output, instead
        # of a read into fresh memory and a second copy.
        mapping: mmap.mmap | None = None
        with self._lock:
            self._reading += 1
        try:
            for piece in pieces:
                # close() deleted the spill files and released every piece.
                self._raise_if_closed()
                if piece.disk is not None:
                    # deserialize() returns tables on the backend's tier.
                    if mapping is None:
                        mapping = _map(piece.disk.path)
                    table = self._load(piece, mapping)
                elif piece.group is not None and piece.group.tier != self._backend.tier:
                    # A device table moved to host memory: bring it back.
                    start = time.perf_counter()
                    table = self._backend.to_device(piece.table)
                    copies.count("move", piece.nbytes)
                    self._memory.moved(HOST, DEVICE, piece.nbytes, time.perf_counter() - start)
                else:
                    table = piece.table
                piece.table = None
                yield table
                del table
                disk = piece.disk
                self._consumed(piece)
                self._compact_due_groups()
                if disk is not None and mapping is not None:
                    _drop_pages(mapping, disk.offset, sum(disk.lengths))
        finally:
            with self._lock:
                self._reading -= 1
            for piece in pieces:
                if piece.reading:
                    self._consumed(piece)
            with contextlib.suppress(FileNotFoundError):  # or close() removed it
                os.unlink(os.path.join(self._directory, f"{partition}.bin"))

    def _load(self, piece: _Piece, mapping: mmap.mmap) -> Any:
        assert piece.disk is not None
        start = time.perf_counter()
        location = piece.disk
        view = memoryview(mapping)
        frames, offset = [], location.offset
        for length in location.lengths:
            frames.append(view[offset : offset + length])
            offset += length
        del view
        self._memory.moved(DISK, HOST, piece.nbytes, time.perf_counter() - start)
        self.statistics.bytes_read_back += piece.nbytes
        start = time.perf_counter()
        with copies.timed("deserialize"):
            table = self._backend.deserialize(location.header, frames)
        if self._backend.tier == DEVICE:
            # A device backend's deserialize copies the frames to the device.
            self._memory.moved(HOST, DEVICE, piece.nbytes, time.perf_counter() - start)
        return table

    def _consumed(self, piece: _Piece) -> None:
        with self._lock:
            if not piece.reading:
                return
            piece.reading = False
            group = piece.group
            self._drop_locked(piece)
            if (
                group is not None
                and group.live
                and group.tier == HOST
                and group.borrowed is None
                and group.nbytes >= _COMPACT_MIN_BYTES
                and group.live_nbytes <= (1 - _COMPACT_READ_SHARE) * group.nbytes
            ):
                self._compact_due[group.key] = group

    def _compact_due_groups(self) -> None:
        """Copy what is left of each half-read host group together, and let
        the group's buffers go (the module docstring says why).

        Only once the outputs built and still held (the pool's ``unpack``
        blocks, of every run here) add up to :data:`_COMPACT_HELD_OUTPUTS` of
        the largest, beyond two for each output being built (its own block,
        and the one before, waiting for the task that reads it): outputs are
        being kept (a persisted frame), and the peak grows with every
        further output unless the store shrinks.  Where outputs are consumed
        as they are built, the peak came early in the unpack, and copies made
        halfway only added their pages while the group's waited, freed, in
        the pool (381 -> 490 MiB a worker, 12M rows on 2 workers).  Outputs
        the pool does not hold (pool off, under 1 MiB, larger than its
        limit) are not counted: then nothing is copied.
        """
        pool = host_pool()
        # Called after every piece an unpack consumes: with nothing due, no
        # trip to the pool's lock (an unlocked look; a group queued meanwhile
        # is taken after the next piece).
        while self._compact_due:
            held = pool.in_use("unpack")  # not under the store's lock: it may unmap
            with self._lock:
                if self._closed or self._compact_failed or not self._compact_due:
                    return
                building = _COMPACT_HELD_OUTPUTS + 2 * self._reading
                if held < building * self._largest_output:
                    return
                _, group = self._compact_due.popitem()
                pieces = [
                    p
                    for p in group.pieces
                    if p.group is group and not p.reading and p.table is not None
                ]
                tables = [p.table for p in pieces]
            try:
                compacted = self._backend.compacted(tables) if pieces else None
            except Exception:
                logger.warning(
                    "%s: could not copy half-read shards together; they stay whole",
                    self._describe,
                    exc_info=True,
                )
                self._compact_failed = True
                compacted = None
            del tables
            if compacted is not None:
                self._move_into_new_group(group, pieces, compacted)

    def _move_into_new_group(self, group: _Group, pieces: list[_Piece], tables: list[Any]) -> None:
        """Give ``pieces`` of ``group`` their copies ``tables``, in a group
        of their own; pieces read, moved or released meanwhile keep theirs
        (the copy goes)."""
        into = _Group(tier=group.tier, nbytes=0)
        with self._lock:
            for piece, table in zip(pieces, tables, strict=True):
                if self._closed or piece.group is not group or piece.reading:
                    continue
                piece.table, piece.group = table, into
                into.pieces.append(piece)
                into.nbytes += piece.nbytes
                self._unref_locked(group, piece.nbytes)
            if into.pieces:
                into.live, into.live_nbytes = len(into.pieces), into.nbytes
                self._add_group(into)
                self._charge(into.tier, into.nbytes)
                self.statistics.compactions += 1
                self.statistics.bytes_compacted += into.nbytes
                self._memory.compacted(into.nbytes)

    # -- partial recovery (gpushuffle.engine.recovery) -----------------------

    def hand_over(self, owner: object | None = None) -> None:
        """From now on only ``owner``'s puts are taken (``None``: nobody's,
        while the store waits for the run that adopts it)."""
        with self._lock:
            self._owner = owner

    async def adopt(
        self,
        keep: set[int],
        bucket_of: dict[int, int],
        owner: object,
        offload: Callable[..., Awaitable[Any]],
        describe: str,
    ) -> tuple[dict[int, frozenset[int]], set[int], int, int]:
        """Make this store ``owner``'s (files written by ``offload``, errors
        naming ``describe``), keeping the pieces of ``keep``.

        Dropped: partitions not kept, and every piece of an input whose shard
        for a bucket did not arrive whole (``bucket_of`` says which partitions
        a bucket has).  Returns the inputs each bucket holds whole, the kept
        partitions an unpack had read (they hold nothing now), the bytes kept
        and those dropped.
        """
        async with self._evicting:  # no move down or put half done
            with self._lock:
                self._raise_if_closed()
                partial = {
                    key for key, (expected, held) in self._receipts.items() if len(held) < expected
                }
                partial_inputs: dict[int, set[int]] = {}
                for input_partition, bucket in partial:
                    partial_inputs.setdefault(bucket, set()).add(input_partition)
                    del self._receipts[(input_partition, bucket)]
                dropped = 0
                for partition in list(self._pieces):
                    inputs = partial_inputs.get(bucket_of.get(partition, -1), set())
                    if partition not in keep:
                        remove = self._pieces.pop(partition)
                        kept = []
                    else:
                        pieces = self._pieces[partition]
                        remove = [p for p in pieces if p.input_partition in inputs]
                        kept = [p for p in pieces if p.input_partition not in inputs]
                        self._pieces[partition] = kept
                    for piece in remove:
                        dropped += piece.nbytes
                        self._drop_locked(piece)
                    if not kept:
                        self._pieces.pop(partition, None)
                complete: dict[int, set[int]] = {}
                for input_partition, held_bucket in self._receipts:
                    complete.setdefault(held_bucket, set()).add(input_partition)
                emptied = keep & self._read
                self._read.clear()
                kept_bytes = sum(p.nbytes for ps in self._pieces.values() for p in ps)
                self._owner = owner
                self._offload = offload
                self._describe = describe
                unpacked, self._unpacking = self._unpacking, False
                self._compact_due.clear()
                self._largest_output = 0
            if unpacked:
                host_pool().uncount_unpack()
        return {b: frozenset(c) for b, c in complete.items()}, emptied, kept_bytes, dropped

    def receipt_keys(self) -> set[tuple[int, int, int]]:
        """(input partition, bucket, chunk) of every shard this store took."""
        with self._lock:
            return {
                (input_partition, bucket, chunk)
                for (input_partition, bucket), (_, held) in self._receipts.items()
                for chunk in held
            }

    def _drop_locked(self, piece: _Piece) -> None:
        """Release ``piece``'s table, spill-file bytes and share of its group."""
        piece.table = None
        if piece.disk is not None:
            self._charge(DISK, -piece.nbytes)
            piece.disk = None
        if piece.group is not None:
            group, piece.group = piece.group, None
            self._unref_locked(group, piece.nbytes)

    # -- accounting ---------------------------------------------------------

    def _charge(self, tier: str, nbytes: int) -> None:
        if self._closed:
            # close() released everything this store held.  Work still in
            # flight when it closed (a move down whose file write finished,
            # an unpack consuming its pieces) must neither charge the worker
            # for bytes nobody will release nor release them a second time.
            return
        if nbytes >= 0:
            self._memory.charge(tier, nbytes)
        else:
            self._memory.release(tier, -nbytes)
        self.statistics.add(tier, nbytes)

    def _add_group(self, group: _Group) -> None:
        group.key = self._next_group
        self._next_group += 1
        self._groups[group.key] = group

    def _unref(self, group: _Group, nbytes: int) -> None:
        with self._lock:
            self._unref_locked(group, nbytes)

    def _unref_locked(self, group: _Group, nbytes: int) -> None:
        """One of ``group``'s pieces, of ``nbytes``, left it."""
        group.live -= 1
        group.live_nbytes -= nbytes
        if group.live == 0:
            self._charge(group.tier, -group.nbytes)
            self._groups.pop(group.key, None)
            self._borrowed.pop(group.key, None)
            group.pieces.clear()
            group.borrowed = None

    def close(self) -> None:
        """Release every piece and its accounting; delete spill files.

        Safe while other work on the store is in flight (a put, a move down,
        an unpack): afterwards it charges and releases nothing and raises
        :class:`ShuffleClosedError`, which distributed's task wrappers turn
        into a reschedule.
        """
        with self._lock:
            if self._closed:
                return
            # The statistics hold exactly what this store charged per tier.
            for tier in (DEVICE, HOST, DISK):
                self._charge(tier, -getattr(self.statistics, f"{tier}_bytes"))
            self._closed = True
            for group in self._groups.values():
                group.pieces.clear()
                group.borrowed = None
            self._groups.clear()
            self._borrowed.clear()
            self._compact_due.clear()
            self._pieces.clear()
        host_pool().unhold(unpacked=self._unpacking)
        shutil.rmtree(self._directory, ignore_errors=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise ShuffleClosedError(f"{self._describe} was closed")

    def _raise_unless_owner(self, owner: object) -> None:
        if owner is not _ANY_OWNER and owner is not self._owner:
            raise ShuffleClosedError(f"{self._describe} was handed over to another run")


def _write_all(fd: int, frames: list[Any]) -> None:
    """Write ``frames`` in order, in as few system calls as they allow: a
    piece is a frame per buffer (27 for 15 mixed columns), and a Python
    file object wrote them one call each."""
    views = [v for v in (memoryview(f).cast("B") for f in frames) if v.nbytes]
    first = 0
    while first < len(views):
        written = os.writev(fd, views[first : first + IOV_MAX])
        if not written:
            raise OSError(errno.EIO, "gpushuffle: a spill file took no bytes")
        # A regular file takes all of it but at a signal or a full disk.
        while first < len(views) and written >= views[first].nbytes:
            written -= views[first].nbytes
            first += 1
        if written:
            views[first] = views[first][written:]


def _map(path: str) -> mmap.mmap:
    """``path`` mapped copy-on-write: readable and writable, the file untouched.

    Tables read from it are views that keep the mapping alive; it is unmapped
    when the last of them is gone, and the (already deleted) file with it.
    """
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def _drop_pages(mapping: mmap.mmap, offset: int, length: int) -> None:
    """Let go of the mapped pages of a piece the unpack has copied.

    Pages of a file mapping that were read count in the worker's RSS (what
    distributed's memory monitor watches) until they are unmapped, so a
    partition read whole from its spill file would count twice: once in its
    output, once in the mapping.  ``MADV_DONTNEED`` drops them; the mapping
    is private and never written, so a later access (a view still held, the
    next piece's first page) reads the same bytes from the file again.
    """
    advise = getattr(mapping, "madvise", None)
    if advise is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset - offset % mmap.PAGESIZE
    stop = (offset + length) - (offset + length) % mmap.PAGESIZE
    if stop > start:
        advise(mmap.MADV_DONTNEED, start, stop - start)


def _gib(nbytes: int | None) -> str:
    if nbytes is None:
        return "unlimited"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
