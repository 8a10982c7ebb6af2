"""What the scheduler and peers ask of a worker's gpushuffle runs, beyond
distributed's own shuffle ops: release a failed run, keep a run's store for
the next run, drop what was kept, say what a recovering run holds.

Registered on every worker of a cluster from the first gpushuffle run on
(:class:`WorkerOps`, a worker plugin the scheduler hands to the workers it
has and to each that joins), and on a worker as it creates a run, whichever
comes first (:func:`install`); the worker then tells the scheduler so
(``_distributed.OpsKnown``): a stream op a worker does not know would cut it
off from the scheduler.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin
from distributed.protocol.pickle import dumps

from gpushuffle._distributed import (
    DROP_KEPT,
    HELD,
    KEEP_RUN,
    OPS_KNOWN,
    RELEASE_FAILED_RUN,
    ShuffleWorkerPlugin,
)
from gpushuffle.engine import recovery

if TYPE_CHECKING:
    from distributed import Scheduler, Worker

logger = logging.getLogger(__name__)


class WorkerOps(WorkerPlugin):
    """Gives a worker gpushuffle's handlers as the plugin reaches it, before
    it creates a run: a recovering run's senders ask every receiver what it
    holds (:data:`HELD`), one that got no shard of the run before yet
    included (distributed answers an op without a handler with None)."""

    name = "gpushuffle-ops"

    def setup(self, worker: Worker) -> None:
        plugin = worker.plugins.get("shuffle")
        if isinstance(plugin, ShuffleWorkerPlugin):
            install(worker, plugin)


#: Broadcasts of :class:`WorkerOps` under way (a task nothing else holds
#: could be collected before it ends).
_reaching: set[asyncio.Future[Any]] = set()


def reach_every_worker(scheduler: Scheduler) -> None:
    """Have every worker of ``scheduler``, and each that joins it later, set
    up :class:`WorkerOps` (once per scheduler; on its event loop).

    As ``Scheduler.register_worker_plugin`` does, but the plugin is
    recorded before this returns, so a worker that registers meanwhile gets
    it too; a worker that fails to set it up is logged, not an error of the
    run being created.
    """
    if WorkerOps.name in scheduler.worker_plugins:
        return
    plugin = dumps(WorkerOps())
    scheduler.worker_plugins[WorkerOps.name] = plugin
    message = {"op": "plugin-add", "plugin": plugin, "name": WorkerOps.name}
    broadcast = asyncio.ensure_future(scheduler.broadcast(msg=message, on_error="ignore"))
    _reaching.add(broadcast)
    broadcast.add_done_callback(_reached)


def _reached(broadcast: asyncio.Future[Any]) -> None:
    _reaching.discard(broadcast)
    if not broadcast.cancelled() and broadcast.exception() is not None:
        logger.warning(
            "gpushuffle's worker plugin reached not every worker: %r", broadcast.exception()
        )


def install(worker: Worker, plugin: ShuffleWorkerPlugin) -> None:
    """Give ``worker`` gpushuffle's handlers (once), then tell its scheduler."""
    worker.stream_handlers.setdefault(
        RELEASE_FAILED_RUN, functools.partial(_release_failed_run, plugin)
    )
    worker.stream_handlers.setdefault(KEEP_RUN, functools.partial(_keep_run, plugin))
    worker.stream_handlers.setdefault(DROP_KEPT, functools.partial(_drop_kept, worker.address))
    worker.handlers.setdefault(HELD, _held_handler(plugin))
    # In every heartbeat: the scheduler's dashboard page draws it
    # (gpushuffle.dashboard).  A new dict, not an item added: a heartbeat
    # under way iterates the old one across awaits, and a dict changed
    # during that fails the heartbeat, which closes the worker.
    if RECOVERY_METRIC not in worker.metrics:
        worker.metrics = {**worker.metrics, RECOVERY_METRIC: _recovery_counters}
    _say_ops_known(worker)


#: The worker metric (``Worker.metrics``) with the worker's recovery counters.
RECOVERY_METRIC = "gpushuffle-recovery"


def _recovery_counters(worker: Worker) -> dict[str, int]:
    return recovery.statistics.as_dict()


def _say_ops_known(worker: Worker) -> None:
    """Tell the scheduler this worker knows gpushuffle's stream ops (a call,
    after they are registered: ``_distributed.OpsKnown`` says why)."""

    async def say() -> None:
        try:
            await getattr(worker.scheduler, OPS_KNOWN)(worker=worker.address)
        except Exception as error:  # the scheduler has no handler, or is gone
            logger.debug(
                "%s could not tell the scheduler it knows gpushuffle's ops: %r",
                worker.address,
                error,
            )

    if getattr(worker, "scheduler", None) is not None:
        worker.loop.add_callback(say)


def _recovery_of(run: Any) -> recovery.RunRecovery | None:
    """``run``'s recovery if it is a gpushuffle run (not isinstance(run,
    GPUShuffleRun): engine.run imports this module)."""
    found = getattr(run, "recovery", None)
    return found if isinstance(found, recovery.RunRecovery) else None


def _active_run(plugin: ShuffleWorkerPlugin, shuffle_id: str, run_id: int) -> Any:
    """The worker's active gpushuffle run ``run_id`` of ``shuffle_id``, if any."""
    run = plugin.shuffle_runs._active_runs.get(shuffle_id)  # type: ignore[call-overload]
    return run if _recovery_of(run) is not None and run.run_id == run_id else None


def _release_failed_run(plugin: ShuffleWorkerPlugin, shuffle_id: str, run_id: int) -> None:
    """The :data:`~gpushuffle._distributed.RELEASE_FAILED_RUN` handler."""
    if (run := _active_run(plugin, shuffle_id, run_id)) is not None:
        run.release_failed()


def _keep_run(plugin: ShuffleWorkerPlugin, shuffle_id: str, run_id: int) -> None:
    """The :data:`~gpushuffle._distributed.KEEP_RUN` handler."""
    if (run := _active_run(plugin, shuffle_id, run_id)) is not None:
        run.recovery.keep_on_fail = True


def _drop_kept(address: str, shuffle_id: str) -> None:
    """The :data:`~gpushuffle._distributed.DROP_KEPT` handler."""
    holding = recovery.holdings.take(address, shuffle_id)
    if holding is not None:
        holding.store.close()


def _held_handler(plugin: ShuffleWorkerPlugin) -> Callable[..., Awaitable[dict[str, Any]]]:
    """The :data:`~gpushuffle._distributed.HELD` handler (a named function:
    distributed's comm handlers log their ``__name__``)."""

    async def gpushuffle_held(shuffle_id: str, run_id: int) -> dict[str, Any]:
        # This worker's buckets in run ``run_id``, once it knows them.
        run = await plugin.shuffle_runs.get_with_run_id(shuffle_id, run_id)  # type: ignore[arg-type]
        if (found := _recovery_of(run)) is None:
            raise TypeError(f"{run} is not a gpushuffle run")
        await found.ready()
        return found.buckets.as_message()

    return gpushuffle_held
