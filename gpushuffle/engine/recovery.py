"""Partial recovery: a worker lost during a shuffle costs its share, not the whole shuffle.

distributed restarts a shuffle when a worker taking part in it leaves: a new
run (a new run id) sends every input again, because shards pushed to the
lost worker are gone and nothing says which others arrived (dask/distributed
#7353).  gpushuffle keeps that restart, so run ids, the barrier and the
tasks stay distributed's, and makes the new run *recover* what the old one
left on the survivors (``gpushuffle.recovery: partial``):

Scheduler half (:func:`plan_run`, called as the new run is created, and
``_distributed.PartialRestartPlugin``):

- each output partition stays on its worker if that worker is alive; the
  lost workers' partitions go to the survivors, fewest first;
- outputs already built (in memory on a survivor) are not released by the
  restart, and the run's spec names them (``done``): nobody sends rows for
  them again;
- every transfer task runs again (each input has rows for the moved
  partitions; dask recomputes inputs that are gone), but sends only what
  its receivers do not hold.

Worker half (:class:`Holdings`, :func:`adopt`, :func:`held_answer`):

- a run failed because a peer left (the scheduler says so first,
  ``KEEP_RUN``) hands its store over instead of deleting it;
- the next run of the shuffle on that worker adopts it: the rows of an
  input it holds whole (every chunk) for a group of partitions (a
  *bucket*: the partitions one run gave it) stay; an input's partial rows,
  and partitions an unpack had started to read, are dropped and sent again;
- each sender asks every receiver, once per run, for its buckets and the
  inputs each holds whole, and splits an input only for the buckets that
  lack it.  A receiver also drops a chunk it holds (by input, bucket and
  chunk): every row lands exactly once.

A run that finds nothing to adopt (no hand-over reached it in time, or its
store was lost with an error) asks for everything: that is the restart,
never a missing row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

from gpushuffle._distributed import previous_run
from gpushuffle.counters import Counters

if TYPE_CHECKING:
    from gpushuffle.engine.store import ShardStore

logger = logging.getLogger(__name__)

#: ``gpushuffle.recovery`` values.
PARTIAL = "partial"
RESTART = "restart"


@dataclass
class RecoveryStatistics(Counters):
    """What this process's runs recovered (cumulative)."""

    #: Runs that adopted the store of a run failed by a worker's loss.
    runs: int = 0
    #: Bytes those runs kept (not sent again).
    bytes_kept: int = 0
    #: Bytes dropped on adoption: an input's partial rows, partitions an
    #: unpack had begun to read.
    bytes_dropped: int = 0
    #: Output partitions a recovering run took over from a lost worker.
    partitions_taken: int = 0
    #: Bytes sent (and stored locally) by recovering runs: sent again.
    bytes_resent: int = 0
    #: Input partitions a recovering run split, and those it had nothing
    #: to send for.
    inputs_split: int = 0
    inputs_skipped: int = 0

    PREFIX = "recovery_"


statistics = RecoveryStatistics()


