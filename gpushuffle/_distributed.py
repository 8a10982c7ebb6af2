"""The one place that imports private modules of ``distributed``, ``dask`` and ``pandas``.

gpushuffle builds on distributed's P2P shuffle core (run ids, the barrier,
restarts on worker loss, output-worker restrictions) and hooks into dask-expr's
shuffle lowering.  Neither is public API, so every such import lives here: a
distributed or dask upgrade that moves them touches this file only.

Checked against dask and distributed 2026.7.1 and 2026.8.0, whose
``distributed/shuffle/`` and ``dask_expr/_shuffle.py`` are identical.  The join
hook also uses
``dask_expr/_merge.py`` (``Merge._lower``, ``HashJoinP2P``, ``BroadcastJoin``)
and ``dask/dataframe/multi.py`` (``merge_chunk``), also identical in both.
pandas' ``combine_hash_arrays`` is how ``hash_pandas_object`` combines the
hashes of a frame's columns (unchanged from pandas 1.x to 3.1), which
:mod:`gpushuffle.engine.partitioning` needs to give dask's partition ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from dask._task_spec import Alias, Task, TaskRef
from dask._task_spec import _execute_subgraph as execute_subgraph
from dask.dataframe.dask_expr._expr import Assign, Blockwise, Fused
from dask.dataframe.dask_expr._merge import (
    BlockwiseMerge,
    BroadcastJoin,
    HashJoinP2P,
    Merge,
)
from dask.dataframe.dask_expr._shuffle import (
    AssignPartitioningIndex,
    RearrangeByColumn,
    Shuffle,
    SimpleShuffle,
    _contains_index_name,
    _is_column_label_reference,
    _is_numeric_cast_type,
    _select_columns_or_index,
)
from dask.dataframe.dask_expr.io.io import FromGraph
from dask.dataframe.multi import merge_chunk
from dask.dataframe.shuffle import partitioning_index
from dask.tokenize import _tokenize_deterministic
from dask.utils import get_default_shuffle_method
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import Scheduler
from distributed.shuffle._core import (
    P2PBarrierTask,
    SchedulerShuffleState,
    ShuffleId,
    ShuffleRun,
    ShuffleSpec,
    barrier_key,
    get_worker_plugin,
    id_from_key,
)
from distributed.shuffle._exceptions import (
    P2PConsistencyError,
    P2POutOfDiskError,
    ShuffleClosedError,
)
from distributed.shuffle._limiter import ResourceLimiter
from distributed.shuffle._scheduler_plugin import ShuffleSchedulerPlugin
from distributed.shuffle._worker_plugin import ShuffleWorkerPlugin
from pandas.core.util.hashing import combine_hash_arrays  # type: ignore[attr-defined]
from pandas.util import hash_array

logger = logging.getLogger(__name__)


def known_run(
    plugin: ShuffleWorkerPlugin, shuffle_id: ShuffleId, run_id: int | None = None
) -> ShuffleRun | None:
    """The worker's active run of ``shuffle_id``, looked up in the task's thread.

    distributed's task-side lookups (``get_or_create_shuffle``,
    ``get_shuffle_run``) each make a round trip to the worker's event loop,
    which with thousands of small tasks costs as much as the task's work.
    When the run is already known (every task but a worker's first of a run)
    this returns it; ``None`` means "ask distributed": no run yet, another
    ``run_id`` (stale or newer: distributed decides), a closed manager, or a
    failed run (distributed raises its error).  A run that closes after this
    returns raises on use, as it would after distributed's lookup.
    """
    runs = plugin.shuffle_runs
    run = runs._active_runs.get(shuffle_id)
    if run is None or runs.closed or run._exception is not None:
        return None
    if run_id is not None and run.run_id != run_id:
        return None
    return run


def only_worker_in_process() -> Any | None:
    """The one live distributed ``Worker`` of this process, else None (none,
    or several: a ``LocalCluster(processes=False)``).

    ``distributed.get_worker()`` answers only in a task's thread; a worker's
    memory limit is also needed on its event loop (a shard received before
    the worker ran any task of the shuffle makes the host pool there).
    """
    from distributed import Worker
    from distributed.core import Status

    gone = {Status.closing, Status.closed, Status.failed}
    live = [w for w in list(getattr(Worker, "_instances", ())) if w.status not in gone]
    return live[0] if len(live) == 1 else None


def prepare_schedulers(shuffle_id: ShuffleId) -> list[Scheduler]:
    """Give the schedulers in this process what gpushuffle's runs ask of them
    (handlers, :class:`ReleaseFailedRuns`, :class:`OpsKnown`, the shuffle
    plugin made a :class:`PartialRestartPlugin`), before any
    worker creates a run of ``shuffle_id``: called by
    ``ShuffleSpec.create_new_run`` on the scheduler's event loop.  Returns the
    one that holds the shuffle's barrier (the one running this), if found."""
    # None where distributed's Scheduler no longer keeps its instances (the
    # output tasks are not pinned then either: pin_output_tasks).
    schedulers = list(getattr(Scheduler, "_instances", ()))
    for scheduler in schedulers:
        scheduler.handlers.setdefault(RESTRICT_OUTPUT_TASK, _restrict_handler(scheduler))
        ops_known(scheduler)
        _added(scheduler, ReleaseFailedRuns).shuffles.add(shuffle_id)
    key = barrier_key(shuffle_id)
    holding = [scheduler for scheduler in schedulers if key in scheduler.tasks]
    for scheduler in holding:
        install_partial_restarts(scheduler)
    return holding


def add_dashboard_page(scheduler: Scheduler, route: str, make_doc: Callable[..., None]) -> bool:
    """Serve ``make_doc(scheduler, extra, doc)`` at ``route`` of the
    scheduler's dashboard, as distributed serves its own pages; False where
    there is no dashboard (it is off, or bokeh is missing)."""
    http = getattr(scheduler, "http_application", None)
    bokeh_apps = [a for a in getattr(http, "applications", ()) if hasattr(a, "prefix")]
    if http is None or not bokeh_apps:
        return False
    from distributed.dashboard.core import BokehApplication
    from tornado.ioloop import IOLoop

    app = BokehApplication({route: make_doc}, scheduler, prefix=bokeh_apps[0].prefix)
    http.add_application(app)
    app.initialize(IOLoop.current())
    # As distributed's own pages: without it bokeh never expires a session
    # (each view's periodic refresh would run for good).
    app.start()
    return True


def pin_output_tasks(
    shuffle_id: ShuffleId, worker_for: dict[int, str], partition_of: Callable[[Any], int | None]
) -> int:
    """Restrict a new run's output tasks to their workers on the scheduler; how many.

    distributed leaves output tasks unrestricted until each first runs: one
    on the wrong worker asks the scheduler to restrict it, raises
    ``Reschedule`` and runs again (``ShuffleRun._ensure_output_worker``),
    since with task fusion it cannot tell which output a task computes.
    gpushuffle's output tasks say it (``partition_of`` reads it from their
    run spec), so they are pinned as the run is created, through the
    scheduler plugin's ``_set_restriction``, which records the original
    restrictions for its ``_unset_restriction`` when the run ends or
    restarts.  With two workers, half the output tasks ran twice and made
    a round trip to the scheduler; with many small partitions that was a
    sixth of all tasks run.  Tasks it cannot read keep distributed's way.

    Runs on the scheduler's event loop (``ShuffleSpec.create_new_run``, called
    by the plugin's ``_create``), which is not handed the scheduler: it is
    the one in this process that holds the run's barrier and knows all of
    its workers.
    """
    key = barrier_key(shuffle_id)
    workers = set(worker_for.values())
    pinned = 0
    try:
        for scheduler in list(Scheduler._instances):
            barrier = scheduler.tasks.get(key)
            plugin = scheduler.plugins.get("shuffle")
            if barrier is None or plugin is None or not workers <= scheduler.workers.keys():
                continue
            for ts in barrier.dependents:
                partition = partition_of(ts.run_spec)
                worker = worker_for.get(partition) if partition is not None else None
                if worker is not None:
                    plugin._set_restriction(ts, worker)  # type: ignore[attr-defined]
                    pinned += 1
            break
    except Exception:
        # Pinning is an optimisation over private scheduler state: if a
        # distributed upgrade changes it, the run must still start, with the
        # tasks left to distributed's own first-run restriction.
        logger.warning(
            "gpushuffle could not pin the output tasks of shuffle %s (%d pinned); "
            "they fall back to distributed's reschedule on first run",
            shuffle_id,
            pinned,
            exc_info=True,
        )
    return pinned


#: The scheduler handler a run asks to send an output task to its worker.
RESTRICT_OUTPUT_TASK = "gpushuffle_restrict_output_task"


def _restrict_handler(scheduler: Scheduler) -> Callable[..., dict[str, Any]]:
    """The :data:`RESTRICT_OUTPUT_TASK` handler of ``scheduler`` (a named
    function: distributed's handlers are named after their ``__name__``)."""

    def gpushuffle_restrict_output_task(
        id: ShuffleId, run_id: int, key: Any, worker: str
    ) -> dict[str, Any]:
        return _restrict_output_task(scheduler, id, run_id, key, worker)

    return gpushuffle_restrict_output_task


def _restrict_output_task(
    scheduler: Scheduler, id: ShuffleId, run_id: int, key: Any, worker: str
) -> dict[str, Any]:
    """distributed's ``shuffle_restrict_task``, for tasks gpushuffle pinned.

    The scheduler plugin's ``_set_restriction`` does nothing to a task whose
    original restrictions it has recorded (every task :func:`pin_output_tasks`
    pinned), so a task restricted elsewhere since (by the user, or another
    plugin) would be sent back to that worker, raise ``Reschedule`` there and
    come back, forever.  This restricts it to its worker either way; the
    original restrictions recorded at the pin are still restored when the run
    ends.
    """
    result: dict[str, Any] = scheduler.plugins["shuffle"].restrict_task(  # type: ignore[attr-defined]
        id=id, run_id=run_id, key=key, worker=worker
    )
    if result["status"] == "OK":
        scheduler.set_restrictions({key: {worker}})
    return result


#: The worker stream op that tells a failed run to release what it holds.
RELEASE_FAILED_RUN = "gpushuffle-release-failed"
#: The scheduler handler a worker calls once it knows gpushuffle's worker
#: stream ops (as it creates a run: ``GPUShuffleRun``).
OPS_KNOWN = "gpushuffle_ops_known"


class OpsKnown(SchedulerPlugin):
    """The workers that know gpushuffle's worker stream ops, and the way to
    send them one.

    A worker learns them as it creates a gpushuffle run, and then says so
    (:data:`OPS_KNOWN`).  An op a worker does not know breaks its stream
    with the scheduler (``handle_stream``'s ``KeyError``), which cuts it
    off: a shuffle failed or cancelled before a participating worker created
    its run would do that.  Such a worker holds nothing of gpushuffle's for
    the op to act on, so it is left out.  The worker says it by a call, not
    on its stream: a scheduler without the handler (gpushuffle could not
    reach it: no ``Scheduler._instances``) answers that call with an error,
    where an unknown stream op would cut the worker off.
    """

    name = "gpushuffle-ops-known"

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.workers: set[str] = set()
        scheduler.handlers.setdefault(OPS_KNOWN, self._known)

    def _known(self, worker: str) -> None:
        if worker in self.scheduler.workers:
            self.workers.add(worker)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        self.workers.discard(worker)

    def send(self, workers: Iterable[str], message: dict[str, Any]) -> None:
        """Send ``message`` to those of ``workers`` that know its op."""
        known = self.workers.intersection(workers) & self.scheduler.workers.keys()
        if known:
            self.scheduler.send_all({}, {worker: [dict(message)] for worker in known})


_Plugin = TypeVar("_Plugin", "OpsKnown", "ReleaseFailedRuns")


def _added(scheduler: Scheduler, kind: type[_Plugin]) -> _Plugin:
    """``scheduler``'s plugin of ``kind``, added on first use."""
    plugin = scheduler.plugins.get(kind.name)
    if not isinstance(plugin, kind):
        plugin = kind(scheduler)
        scheduler.add_plugin(plugin, name=kind.name)
    return plugin


def ops_known(scheduler: Scheduler) -> OpsKnown:
    """``scheduler``'s :class:`OpsKnown`."""
    return _added(scheduler, OpsKnown)


class ReleaseFailedRuns(SchedulerPlugin):
    """Tell a failed gpushuffle run's workers to release its shards at once.

    When a shuffle's barrier errs (a transfer failed, or a receiver), the
    shuffle scheduler plugin keeps the shuffle, and the workers their runs,
    until the erred tasks are forgotten (``ShuffleSchedulerPlugin.transition``
    returns early for a root cause at the barrier): with ``p2p`` too, every
    received shard stays in the workers' memory and spill files for as long
    as the user holds the failed future, or its exception's traceback (a
    notebook's ``Out``, ``sys.last_value``).  This sends
    :data:`RELEASE_FAILED_RUN` to the run's workers as the barrier errs; the
    run (``GPUShuffleRun.release_failed``) frees its store and keeps the
    error, and distributed still closes it later, as before.
    """

    name = "gpushuffle-release-failed"

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        #: gpushuffle's shuffles (p2p's are left as distributed has them).
        self.shuffles: set[ShuffleId] = set()

    def transition(
        self, key: Any, start: str, finish: str, *args: Any, stimulus_id: str, **kwargs: Any
    ) -> None:
        shuffle_id = id_from_key(key)
        if shuffle_id is None or shuffle_id not in self.shuffles:
            return
        if finish == "forgotten":
            self.shuffles.discard(shuffle_id)
            return
        if finish != "erred":
            return
        shuffle = self.scheduler.plugins["shuffle"].active_shuffles.get(shuffle_id)  # type: ignore[attr-defined]
        if shuffle is None:
            return
        message = {"op": RELEASE_FAILED_RUN, "shuffle_id": shuffle_id, "run_id": shuffle.run_id}
        ops_known(self.scheduler).send(shuffle.participating_workers, message)


#: The worker stream op that tells a run to hand its store over when it
#: fails (a peer left; partial recovery, :mod:`gpushuffle.engine.recovery`).
KEEP_RUN = "gpushuffle-keep-run"
#: The worker stream op that releases what runs of a shuffle kept for a
#: next run that will not come (the shuffle erred or was forgotten).
DROP_KEPT = "gpushuffle-drop-kept"
#: The scheduler handler a run asks to run again for an output it left out.
RESTART_FOR_OUTPUT = "gpushuffle_restart_for_output"
#: The worker handler a recovering run's senders ask for its buckets.
HELD = "gpushuffle_held"


def _partial(barrier: Any) -> bool:
    """Whether the shuffle of ``barrier`` (a TaskState) recovers partially."""
    spec = getattr(barrier.run_spec, "spec", None)
    return bool(getattr(spec, "partial_recovery", False))


class PartialRestartPlugin(ShuffleSchedulerPlugin):
    """distributed's shuffle scheduler plugin, with what partial recovery
    changes in its restart of a shuffle whose worker left
    (:mod:`gpushuffle.engine.recovery`), for gpushuffle's shuffles with
    ``gpushuffle.recovery: partial`` only:

    - before a run is failed because a participant left, the survivors are
      told to keep what their run holds (:data:`KEEP_RUN`);
    - the restart does not release outputs already in memory.

    For every shuffle on the scheduler, ``p2p``'s included, the barrier gives
    up as soon as a participant leaves (:meth:`barrier`).

    Installed on the scheduler's plugin as the first gpushuffle run is
    created (:func:`install_partial_restarts`): the instance keeps its
    state, only its class changes.
    """

    def _restart_recommendations(self, id: ShuffleId) -> dict:
        recs = super()._restart_recommendations(id)
        barrier = self.scheduler.tasks[barrier_key(id)]
        if not _partial(barrier):
            return recs
        if not recs:
            # No restart (an output erred: KilledWorker): no run will follow.
            self._drop_kept(id)
        for dependent in barrier.dependents:
            if dependent.state == "memory" and dependent.who_has:
                recs.pop(dependent.key, None)
        return recs

    def _recovers(self, shuffle_id: ShuffleId) -> bool:
        """Whether ``shuffle_id`` is a gpushuffle shuffle that recovers
        partially (only its workers know gpushuffle's stream ops: another
        op breaks a worker's stream with the scheduler)."""
        return any(
            getattr(run.run_spec.spec, "partial_recovery", False)
            for run in self._shuffles.get(shuffle_id, ())
        )

    def _drop_kept(self, shuffle_id: ShuffleId) -> None:
        """Tell the workers that ran ``shuffle_id`` to release what they kept
        for its next run (:data:`DROP_KEPT`)."""
        ran = set().union(
            *(run.participating_workers for run in self._shuffles.get(shuffle_id, ()))
        )
        ops_known(self.scheduler).send(ran, {"op": DROP_KEPT, "shuffle_id": shuffle_id})

    async def barrier(self, id: ShuffleId, run_id: int, consistent: bool) -> None:
        """distributed's barrier, given up as soon as one of the run's
        workers leaves.

        distributed retries a broadcast that failed with an ``OSError`` and
        checks whether the worker left only when the retry returns; a retry
        to a worker that has since died connects to its address until
        ``distributed.comm.timeouts.connect`` (30 s), and the shuffle, ``p2p``
        alike, waits that long for the restart its loss already started.
        """
        shuffle = self.active_shuffles.get(id)
        if shuffle is None or shuffle.run_id != run_id:
            return await super().barrier(id, run_id, consistent)
        participants = frozenset(shuffle.participating_workers)
        left = asyncio.Event()
        if not participants <= self.scheduler.workers.keys():
            left.set()
        watches = self._barrier_watches()
        watch = (participants, left)
        watches.append(watch)
        broadcast = asyncio.ensure_future(super().barrier(id, run_id, consistent))
        gone = asyncio.ensure_future(left.wait())
        try:
            await asyncio.wait({broadcast, gone}, return_when=asyncio.FIRST_COMPLETED)
            if broadcast.done():
                return broadcast.result()
        finally:
            watches.remove(watch)
            broadcast.cancel()
            gone.cancel()
        lost = sorted(participants - self.scheduler.workers.keys())
        raise RuntimeError(f"Worker {lost} left during shuffle {shuffle}")

    def _barrier_watches(self) -> list[tuple[frozenset[str], asyncio.Event]]:
        """The barriers in progress: each one's workers, and the event set
        when one of them leaves.  (The instance was distributed's plugin,
        made this class: no ``__init__`` of ours ran.)"""
        return self.__dict__.setdefault("_gpushuffle_barrier_watches", [])

    def remove_worker(
        self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any
    ) -> None:
        for participants, left in self._barrier_watches():
            if worker in participants:
                left.set()
        for shuffle in list(self.active_shuffles.values()):
            self._keep_if_a_worker_left(shuffle)
        super().remove_worker(scheduler, worker, stimulus_id=stimulus_id, **kwargs)

    def transition(
        self, key: Any, start: Any, finish: Any, *args: Any, stimulus_id: str, **kwargs: Any
    ) -> None:
        shuffle_id = id_from_key(key)
        if shuffle_id and finish == "released":
            # A barrier released while its worker is removed fails the run
            # here, before remove_worker is called.
            if (shuffle := self.active_shuffles.get(shuffle_id)) is not None:
                self._keep_if_a_worker_left(shuffle)
        elif shuffle_id and finish in ("erred", "forgotten") and self._recovers(shuffle_id):
            # No run will follow: what survivors kept for one goes now.
            self._drop_kept(shuffle_id)
        super().transition(key, start, finish, *args, stimulus_id=stimulus_id, **kwargs)

    def _keep_if_a_worker_left(self, shuffle: SchedulerShuffleState) -> None:
        if not shuffle.participating_workers <= self.scheduler.workers.keys():
            self._keep(shuffle)

    def _keep(self, shuffle: SchedulerShuffleState) -> None:
        """Have the run's live workers keep their stores of ``shuffle``'s run
        for the next run, as it fails (partial recovery only)."""
        barrier = self.scheduler.tasks.get(barrier_key(shuffle.id))
        if barrier is None or not _partial(barrier):
            return
        message = {"op": KEEP_RUN, "shuffle_id": shuffle.id, "run_id": shuffle.run_id}
        # OpsKnown.send leaves out the workers the scheduler no longer has.
        ops_known(self.scheduler).send(shuffle.participating_workers, message)

    def restart_for_output(self, id: ShuffleId, run_id: int, partition: int) -> None:
        """Run ``id`` again: output ``partition`` is needed again but run
        ``run_id`` no longer holds its rows (built before a worker left and
        so left out of the run, or read already: ``GPUShuffleRun.
        raise_if_read``).  The next run leaves it in; under partial recovery
        the workers keep what they hold for it (the same stream as the
        failure, so the keep arrives first)."""
        shuffle = self.active_shuffles.get(id)
        if shuffle is None or shuffle.run_id != run_id:
            return  # already restarted
        self._keep(shuffle)
        stimulus_id = f"gpushuffle-output-{partition}-needed-again-{time.time()}"
        self._fail_on_workers(shuffle, f"output {partition} of {shuffle} is needed again")
        self._clean_on_scheduler(id, stimulus_id)
        self._restart_shuffle(id, self.scheduler, stimulus_id=stimulus_id)


def install_partial_restarts(scheduler: Scheduler) -> None:
    """Make ``scheduler``'s shuffle plugin a :class:`PartialRestartPlugin`,
    with its :data:`RESTART_FOR_OUTPUT` handler and its barrier."""
    plugin = scheduler.plugins.get("shuffle")
    if type(plugin) is ShuffleSchedulerPlugin:
        plugin.__class__ = PartialRestartPlugin
    if isinstance(plugin, PartialRestartPlugin):
        scheduler.handlers.setdefault(RESTART_FOR_OUTPUT, _restart_for_output_handler(plugin))
        # distributed registered its own bound barrier as the handler.
        scheduler.handlers["shuffle_barrier"] = plugin.barrier


def _restart_for_output_handler(plugin: PartialRestartPlugin) -> Callable[..., dict[str, str]]:
    def gpushuffle_restart_for_output(id: ShuffleId, run_id: int, partition: int) -> dict[str, str]:
        plugin.restart_for_output(id, run_id, partition)
        return {"status": "OK"}  # not None: what a worker gets where there is no handler

    return gpushuffle_restart_for_output


@dataclass(frozen=True)
class PreviousRun:
    """What the scheduler knows, as a shuffle's new run is created, of the run before."""

    worker_for: dict[int, str] | None
    #: The spec of the run before (its ``generation`` among others).
    spec: Any
    alive: frozenset[str]
    #: Output partitions whose tasks are in memory (built and kept).
    built: frozenset[int]
    #: Whether the shuffle shares its output tasks with another active one
    #: (a join's other side): distributed then aligned the new run's
    #: mapping with that one's, which must stand.
    aligned: bool = False


def previous_run(
    shuffle_id: ShuffleId, partition_of: Callable[[Any], int | None]
) -> PreviousRun | None:
    """The run before ``shuffle_id``'s new one, on the scheduler in this process
    that holds the barrier (None where there is none, or no such scheduler)."""
    key = barrier_key(shuffle_id)
    # Tests stand a scheduler class without instances in (as for pins).
    for scheduler in list(getattr(Scheduler, "_instances", ())):
        barrier = scheduler.tasks.get(key)
        plugin = scheduler.plugins.get("shuffle")
        if barrier is None or not isinstance(plugin, ShuffleSchedulerPlugin):
            continue
        runs = plugin._shuffles.get(shuffle_id)
        if not runs:
            return None
        last = max(runs, key=lambda state: state.run_id)
        # Built: in memory, or released and not wanted (consumed by what
        # follows); one wanted again later makes its run restart
        # (RESTART_FOR_OUTPUT).
        built = set()
        for ts in barrier.dependents:
            if ts.state == "released" or (ts.state == "memory" and ts.who_has):
                partition = partition_of(ts.run_spec)
                if partition is not None:
                    built.add(partition)
        aligned = any(
            (other := id_from_key(dependency.key)) not in (None, shuffle_id)
            and other in plugin.active_shuffles
            for dependent in barrier.dependents
            for dependency in dependent.dependencies
        )
        return PreviousRun(
            aligned=aligned,
            worker_for=dict(last.run_spec.worker_for),
            spec=last.run_spec.spec,
            alive=frozenset(scheduler.workers),
            built=frozenset(built),
        )
    return None


__all__ = [
    "DROP_KEPT",
    "HELD",
    "KEEP_RUN",
    "OPS_KNOWN",
    "RELEASE_FAILED_RUN",
    "RESTART_FOR_OUTPUT",
    "RESTRICT_OUTPUT_TASK",
    "Alias",
    "Assign",
    "AssignPartitioningIndex",
    "Blockwise",
    "BlockwiseMerge",
    "BroadcastJoin",
    "FromGraph",
    "Fused",
    "HashJoinP2P",
    "Merge",
    "P2PBarrierTask",
    "P2PConsistencyError",
    "P2POutOfDiskError",
    "RearrangeByColumn",
    "ResourceLimiter",
    "Shuffle",
    "ShuffleClosedError",
    "ShuffleId",
    "ShuffleRun",
    "ShuffleSpec",
    "ShuffleWorkerPlugin",
    "SimpleShuffle",
    "Task",
    "TaskRef",
    "_contains_index_name",
    "_is_column_label_reference",
    "_is_numeric_cast_type",
    "_select_columns_or_index",
    "_tokenize_deterministic",
    "add_dashboard_page",
    "barrier_key",
    "combine_hash_arrays",
    "execute_subgraph",
    "get_default_shuffle_method",
    "get_worker_plugin",
    "hash_array",
    "known_run",
    "merge_chunk",
    "only_worker_in_process",
    "partitioning_index",
    "pin_output_tasks",
    "prepare_schedulers",
    "previous_run",
]
