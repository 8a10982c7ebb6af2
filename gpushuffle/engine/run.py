"""One shuffle run on one worker: split and send inputs, store shards, unpack.

Coordination (run ids, the barrier, restarts, output-worker restrictions) is
distributed's: this class fills in the data path of its ``ShuffleRun``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from dask.typing import Key
from dask.utils import parse_bytes, parse_timedelta
from distributed import Reschedule
from distributed.comm import get_address_host
from distributed.core import ErrorMessage, OKMessage, Status, error_message
from distributed.metrics import context_meter, thread_time
from distributed.utils import sync
from tornado.ioloop import PeriodicCallback

from gpushuffle import config, samehost
from gpushuffle._distributed import (
    HELD,
    RESTART_FOR_OUTPUT,
    RESTRICT_OUTPUT_TASK,
    P2PConsistencyError,
    ResourceLimiter,
    ShuffleClosedError,
    ShuffleRun,
    ShuffleSpec,
    pin_output_tasks,
    prepare_schedulers,
)
from gpushuffle.engine import budget, copies, links, recovery, worker_ops
from gpushuffle.engine.linger import HeldBack
from gpushuffle.engine.memory import DEVICE, DISK, HOST, WorkerMemory, worker_memory
from gpushuffle.engine.outputs import (
    check_outputs_fit,
)
from gpushuffle.engine.pool import host_pool
from gpushuffle.engine.registry import backend_for
from gpushuffle.engine.store import ShardStore
from gpushuffle.errors import (
    ShuffleCodecError,
    ShuffleCommError,
    ShuffleDiskFullError,
    ShuffleOutputTooLargeError,
)
from gpushuffle.transport import (
    EncodedTable,
    LentTable,
    Shard,
    decode,
    encode,
    peer_traffic,
    read_lent,
    statistics,
    wire_payload,
)

if TYPE_CHECKING:
    from gpushuffle._distributed import ShuffleWorkerPlugin

T = TypeVar("T")


class NoHandlerYet(ConnectionError):
    """A peer answered a gpushuffle op as distributed answers one it has no
    handler for; retried as a failed connection is (it soon will have it)."""


#: How often a transfer task held back by a slow link looks again.
_BACKLOG_POLL_S = 0.02

#: How often a run checks whether distributed paused its worker for memory.
_PAUSE_CHECK_MS = 100

logger = logging.getLogger(__name__)


# The base class's first parameter types both output partitions (ints here)
# and the keys of shards on the wire ((input partition, chunk) here).
class GPUShuffleRun(ShuffleRun[Any, Any]):
    """Worker-side state of one run of a :class:`GPUShuffleSpec`.

    Transfer: each input partition is reordered once by the backend so that
    the rows for each destination worker are contiguous, then cut into one
    :class:`Shard` per worker (views, no copy).  The local shard goes
    straight into the store; the others go through distributed's comm buffer
    (batched, concurrency- and memory-limited) to their workers.

    Unpack: an output partition's pieces are concatenated in input-partition
    order against ``meta``; a partition that received nothing is ``meta``.
    """

    def __init__(
        self,
        spec: GPUShuffleSpec,
        worker_for: dict[int, str],
        run_id: int,
        span_id: str | None,
        plugin: ShuffleWorkerPlugin,
    ) -> None:
        worker = plugin.worker
        super().__init__(
            id=spec.id,
            run_id=run_id,
            span_id=span_id,
            local_address=worker.address,
            # The base class's own buffers are unused (disk=False: it creates
            # no directory); received shards go to ``self.store``.
            directory=os.path.join(worker.local_directory, f"gpushuffle-{spec.id}-{run_id}"),
            executor=plugin._executor,
            rpc=worker.rpc,
            digest_metric=worker.digest_metric,
            scheduler=worker.scheduler,
            memory_limiter_disk=ResourceLimiter(None),
            memory_limiter_comms=plugin.memory_limiter_comms,
            disk=False,
            loop=worker.loop,
        )
        self.spec = spec
        self.column = spec.column
        self.keep_index = not spec.ignore_index
        self.backend = backend_for(spec.meta)
        meta_out = spec.meta.drop(columns=[spec.column])
        if spec.ignore_index:
            meta_out = meta_out.reset_index(drop=True)
        self.meta_out = meta_out
        self.worker_for = worker_for
        self._worker = worker
        on_device = self.backend.tier == DEVICE
        memory = worker_memory(
            device_sharers=budget.workers_sharing_the_gpu(worker.address, worker_for.values())
            if on_device
            else None
        )
        memory.runs_started += 1
        self._configure_sends(worker.address, worker_for, on_device)
        self.borrow_inputs = spec.borrow_inputs and bool(config.get("memory.borrow-inputs"))
        self._inputs_done_started = False
        self._too_large: ShuffleOutputTooLargeError | None = None
        # Set once the first unpack has made room for the outputs and checked
        # that they fit: other task threads wait for it before building any.
        self._outputs_checked = threading.Event()
        #: Output partitions this run has taken out of its store.
        self._outputs_read: set[int] = set()
        self._inputs_done_lock = asyncio.Lock()
        self._open_store(spec, worker_for, run_id, memory)
        self._watch_memory(memory, plugin)
        worker_ops.install(worker, plugin)
        self._closing = asyncio.Event()
        self._layout(worker_for, spec.npartitions, spec.done)
        # A worker paused for its memory runs no task until that drops; what
        # the store holds in memory goes to disk meanwhile (ShardStore.shed_host).
        self._shedding: asyncio.Future[int] | None = None
        self._pause_watch = PeriodicCallback(self._shed_if_paused, _PAUSE_CHECK_MS)
        worker.loop.add_callback(self._start_pause_watch)

    def _configure_sends(self, address: str, worker_for: dict[int, str], on_device: bool) -> None:
        """How this run sends: message sizes, what waits per peer, compression
        and same-host reads, from gpushuffle's configuration."""
        self.send_timeout = parse_timedelta(config.get("comm.timeout"), default="s") or None
        self.message_bytes = max(1, int(parse_bytes(config.get("comm.message-bytes-limit"))))
        # Small remote shards wait, per worker, until a message's worth is
        # ready (or every input is in).
        self.held_back = HeldBack(self.message_bytes, on_device)
        self.same_host_reads = bool(config.get("comm.same-host-reads"))
        self.compression = links.RunCompression(links.configured_mode())
        self.link_backlog_s = parse_timedelta(config.get("comm.link-backlog"), default="s") or 0
        self._host = get_address_host(address)
        self._remote_hosts = {
            get_address_host(a) for a in worker_for.values() if get_address_host(a) != self._host
        }
        self._lent_unanswered: list[list[Any]] = []
        # What receivers check after reading what this run lent; withdrawn
        # as the run closes, before it lets go of anything (samehost).
        self._lease = samehost.new_lease() if self.same_host_reads else None
        # A safety net (a run dropped without closing); run once, by _release.
        self._withdraw_lease = (
            weakref.finalize(self, self._lease.withdraw) if self._lease is not None else None
        )
        self._reading = asyncio.Lock()

    def _open_store(
        self, spec: GPUShuffleSpec, worker_for: dict[int, str], run_id: int, memory: WorkerMemory
    ) -> None:
        """The store received shards go to: a new one, or under partial
        recovery (:mod:`gpushuffle.engine.recovery`) the one this worker's run
        before it held, which this run adopts."""
        worker = self._worker
        self.generation = spec.generation
        mine = [p for p, w in worker_for.items() if w == worker.address and p not in spec.done]
        holding = recovery.RunRecovery.holding_for(worker.address, spec, run_id)
        self.store = (
            holding.store
            if holding is not None
            else ShardStore(
                backend=self.backend,
                memory=memory,
                directory=os.path.join(worker.local_directory, f"gpushuffle-{spec.id}-{run_id}"),
                offload=self.offload,
                wait_timeout=parse_timedelta(config.get("memory.wait-timeout"), default="s") or 0,
                describe=f"gpushuffle {spec.id} on {worker.address}",
                host_sharers=budget.workers_on_host(worker.address, worker_for.values()),
            )
        )
        if holding is None:
            self.store.hand_over(self)
        self.recovery = recovery.RunRecovery(self, mine, holding)

    def _watch_memory(self, memory: WorkerMemory, plugin: ShuffleWorkerPlugin) -> None:
        """Bound the host pool by the store's budget and let it watch the
        worker's threads and memory."""
        worker = self._worker
        if memory.host.limit is not None:
            # Free pool blocks count against the machine like the store does.
            host_pool().bound_by(memory.host.limit)
        # Task and offload threads allocate in malloc arenas of their own,
        # which a trim of the whole process leaves as they are (see MallocReuse).
        for executor in (*worker.executors.values(), plugin._executor):
            host_pool().malloc.watch(executor)
        host_pool().watch_worker(worker)

    def _start_pause_watch(self) -> None:
        if not self._closing.is_set():
            self._pause_watch.start()

    def _shed_if_paused(self) -> None:
        if self._shedding is not None or self._closing.is_set():
            return
        if self._worker.status != Status.paused:
            return
        self._shedding = asyncio.ensure_future(self.store.shed_host())
        self._shedding.add_done_callback(self._shed_done)

    def _shed_done(self, future: asyncio.Future[int]) -> None:
        self._shedding = None
        if not future.cancelled() and (e := future.exception()) is not None:
            # The next put or unpack meets the same fault (a full disk, a
            # closed store) and reports it; the watch only logs it here.
            logger.warning("%s: moving received shards to disk while paused failed: %r", self, e)

    def _layout(self, worker_for: dict[int, str], npartitions: int, done: frozenset[int]) -> None:
        """Order wanted partitions by destination worker (``self.base_layout``).

        A recovering run sends by its recovery's send plan instead, once it
        knows what its receivers hold.
        """
        by_worker: dict[str, list[int]] = {}
        for partition, address in sorted(worker_for.items()):
            if partition not in done:
                by_worker.setdefault(address, []).append(partition)
        self.base_layout = recovery.layout(
            npartitions,
            ((address, 0, np.asarray(p, dtype=np.int64)) for address, p in by_worker.items()),
        )

    async def _plan_sends(self) -> None:
        """A recovering run's senders: ask each receiver what it holds, once."""
        receivers = sorted({a for a, _, _, _ in self.base_layout.groups})
        await self.recovery.plan_sends(receivers, self._ask_held)

    async def _ask_held(self, address: str) -> dict[str, Any]:
        async def attempt() -> dict[str, Any]:
            call = self.rpc(address).gpushuffle_held(shuffle_id=self.id, run_id=self.run_id)
            result: dict[str, Any] | None = await asyncio.wait_for(call, self.send_timeout)
            if result is None:
                # distributed's answer to an op without a handler: the
                # worker has not set up gpushuffle's yet (WorkerOps).
                raise NoHandlerYet(f"{address} has no {HELD} handler (yet)")
            return result

        return await self._unless_closing(
            self._retry_until_closed(attempt, f"asking {address} what it holds")
        )

    async def _retry_until_closed(self, attempt: Callable[[], Awaitable[T]], what: str) -> T:
        """``attempt()``, retried on ``OSError`` as distributed's ``retry()``
        does (``distributed.p2p.comm.retry.*``), never past the run's closing.

        Not distributed's ``retry()``: a cancellation that comes as an attempt
        fails with an ``OSError`` is lost in ``asyncio.wait_for``, and the
        backoff (up to ``retry.delay.max``) would then keep a closed run
        sending to, or asking, a worker that is gone, and its transfer task
        from being run again (seen with a closed run's held query).  This loop
        looks at the run before each try and stops waiting when it closes.
        """
        for tried in itertools.count():
            self.raise_if_closed()
            if self._closing.is_set():
                raise ShuffleClosedError(f"{self} was closed while {what}")
            try:
                return await attempt()
            except OSError as e:
                if tried >= self.RETRY_COUNT:
                    raise
                logger.info("%s: retrying %s after attempt %d failed: %r", self, what, tried + 1, e)
            delay = min(self.RETRY_DELAY_MIN * (2**tried - 1), self.RETRY_DELAY_MAX)
            await self._unless_closing(asyncio.sleep(delay * (1 + 0.1 * random.random())))
        raise AssertionError("unreachable")  # pragma: no cover

    # -- transfer ---------------------------------------------------------

    def add_partition(self, data: Any, partition_id: int) -> int:
        self.raise_if_closed()
        if self.transferred:
            raise RuntimeError(f"Cannot add more partitions to {self}")
        self.backend.validate(data, self.spec.meta, self.column, partition_id)
        if self.generation:
            sync(self._loop, self._plan_sends)
        with self._capture_metrics("foreground"):
            with (
                context_meter.meter("p2p-shard-partition-noncpu"),
                context_meter.meter("p2p-shard-partition-cpu", func=thread_time),
            ):
                shards = self._shard_partition(data, partition_id)
            here = self.local_address
            local = [shard for address, shard in shards if address == here]
            remote = [(address, shard) for address, shard in shards if address != here]
            sync(self._loop, self._write, local, self._chunk(remote))
        if self.link_backlog_s and self._remote_hosts:
            sync(self._loop, self._hold_while_a_link_is_behind)
        return self.run_id

    async def _hold_while_a_link_is_behind(self) -> None:
        """Back-pressure per link: the transfer task returns once what this
        worker has queued for every other host would take at most
        ``comm.link-backlog`` to send at that link's measured rate.

        Meanwhile the task holds its thread, so the scheduler gives the next
        inputs to workers whose links keep up: where inputs are computed in
        the transfer tasks, a host that took more of them would otherwise
        send more across its link than the others and finish last.
        """
        if self._seconds_behind() <= self.link_backlog_s:
            return
        # What waits for a fuller message counts toward the backlog, but only
        # a later write sends it: where it alone passes the backlog at a
        # link's measured rate (slow on a busy machine), the wait would never
        # end.  A transfer that waits gains nothing by holding it back.
        await self._send_all_lingering()
        started = time.perf_counter_ns()
        try:
            while self._seconds_behind() > self.link_backlog_s:
                self.raise_if_closed()
                self._comm_buffer.raise_on_exception()
                await asyncio.sleep(_BACKLOG_POLL_S)
        finally:
            statistics.add(transfers_held=1, transfers_held_ns=time.perf_counter_ns() - started)

    def _seconds_behind(self) -> float:
        """The longest time, over other hosts, to send what this worker has
        queued for it: in flight, waiting in the comm buffer or held back."""
        waiting = [*self._comm_buffer.sizes.items(), *self.held_back.sizes().items()]
        return links.seconds_behind(self._remote_hosts, waiting)

    async def _write(self, local: list[Shard], remote: list[dict[str, Shard]]) -> None:
        if self._inputs_done_started:
            # Shards held back now would never be sent.
            raise RuntimeError(f"Cannot add more partitions to {self}")
        if local:
            # Shards for this worker skip serialization and the comm buffer.
            await self._store(local)
        for round in remote:
            direct: dict[str, Shard] = {}
            for address, shard in round.items():
                if not self.held_back.waits(address, shard):
                    direct[address] = shard
                    continue
                # A waiting shard must keep only its own rows alive (a
                # scatter shares blocks).
                detached = self.backend.detached(shard.table)
                if detached is not shard.table:
                    shard.table = detached
                    self.held_back.detached += 1
                self.held_back.add(address, shard)
                if self.held_back.ready(address):
                    await self._send_lingering(address)
                elif excess := self.held_back.excess():
                    await self._send_most_lingering(excess)
            if direct:
                # distributed's comm buffer keeps whatever it is given and
                # hands it to send(); its type says (key, shard), ours carry
                # their key.
                await self._write_to_comm(direct)  # type: ignore[arg-type]

    async def _send_lingering(self, address: str) -> None:
        shards = self.held_back.take(address)
        # Written without yielding to the loop in between (the buffer's
        # write does not yield while under its memory limit), so the buffer
        # packs them into as few messages as its message size allows.
        for shard in shards:
            await self._write_to_comm({address: shard})  # type: ignore[dict-item]

    async def _send_all_lingering(self) -> None:
        for address in self.held_back.peers():
            await self._send_lingering(address)

    async def _send_most_lingering(self, nbytes: int) -> None:
        """Send the peers with the most held back, until ``nbytes`` have gone."""
        self.held_back.sheds += 1
        for address in self.held_back.most_first():
            if nbytes <= 0:
                break
            # Another transfer's write may have sent it while this one waited.
            nbytes -= self.held_back.held(address)
            await self._send_lingering(address)

    async def inputs_done(self) -> None:
        # Every input is in: what still lingers goes before the comm buffer
        # is flushed.  The scheduler may call this again while a first call
        # still drains (it retries a worker that answered with an OSError):
        # the lock makes the second wait, so it cannot flush the buffer
        # under the first one's feet.
        self.raise_if_closed()
        self._inputs_done_started = True
        async with self._inputs_done_lock:
            try:
                await self._send_all_lingering()
            except Exception as e:
                self._exception = e
                raise
            await super().inputs_done()

    def _prepare_outputs(self) -> None:
        """Judge, as the worker's first unpack starts, whether its largest
        output partition can be built here, and make room for it.

        Only once the barrier has passed is every shard in (a worker's own
        inputs_done returns before its peers have flushed their sends to
        it).  The verdict is :func:`~gpushuffle.engine.outputs.check_outputs_fit`'s
        rule on sizes; a refusal is kept, and every unpack of the run raises
        it, so that the partition is never built.
        """
        sizes = self.store.partition_sizes()
        if not sizes:
            return
        largest = max(sizes.values(), key=lambda size: size.nbytes)
        overhead = self.backend.assembly_overhead
        verdict = budget.output_budget(
            self.backend.tier,
            largest,
            overhead,
            make_room=lambda: budget.make_room(self.store, self._loop, str(self)),
            worker=self._worker,
            describe=str(self),
        )
        check_outputs_fit(sizes, verdict, overhead, where=f"{self.id} on {self.local_address}")

    def _chunk(self, shards: list[tuple[str, Shard]]) -> list[dict[str, Shard]]:
        """Cut remote shards into row ranges of at most ``message_bytes``.

        Each round of the result holds at most one chunk per worker, the
        shape distributed's comm buffer takes.  A receiver holds every
        message that waits for room in its store, so smaller messages keep
        that backlog small.  Shards lent to a worker on this machine
        (:mod:`gpushuffle.samehost`) stay whole: their message carries only
        where the rows are, the receiver reads one such message at a time,
        once it has stored the one before, and it reads a shard into one
        buffer the size of the split's, which the pool most often has free
        (a split's, given back once sent).
        """
        rounds: list[dict[str, Shard]] = []
        next_round: dict[str, int] = {}
        for address, shard in shards:
            nrows = int(shard.offsets[-1])
            count = max(1, min(nrows, -(-shard.nbytes // self.message_bytes)))
            if self._lends_to(address):
                count = 1
            bounds = np.linspace(0, nrows, count + 1).astype(np.int64)
            for chunk, (start, stop) in enumerate(itertools.pairwise(bounds)):
                if count == 1:
                    piece = shard
                else:
                    table = self.backend.slice(shard.table, int(start), int(stop))
                    piece = dataclasses.replace(
                        shard,
                        offsets=np.clip(shard.offsets, start, stop) - start,
                        table=table,
                        nbytes=self.backend.nbytes(table),
                        chunk=chunk,
                        chunks=count,
                    )
                round = next_round.get(address, 0)
                next_round[address] = round + 1
                if round == len(rounds):
                    rounds.append({})
                rounds[round][address] = piece
        return rounds

    def _shard_partition(self, data: Any, partition_id: int) -> list[tuple[str, Shard]]:  # type: ignore[override]
        backend = self.backend
        layout = self.recovery.layout_for(partition_id, self.base_layout)
        if not layout.groups:
            return []
        # One table per destination, each in its own buffers: what goes to
        # another worker is freed once sent, whatever the local shard keeps.
        addresses = [address for address, _, _, _ in layout.groups]
        groups = [ranks for _, _, _, ranks in layout.groups]
        # The local group's rows may stay in the input, which the worker
        # holds anyway (a persisted frame): no copy, nothing to store.  A
        # recovering run may send a worker several groups: none borrows.
        local = addresses.index(self.local_address) if self.local_address in addresses else None
        if addresses.count(self.local_address) > 1:
            local = None
        borrow = local if self.borrow_inputs and backend.borrows else None
        with copies.timed("split"):
            tables, offsets = backend.split_groups(
                data,
                self.column,
                layout.rank,
                layout.nranks,
                self.keep_index,
                groups,
                borrow=borrow,
                local=local,
            )
        out: list[tuple[str, Shard]] = []
        for (address, bucket, partitions, (first, last)), view in zip(
            layout.groups, tables, strict=True
        ):
            start, stop = int(offsets[first]), int(offsets[last])
            if stop == start:
                continue
            out.append(
                (
                    address,
                    Shard(
                        backend=backend.name,
                        input_partition=partition_id,
                        partitions=partitions,
                        offsets=offsets[first : last + 1] - start,
                        table=view,
                        nbytes=backend.nbytes(view),
                        sender=self.local_address,
                        bucket=bucket,
                    ),
                )
            )
        nbytes = sum(s.nbytes for _, s in out)
        self.recovery.sent(nbytes)
        context_meter.digest_metric("p2p-shards", nbytes, "bytes")
        context_meter.digest_metric("p2p-shards", len(out), "count")
        return out

    async def send(self, address: str, shards: list[Shard]) -> OKMessage | ErrorMessage:  # type: ignore[override]
        # The base class measures shards with memoryview(), which fails on
        # frames and device buffers; shards serialize themselves instead.
        async def attempt() -> OKMessage | ErrorMessage:
            # A peer that stops answering fails the send (TimeoutError is an
            # OSError, so it is retried like a broken connection).
            return await asyncio.wait_for(self._send(address, shards), self.send_timeout)

        async def send_with_retries() -> OKMessage | ErrorMessage:
            # A closing run (its shuffle failed, or restarts because a worker
            # left) stops its sends at once: close() waits for them, and a send
            # to a worker that is gone would otherwise keep the run and its
            # buffers alive for minutes (connects time out after
            # distributed.comm.timeouts.connect, then retries back off).
            return await self._unless_closing(
                self._retry_until_closed(attempt, f"sending {len(shards)} shard(s) to {address}")
            )

        lend = self._lends_to(address)
        for shard in shards:
            shard.lend = lend
            shard.lease = self._lease
        answered = False
        nbytes = sum(s.nbytes for s in shards)
        link = links.link_to(get_address_host(address))
        if not lend:
            await self._encode(address, shards, link, nbytes)
        wire = sum(s.encoded.wire_bytes if s.encoded else s.nbytes for s in shards)
        link.started(wire, raw=nbytes)
        started = time.perf_counter()
        try:
            response = await send_with_retries()
            if response.get("lend") == "refused":
                # The receiver cannot read this process's memory: the same
                # message again, as bytes, and every later one to it.
                statistics.add(lends_refused=1)
                if samehost.refused(address, str(response.get("reason"))):
                    logger.info(
                        "gpushuffle: %s cannot read shards from %s's memory (%s); "
                        "sending them over the comm",
                        address,
                        self.local_address,
                        response.get("reason"),
                    )
                for shard in shards:
                    shard.lend = False
                response = await send_with_retries()
            answered = True
            # Sent and answered (so serialized, and read where lent): the rows
            # can go, even where distributed keeps the Shard (its send task's
            # last one, below).
            for shard in shards:
                shard.table = None
                shard.lent = None
            return response
        except ShuffleDiskFullError:
            raise
        except OSError as e:
            raise ShuffleCommError(
                f"gpushuffle {self.id}: sending {len(shards)} shard(s) from "
                f"{self.local_address} to {address} failed after "
                f"{self.RETRY_COUNT} retries (distributed.p2p.comm.retry.count), each "
                f"limited to {self.send_timeout:g} s (gpushuffle.comm.timeout): "
                f"{type(e).__name__}: {e}"
            ) from e
        finally:
            link.finished(wire, delivered=answered)
            peer_traffic.add(
                address, nbytes, time.perf_counter() - started, failed=not answered, wire_bytes=wire
            )
            for shard in shards:
                shard.encoded = None
            if not answered:
                # A receiver may still read what an unanswered attempt lent:
                # it stays alive until the run closes.
                self._lent_unanswered.extend(s.lent for s in shards if s.lent)
            # distributed's comm buffer keeps the list it handed over (and
            # the last shard it took) in its send task's frame until that task
            # has another message to send: a message per task
            # (distributed.p2p.comm.concurrency), which otherwise stays in
            # memory until this worker's next transfer.  A worker paused by
            # distributed runs no transfer, so it never went below its pause
            # threshold again.
            shards.clear()

    async def _encode(
        self, address: str, shards: list[Shard], link: links.LinkMeter, nbytes: int
    ) -> None:
        """Compress the frames of a message to another host where it pays
        (:mod:`gpushuffle.engine.links`), off the event loop."""
        compression = self.compression
        if not compression.enabled:
            return
        for shard in shards:
            shard.own_compression = True
        if compression.mode == "auto" and get_address_host(address) == self._host:
            return  # a loopback socket (same-host reads off, or refused)
        # UCX carries device frames (the cuda serializers), TCP host frames.
        device = self.backend.tier == DEVICE and not address.startswith("tcp://")
        if device and compression.mode == "auto" and not links.DEVICE_CODECS_IN_AUTO:
            return
        # Until a host's link has answered once, its rate is unknown: the
        # first message there goes, later ones wait for its answer (the
        # link is busy meanwhile) instead of guessing.
        await link.first_answer(links.FIRST_ANSWER_S)
        state = compression.state(link)
        # What the encoder has queued, this message included, beyond what
        # the link has queued: the time the link would wait for it.
        encoding_s = (compression.encoding + nbytes) * compression.fastest_seconds_per_byte()
        encoding_s -= link.in_flight / state.rate
        if not compression.worth_encoding(state, nbytes, max(0.0, encoding_s)):
            statistics.add(messages_sent_raw=1)
            return
        compress = compression.compressor(state)
        compression.encoding += nbytes
        try:
            await self.offload(_encode_all, shards, compress, device)
        finally:
            compression.encoding -= nbytes

    async def _send(self, address: str, shards: list[Shard]) -> OKMessage | ErrorMessage:  # type: ignore[override]
        # The message carries a list of Shard objects, so that distributed
        # hands each to the serializer registered for it (its backend's, in
        # the ``dask`` family on TCP and the ``cuda`` family on UCX).  A list
        # of (key, shard) tuples, as the base class sends, would be pickled
        # whole without ever reaching those serializers; keys are derived
        # from each shard on receipt.
        self.raise_if_closed()
        # Until the peer answers: the comm's write, then its receipt.
        with copies.timed("send"):
            return await self.rpc(address).shuffle_receive(
                data=wire_payload(shards),
                shuffle_id=self.id,
                run_id=self.run_id,
            )

    async def _unless_closing(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable``; if the run starts closing first, cancel it instead."""
        work = asyncio.ensure_future(awaitable)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait((work, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            aborted = not work.done()
            if aborted:
                work.cancel()
        if aborted:
            await asyncio.wait((work,))
            if not work.cancelled():
                work.exception()  # retrieved: nobody wants it now
            raise ShuffleClosedError(f"{self} was closed while sending")
        return work.result()

    def _lends_to(self, address: str) -> bool:
        """Whether shards for ``address`` are lent (:mod:`gpushuffle.samehost`)."""
        return (
            self.same_host_reads
            and self._lease is not None
            and address.startswith("tcp://")
            and get_address_host(address) == self._host
            and samehost.may_lend_to(address)
        )

    async def receive(self, data: list[Shard]) -> OKMessage | ErrorMessage:  # type: ignore[override]
        if any(isinstance(shard.table, EncodedTable) for shard in data):
            await self._decode(data)
        if not any(isinstance(shard.table, LentTable) for shard in data):
            return await super().receive(data)  # type: ignore[arg-type]
        # One lent message is read and stored at a time: the others wait
        # with their rows still in their senders' memory, so the store
        # holds at most its budget plus one message, as with the comm.
        async with self._reading:
            try:
                for shard in data:
                    # One already stored (a retried send) is not read again:
                    # its sender may have freed what it lent.
                    if _key(shard) not in self.received:
                        read_lent(shard, _receive_buffer)
            except samehost.LendWithdrawn as e:
                # The sender's run closed (so this shuffle run failed, and
                # this worker hears of it soon): what was read may be rows
                # the sender wrote since, which must never be stored.
                statistics.add(reads_withdrawn=1)
                logger.info("%s: %s", self, e)
                # Not a ShuffleClosedError: a sender whose run were still
                # healthy (never, by construction) must fail, not retry.
                return error_message(P2PConsistencyError(f"{self}: {e}"))
            except samehost.LendRefused as e:
                statistics.add(reads_refused=1)
                # distributed's comm buffer accepts only "OK" or "error"; the
                # sender's send() turns this into "OK" once it sent the bytes.
                return {"status": "OK", "lend": "refused", "reason": str(e)}  # type: ignore[return-value]
            return await super().receive(data)  # type: ignore[arg-type]

    async def _decode(self, data: list[Shard]) -> None:
        """Decompress received shards (a shard already stored, sent again, is not)."""
        fresh = [s for s in data if _key(s) not in self.received]
        try:
            await self.offload(_decode_all, fresh)
        except ShuffleCodecError as e:
            # The shuffle cannot be right without these rows: it fails here,
            # and the sender's send raises the same error.
            self._exception = e
            raise
        for shard in data:
            if isinstance(shard.table, EncodedTable):
                shard.table = None  # a duplicate: _store skips it

    async def _receive(self, data: list[Shard]) -> None:  # type: ignore[override]
        self.raise_if_closed()
        await self._store(data)

    async def _store(self, shards: list[Shard]) -> None:
        await self.recovery.ready()
        buckets = self.recovery.buckets
        for shard in shards:
            # An input partition re-sent (a retried transfer task, a run
            # after a worker's loss) is ignored.
            key = _key(shard)
            if key in self.received:
                continue
            if shard.bucket not in buckets.partitions:
                self._exception = P2PConsistencyError(
                    f"{self}: a shard of input {shard.input_partition} from "
                    f"{shard.sender or 'a peer'} is for bucket {shard.bucket}, which this "
                    f"worker does not have ({sorted(buckets.partitions)})"
                )
                raise self._exception
            self.received.add(key)
            self.total_recvd += shard.nbytes
            try:
                await self.store.put(shard, owner=self)
            except ShuffleClosedError:
                # The run was closed meanwhile; it keeps the reason it has.
                raise
            except Exception as e:
                self._exception = e
                raise

    # -- unpack -----------------------------------------------------------

    def get_output_partition(self, partition_id: int, key: Key, **kwargs: Any) -> Any:
        # distributed's version makes two round trips to the event loop for
        # every output: one to check that the partition is assigned here, one
        # to flush a receive buffer this run does not use (received shards
        # go to the store before the sender's send returns, so every one is
        # in by the barrier).  With many small partitions those hand-offs
        # cost as much as building the output; here the check is made in
        # the task's thread and the loop is asked only to reschedule.
        self.raise_if_closed()
        self.raise_if_read(partition_id)
        if self._get_assigned_worker(partition_id) != self.local_address:
            sync(self._loop, self._ensure_output_worker, partition_id, key)  # raises Reschedule
        if self.recovery.adopting:
            sync(self._loop, self.recovery.ready)
        if not self.transferred:
            raise RuntimeError("`get_output_partition` called before barrier task")
        with (
            self._capture_metrics("foreground"),
            context_meter.meter("p2p-get-output-noncpu"),
            context_meter.meter("p2p-get-output-cpu", func=thread_time),
        ):
            return self._get_output_partition(partition_id, key, **kwargs)

    def raise_if_read(self, partition_id: int) -> None:
        """Have the scheduler start another run, and raise, where output
        ``partition_id`` needs one (:meth:`needs_another_run`)."""
        if self.needs_another_run(partition_id):
            self.request_another_run(partition_id)
            raise ShuffleClosedError(f"{self}: output {partition_id} needs another run")

    def needs_another_run(self, partition_id: int) -> bool:
        """Whether output ``partition_id``'s rows are gone from this run:
        built before a worker left (nobody sent rows for it in this run), or
        read here already (reading takes the rows out of the store).  The
        second happens when an output task runs again without this shuffle
        restarting: the other side of a join restarted while the join's
        output was being built, or the task's first try failed after the
        read.  Not a store read again, which would build it empty."""
        return partition_id in self.spec.done or partition_id in self._outputs_read

    def request_another_run(self, partition_id: int) -> None:
        """Have the scheduler run the shuffle again with output
        ``partition_id`` in it (a no-op where it did already)."""
        sync(self._loop, self._restart_for, partition_id)

    def _get_output_partition(self, partition_id: int, key: Key, **kwargs: Any) -> Any:
        # What the transfer left in malloc's heaps goes back before the first
        # output is built (once no other shuffle on the worker still
        # transfers; its free pool blocks stay for the outputs): this is when
        # the store holds the most.  So do inputs the worker let go of during
        # the transfer (distributed spilled them) that borrowed rows still hold.
        if self.store.start_unpack(owner=self):
            try:
                sync(self._loop, self.store.release_let_go_inputs)
                self._prepare_outputs()
            except ShuffleOutputTooLargeError as e:
                self._too_large = e
            finally:
                self._outputs_checked.set()
        else:
            # Another thread's first unpack is moving shards to disk or
            # checking the outputs: a partition built meanwhile could be the
            # one that does not fit.
            while not self._outputs_checked.wait(0.05):
                self.raise_if_closed()
                if self.store.closed:
                    break  # the read below raises ShuffleClosedError
        if self._too_large is not None:
            raise self._too_large
        nrows, tables = self.store.read(partition_id, owner=self)
        if not nrows:  # an empty one reads the same again
            return self.backend.empty(self.meta_out)
        self._outputs_read.add(partition_id)
        with copies.timed("unpack"):
            return self.backend.assemble(tables, nrows, self.meta_out, self.keep_index)

    async def _restart_for(self, partition_id: int) -> None:
        restart = getattr(self.scheduler, RESTART_FOR_OUTPUT)
        answer = await restart(id=self.id, run_id=self.run_id, partition=partition_id)
        if answer is None:
            # No such handler: rescheduling the task would ask again forever.
            raise P2PConsistencyError(
                f"{self}: output {partition_id} is needed again but its rows are gone, and "
                f"the scheduler cannot run the shuffle again (it has no {RESTART_FOR_OUTPUT} "
                "handler: gpushuffle could not reach it from the shuffle's first run). "
                "Compute the result again."
            )

    def _get_assigned_worker(self, i: int) -> str:
        return self.worker_for[i]

    async def _ensure_output_worker(self, i: int, key: Key) -> None:
        """Send output task ``key`` to the worker that builds partition ``i``
        (``Reschedule``), through the handler that restricts pinned tasks too
        (``_distributed.RESTRICT_OUTPUT_TASK``)."""
        assigned = self._get_assigned_worker(i)
        if assigned == self.local_address:
            return
        restrict = getattr(self.scheduler, RESTRICT_OUTPUT_TASK)
        result = await restrict(id=self.id, run_id=self.run_id, key=key, worker=assigned)
        if not isinstance(result, dict):
            # No such handler (pinning failed before registering it): nothing
            # was pinned either, and distributed's way works.
            await super()._ensure_output_worker(i, key)
            return
        if result["status"] == "error":
            raise RuntimeError(result["message"])
        raise Reschedule()

    # -- bookkeeping ------------------------------------------------------

    def heartbeat(self) -> dict[str, Any]:
        """What the scheduler keeps of this run, every heartbeat.

        distributed's dashboard (its Shuffling panel) draws two buffers per
        worker from ``comm`` and ``disk``: p2p's comm buffer and its buffer
        of shards waiting for disk.  gpushuffle's ``disk`` entry is its store:
        what it holds in memory (device and host tiers) against its memory
        budget, all it holds, and what it wrote to and read from its spill
        files.  ``store`` has the store's statistics, ``tiers`` the worker's
        budgets and what every shuffle there holds per tier.
        """
        heartbeat = super().heartbeat()
        stats = self.store.statistics
        memory = worker_memory()
        in_memory = DEVICE if self.backend.tier == DEVICE else HOST
        heartbeat["disk"] = {
            "memory": stats.device_bytes + stats.host_bytes,
            "total": stats.device_bytes + stats.host_bytes + stats.disk_bytes,
            "buckets": self.store.partitions_held(),
            "written": stats.bytes_spilled,
            "read": stats.bytes_read_back,
            "avg_size": stats.spill_avg_bytes,
            "avg_duration": stats.spill_avg_seconds,
            "memory_limit": memory.tier(in_memory).limit or 0,
        }
        heartbeat["store"] = stats.as_dict()
        heartbeat["tiers"] = {
            tier: {"bytes": memory.tier(tier).bytes, "limit": memory.tier(tier).limit}
            for tier in (DEVICE, HOST, DISK)
        }
        return heartbeat

    def release_failed(self) -> None:
        """The shuffle failed (its barrier erred): free the received shards
        and spill files now, keeping the run and its error until distributed
        closes it (``_distributed.ReleaseFailedRuns``)."""
        if self.closed:
            return
        self.recovery.keep_on_fail = False
        if self._exception is None:
            self.fail(
                P2PConsistencyError(f"{self} failed: the shuffle's barrier erred on the scheduler")
            )
        self._release()

    def fail(self, exception: Exception) -> None:
        # A run failed by distributed because a peer left, after the
        # scheduler said to keep it (KEEP_RUN): its store waits for the next
        # run of the shuffle here (partial recovery) instead of being deleted.
        own = self._exception is not None or self.closed
        super().fail(exception)
        kept = self.recovery
        if kept.keep_on_fail and not own and not kept.handed_over and not self.store.closed:
            hold_s = parse_timedelta(config.get("recovery-hold"), default="s") or 0
            kept.hand_over(self.store, self._worker, hold_s)

    def _release(self) -> None:
        if self._withdraw_lease is not None:
            self._withdraw_lease()
        self._closing.set()
        self._pause_watch.stop()
        self.held_back.clear()
        self.recovery.cancel()
        if not self.recovery.handed_over:
            self.store.close()

    async def close(self) -> None:
        # Release received shards and spill files first: the base class then
        # waits for the comm buffer's sends, which _closing makes give up.
        self._release()
        await super().close()
        self._lent_unanswered.clear()

    def read(self, path: Any) -> tuple[Any, int]:
        raise NotImplementedError("gpushuffle keeps received shards in its own store")

    def deserialize(self, buffer: Any) -> Any:
        raise NotImplementedError("gpushuffle keeps received shards in its own store")


def _key(shard: Shard) -> tuple[int, int, int]:
    """What identifies a received shard: its input partition, bucket and chunk."""
    return (shard.input_partition, shard.bucket, shard.chunk)


def _encode_all(shards: list[Shard], compress: Any, device_frames: bool) -> None:
    for shard in shards:
        encode(shard, compress, device_frames)


def _decode_all(shards: list[Shard]) -> None:
    for shard in shards:
        decode(shard)


def _receive_buffer(nbytes: int) -> np.ndarray:
    """Where lent rows are read to: a pooled buffer, most often one a split
    gave back (same size), whose pages are already there."""
    return host_pool().empty(nbytes, np.uint8, tag="receive")


# -- the spec: what the scheduler and workers need to start a run -------------
#
# It travels once, on the barrier task (P2PBarrierTask), and carries ``meta``:
# workers build output partitions from it and never look at data to learn the
# schema.  Spec and run share a module, as in distributed's shuffles.


@dataclass(frozen=True)
class GPUShuffleSpec(ShuffleSpec[int]):
    """A hash shuffle of a DataFrame by a precomputed partition-id column.

    Parameters
    ----------
    npartitions
        Number of output partitions.
    column
        Column holding each row's output partition, computed by dask's
        ``partitioning_index`` so rows land where the ``tasks`` and ``p2p``
        methods would put them.  It is dropped from the output.
    meta
        Empty frame with the input's schema, ``column`` included.
    parts_out
        The output partitions wanted: all of them (an ``int``) or a subset.
    ignore_index
        Whether to drop the index instead of carrying it.
    borrow_inputs
        Whether the input partitions are persisted data, which workers hold
        whatever the shuffle does: the rows a worker keeps of its own inputs
        may then stay in them instead of being copied into its store
        (``gpushuffle.memory.borrow-inputs``).
    """

    npartitions: int
    column: str
    meta: Any
    parts_out: tuple[int, ...] | int
    ignore_index: bool
    borrow_inputs: bool = False
    #: ``gpushuffle.recovery`` is ``partial`` (:mod:`gpushuffle.engine.recovery`).
    partial_recovery: bool = False
    #: Set by the scheduler for a run after a worker's loss: how many runs
    #: came before, and the output partitions built already (kept).
    generation: int = 0
    done: frozenset[int] = frozenset()

    @property
    def output_partitions(self) -> Generator[int]:
        parts_out = self.parts_out
        yield from range(parts_out) if isinstance(parts_out, int) else parts_out

    def pick_worker(self, partition: int, workers: Sequence[str]) -> str:
        # Range sharding, as p2p does: contiguous output partitions per worker.
        return workers[len(workers) * partition // self.npartitions]

    def create_new_run(self, worker_for: dict[int, str], span_id: str | None) -> Any:
        from gpushuffle import dashboard
        from gpushuffle.engine.graph import output_partition_of

        for scheduler in prepare_schedulers(self.id):
            dashboard.install(scheduler)
            worker_ops.reach_every_worker(scheduler)
        spec = self
        if self.partial_recovery:
            spec, worker_for = recovery.next_run(self, worker_for)
        state = ShuffleSpec.create_new_run(spec, worker_for=worker_for, span_id=span_id)
        pending = {p: w for p, w in worker_for.items() if p not in spec.done}
        pin_output_tasks(self.id, pending, output_partition_of)
        return state

    def create_run_on_worker(
        self,
        run_id: int,
        span_id: str | None,
        worker_for: dict[int, str],
        plugin: ShuffleWorkerPlugin,
    ) -> ShuffleRun:
        return GPUShuffleRun(
            spec=self,
            worker_for=worker_for,
            run_id=run_id,
            span_id=span_id,
            plugin=plugin,
        )