# -- scheduler half ------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """What a recovering run is told: where each partition goes, which
    outputs exist already, and which partitions moved."""

    worker_for: dict[int, str]
    done: frozenset[int]
    moved: tuple[int, ...]
    lost: tuple[str, ...]


def stable_assignment(
    previous: Mapping[int, str], alive: Iterable[str], partitions: Iterable[int]
) -> tuple[dict[int, str], list[int]] | None:
    """Keep every partition on its previous worker where it is alive; spread
    the others over those survivors, fewest partitions first (ties in address
    order, so every caller gets the same answer).  ``None``: no survivor."""
    alive = set(alive)
    survivors = sorted({w for w in previous.values() if w in alive})
    if not survivors:
        return None
    load = Counter({w: 0 for w in survivors})
    worker_for: dict[int, str] = {}
    moved: list[int] = []
    for partition in partitions:
        worker = previous.get(partition)
        if worker in alive:
            worker_for[partition] = worker
            load[worker] += 1
        else:
            moved.append(partition)
    order = {w: i for i, w in enumerate(survivors)}
    for partition in moved:
        worker = min(survivors, key=lambda w: (load[w], order[w]))
        worker_for[partition] = worker
        load[worker] += 1
    return worker_for, moved


@dataclass(frozen=True)
class Recovered:
    """One recovery as the scheduler planned it (the dashboard's table)."""

    time: float
    shuffle_id: str
    lost: tuple[str, ...]
    #: Output partitions moved from lost workers, outputs already built and
    #: kept, and the workers that took part in the new run.
    moved: int
    built: int
    survivors: int


#: The recoveries planned in this process (on the scheduler), newest last;
#: a join's, once (its first side's).
history: deque[Recovered] = deque(maxlen=1000)


def plan_run(
    shuffle_id: str,
    partitions: Iterable[int],
    previous: Mapping[int, str] | None,
    alive: Iterable[str],
    built: Iterable[int],
) -> RunPlan | None:
    """The plan of a run that follows ``previous`` (its ``worker_for``), or
    ``None`` where there is nothing to recover (no previous run, no survivor)."""
    if previous is None:
        return None
    alive = set(alive)
    assignment = stable_assignment(previous, alive, partitions)
    if assignment is None:
        return None
    worker_for, moved = assignment
    lost = tuple(sorted({w for w in previous.values() if w not in alive}))
    plan = RunPlan(worker_for=worker_for, done=frozenset(built), moved=tuple(moved), lost=lost)
    survivors = len(set(worker_for.values()))
    logger.info(
        "gpushuffle %s recovers: lost %s; %d output partitions moved to %d survivors, "
        "%d outputs already built kept",
        shuffle_id,
        ", ".join(lost) or "no worker",
        len(moved),
        survivors,
        len(plan.done),
    )
    return plan


def next_run(spec: Any, worker_for: dict[int, str]) -> tuple[Any, dict[int, str]]:
    """The spec and mapping of a new run of ``spec``'s shuffle, on the
    scheduler (``create_new_run``): a run after a loss keeps partitions on
    their survivors, names the outputs already built and counts its
    generation; any other run, both as given."""
    from gpushuffle.engine.graph import output_partition_of

    previous = previous_run(spec.id, output_partition_of)
    if previous is None:
        return spec, worker_for
    plan = plan_run(
        spec.id, spec.output_partitions, previous.worker_for, previous.alive, previous.built
    )
    if plan is None:
        return spec, worker_for
    # A join's second side takes the mapping distributed aligned with the
    # first side's (already recovering, and recorded): adopting stores drop
    # what moved away from their worker.
    if not previous.aligned:
        worker_for = plan.worker_for
        survivors = len(set(worker_for.values()))
        record = Recovered(
            time.time(), spec.id, plan.lost, len(plan.moved), len(plan.done), survivors
        )
        history.append(record)
    generation = previous.spec.generation + 1
    return dataclasses.replace(spec, generation=generation, done=plan.done), worker_for


# -- worker half: what a failed run leaves -------------------------------------


@dataclass
class Holding:
    """The store of a run failed by a peer's loss, waiting for the next run."""

    run_id: int
    store: ShardStore
    #: The old run's buckets: output partition -> bucket.
    bucket_of: dict[int, int]
    timer: asyncio.TimerHandle | None = None


@dataclass
class Holdings:
    """Stores handed over by failed runs, by (worker address, shuffle id).

    One per process: a test cluster runs several workers in one.  A holding
    no run adopts within ``hold_s`` is closed (the shuffle was given up).
    """

    held: dict[tuple[str, str], Holding] = field(default_factory=dict)

    def hand_over(
        self, address: str, shuffle_id: str, holding: Holding, loop: Any, hold_s: float
    ) -> None:
        key = (address, shuffle_id)
        older = self.held.pop(key, None)
        if older is not None:
            _close(older)
        self.held[key] = holding
        holding.timer = loop.call_later(hold_s, self._expire, key, holding)

    def take(self, address: str, shuffle_id: str) -> Holding | None:
        holding = self.held.pop((address, shuffle_id), None)
        if holding is not None and holding.timer is not None:
            holding.timer.cancel()
        return holding

    def close_all(self, address: str) -> None:
        for key in [k for k in self.held if k[0] == address]:
            _close(self.held.pop(key))

    def _expire(self, key: tuple[str, str], holding: Holding) -> None:
        if self.held.get(key) is holding:
            del self.held[key]
            logger.info("gpushuffle %s on %s: no run took what it held; released", key[1], key[0])
            _close(holding)


class ReleaseOnClose(WorkerPlugin):
    """Closes what the runs of a worker kept when the worker closes (a
    worker retired during a recovery: nothing stays in the process)."""

    name = "gpushuffle-kept"

    def teardown(self, worker: Any) -> None:
        holdings.close_all(worker.address)


def release_on_close(worker: Any) -> None:
    """Make sure ``worker`` releases what its runs kept as it closes."""
    worker.plugins.setdefault(ReleaseOnClose.name, ReleaseOnClose())


def _close(holding: Holding) -> None:
    if holding.timer is not None:
        holding.timer.cancel()
    holding.store.close()


holdings = Holdings()


# -- worker half: buckets --------------------------------------------------------


@dataclass(frozen=True)
class Buckets:
    """A receiver's output partitions by bucket, and the inputs each bucket
    holds whole (every chunk of the input's shard for it)."""

    partitions: dict[int, np.ndarray]
    complete: dict[int, frozenset[int]]

    def as_message(self) -> dict[str, Any]:
        return {
            "partitions": {b: p.tolist() for b, p in self.partitions.items()},
            "complete": {b: sorted(c) for b, c in self.complete.items()},
        }

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> Buckets:
        return cls(
            partitions={
                int(b): np.asarray(p, dtype=np.int64) for b, p in message["partitions"].items()
            },
            complete={int(b): frozenset(c) for b, c in message["complete"].items()},
        )

    def wants(self, input_partition: int) -> list[int]:
        """The buckets that lack ``input_partition``'s rows."""
        return [
            b
            for b, partitions in self.partitions.items()
            if len(partitions) and input_partition not in self.complete.get(b, ())
        ]


def fresh_buckets(partitions: Iterable[int]) -> Buckets:
    """A receiver that holds nothing: all its partitions in bucket 0."""
    return Buckets(
        partitions={0: np.asarray(sorted(partitions), dtype=np.int64)}, complete={0: frozenset()}
    )


async def adopt(
    holding: Holding | None,
    mine: Iterable[int],
    generation: int,
    owner: Any,
) -> tuple[Buckets, dict[int, int]]:
    """The buckets of a recovering run on this worker, which owns ``mine``.

    ``owner`` is the adopting run.  With a ``holding``, partitions it held
    (and whose pieces are all there) keep their bucket; the rest (taken
    over, or emptied by an old unpack) form bucket ``generation``, which
    holds nothing yet.  Returns the buckets
    and the new ``bucket_of``.
    """
    mine = set(mine)
    kept: dict[int, frozenset[int]] = {}
    bucket_of: dict[int, int] = {}
    if holding is not None:
        keep = {p for p in mine if p in holding.bucket_of}
        complete, emptied, kept_bytes, dropped = await holding.store.adopt(
            keep,
            holding.bucket_of,
            owner,
            owner.offload,
            f"gpushuffle {owner.id} on {owner.local_address}",
        )
        statistics.add(runs=1, bytes_kept=kept_bytes, bytes_dropped=dropped)
        for partition in keep - emptied:
            bucket_of[partition] = holding.bucket_of[partition]
        kept = {b: complete.get(b, frozenset()) for b in set(bucket_of.values())}
    taken = sorted(mine - bucket_of.keys())
    for partition in taken:
        bucket_of[partition] = generation
    if holding is not None:
        statistics.add(partitions_taken=len(taken))
    by_bucket: dict[int, list[int]] = {}
    for partition, bucket in sorted(bucket_of.items()):
        by_bucket.setdefault(bucket, []).append(partition)
    buckets = Buckets(
        partitions={b: np.asarray(p, dtype=np.int64) for b, p in by_bucket.items()},
        complete={b: kept.get(b, frozenset()) for b in by_bucket},
    )
    return buckets, bucket_of


class RunRecovery:
    """One run's part in partial recovery, on its worker.

    A run that follows a loss (``generation`` above 0) adopts what the run
    before it held here (:func:`adopt`, in the background: receiving and
    unpacking wait for it, :meth:`ready`), and its senders ask every
    receiver once what it holds (:meth:`plan_sends`) and split each input
    for the buckets that lack it (:meth:`layout_for`).  A run failed by a
    peer's loss, after the scheduler said to keep it (``KEEP_RUN``:
    :attr:`keep_on_fail`), hands its store over to the next run
    (:meth:`hand_over`) instead of deleting it.
    """

    def __init__(self, run: Any, mine: list[int], holding: Holding | None) -> None:
        self.run = run
        self.generation: int = run.spec.generation
        self.buckets = fresh_buckets(mine)
        self.bucket_of = dict.fromkeys(mine, 0)
        self.send_plan: SendPlan | None = None
        self._planning = asyncio.Lock()
        self.keep_on_fail = False
        self.handed_over = False
        self.adoption: asyncio.Future[None] | None = None
        #: What this run adopts: until it has, the store is as that left it.
        self._holding = holding
        if self.generation:
            self.adoption = asyncio.ensure_future(self._adopt(holding, mine))

    @staticmethod
    def holding_for(address: str, spec: Any, run_id: int) -> Holding | None:
        """What the run before ``run_id`` of ``spec``'s shuffle left on this
        worker for it, if it follows a loss."""
        if not spec.generation:
            return None
        holding = holdings.take(address, spec.id)
        if holding is not None and holding.run_id >= run_id:
            holding.store.close()  # pragma: no cover - a newer run's: never handed back
            holding = None
        return holding

    async def _adopt(self, holding: Holding | None, mine: list[int]) -> None:
        self.buckets, self.bucket_of = await adopt(holding, mine, self.generation, owner=self.run)
        self.run.received.update(self.run.store.receipt_keys())

    @property
    def adopting(self) -> bool:
        return self.adoption is not None and not self.adoption.done()

    async def ready(self) -> None:
        """Wait until this run's buckets are known."""
        if self.adoption is not None:
            await self.adoption

    async def plan_sends(
        self, receivers: list[str], ask: Callable[[str], Awaitable[dict[str, Any]]]
    ) -> None:
        """Ask each of ``receivers`` what it holds (``ask``, this worker's own
        buckets aside), once per run."""
        async with self._planning:
            if self.send_plan is not None:
                return
            await self.ready()
            here = self.run.local_address
            peers = [a for a in receivers if a != here]
            answers = await asyncio.gather(*(ask(a) for a in peers))
            buckets = {a: Buckets.from_message(m) for a, m in zip(peers, answers, strict=True)}
            if here in receivers:
                buckets[here] = self.buckets
            self.send_plan = SendPlan(self.run.spec.npartitions, buckets)

    def layout_for(self, input_partition: int, base: Layout) -> Layout:
        """Where ``input_partition``'s rows go: ``base`` unless recovering."""
        if self.send_plan is None:
            return base
        found = self.send_plan.for_input(input_partition)
        statistics.add(inputs_split=bool(found.groups), inputs_skipped=not found.groups)
        return found

    def sent(self, nbytes: int) -> None:
        if self.generation:
            statistics.add(bytes_resent=nbytes)

    def hand_over(self, store: ShardStore, worker: Any, hold_s: float) -> bool:
        """The run failed by a peer's loss, told to keep: ``store`` waits for
        the next run here (closed if none takes it within ``hold_s``), with
        the buckets that describe what it holds.  False where nothing can be
        kept (an adoption that failed left the store in doubt)."""
        bucket_of = self.bucket_of
        if self.adoption is not None and not self.adoption.done():
            # Not adopted yet (its adoption waits for the store's lock): the
            # store is still as the run before left it, and so are its
            # buckets; this run's own (all in bucket 0 until adopted) would
            # have the next run believe partitions taken over here hold
            # inputs they never received.  The adoption must not go on.
            self.adoption.cancel()
            if self._holding is not None:
                bucket_of = self._holding.bucket_of
        elif self.adoption is not None and (
            self.adoption.cancelled() or self.adoption.exception() is not None
        ):
            return False
        self.handed_over = True
        store.hand_over(None)
        release_on_close(worker)
        holdings.hand_over(
            self.run.local_address,
            self.run.id,
            Holding(run_id=self.run.run_id, store=store, bucket_of=bucket_of),
            asyncio.get_running_loop(),
            hold_s,
        )
        return True

    def cancel(self) -> None:
        if self.adoption is not None and not self.adoption.done():
            self.adoption.cancel()


# -- sender side -------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where an input's rows go: ranks of output partitions, grouped by
    (receiver, bucket).  ``rank[p] == nranks``: nobody wants ``p``'s rows."""

    rank: np.ndarray
    nranks: int
    #: (address, bucket, partitions, (first rank, last rank)) per group.
    groups: tuple[tuple[str, int, np.ndarray, tuple[int, int]], ...]


def layout(npartitions: int, groups: Iterable[tuple[str, int, np.ndarray]]) -> Layout:
    """Ranks for ``groups`` in the order given (receivers, then buckets)."""
    groups = list(groups)
    nranks = sum(len(p) for _, _, p in groups)
    dtype = np.int16 if nranks < np.iinfo(np.int16).max else np.int32
    rank = np.full(npartitions, nranks, dtype=dtype)
    out = []
    start = 0
    for address, bucket, partitions in groups:
        stop = start + len(partitions)
        rank[partitions] = np.arange(start, stop, dtype=dtype)
        out.append((address, bucket, partitions, (start, stop)))
        start = stop
    return Layout(rank=rank, nranks=nranks, groups=tuple(out))


class SendPlan:
    """A recovering run's layouts: one per set of (receiver, bucket) groups
    an input must go to, built once and shared by the inputs that need it."""

    def __init__(self, npartitions: int, buckets: Mapping[str, Buckets]) -> None:
        self.npartitions = npartitions
        self.buckets = dict(sorted(buckets.items()))
        self._layouts: dict[tuple[tuple[str, int], ...], Layout] = {}

    def for_input(self, input_partition: int) -> Layout:
        wanted = tuple(
            (address, b)
            for address, buckets in self.buckets.items()
            for b in sorted(buckets.wants(input_partition))
        )
        found = self._layouts.get(wanted)
        if found is None:
            found = self._layouts[wanted] = layout(
                self.npartitions,
                ((a, b, self.buckets[a].partitions[b]) for a, b in wanted),
            )
        return found
