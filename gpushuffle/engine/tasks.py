"""The functions transfer and unpack tasks run on workers.

They find the run through distributed's worker plugin and translate
failures: restarts pass through untouched (distributed reschedules the task),
bad input surfaces as is, anything else names the shuffle, the partition and
the real cause.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Generator
from typing import Any

from distributed.exceptions import Reschedule
from distributed.worker import get_worker, thread_state

from gpushuffle._distributed import (
    P2PConsistencyError,
    P2POutOfDiskError,
    ShuffleClosedError,
    ShuffleId,
    ShuffleWorkerPlugin,
    get_worker_plugin,
    known_run,
)
from gpushuffle.errors import (
    ShuffleCodecError,
    ShuffleCommError,
    ShuffleDiskFullError,
    ShuffleInputError,
    ShuffleMemoryError,
    ShuffleOutputTooLargeError,
    ShuffleSchedulerError,
)


@contextlib.contextmanager
def _phase_errors(id: ShuffleId, phase: str, what: str) -> Generator[None]:
    """Errors of one phase as p2p words them ("P2P <id> failed during
    transfer phase", the real error chained), with what failed and why."""
    try:
        yield
    except Reschedule:
        raise
    except ShuffleClosedError:
        # The run was replaced (a worker left): distributed restarts it.
        raise Reschedule() from None
    except (
        P2PConsistencyError,
        P2POutOfDiskError,
        ShuffleInputError,
        ShuffleMemoryError,
        ShuffleDiskFullError,
        ShuffleCommError,
        ShuffleCodecError,
        ShuffleSchedulerError,
    ):
        raise
    except Exception as e:
        raise RuntimeError(
            f"P2P {id} failed during {phase} phase (gpushuffle, {what}): {type(e).__name__}: {e}"
        ) from e


def _worker_plugin() -> ShuffleWorkerPlugin:
    """distributed's shuffle plugin of the worker running this task.

    Off a worker (a graph computed by one of dask's local schedulers),
    distributed's own lookup says "`shuffle='p2p'` requires ...", which
    names a method the user did not choose.
    """
    try:
        get_worker()
    except ValueError:
        raise ShuffleSchedulerError() from None
    return get_worker_plugin()


def transfer(input: Any, id: ShuffleId, input_partition: int) -> int:
    """Split one input partition and hand its shards to their workers."""
    with _phase_errors(id, "transfer", f"input partition {input_partition}"):
        plugin = _worker_plugin()
        run = known_run(plugin, id)
        if run is None:
            return plugin.add_partition(input, input_partition, id)
        return run.add_partition(data=input, partition_id=input_partition)


def get_output(id: ShuffleId, barrier_run_id: int, partition: int) -> Any:
    """Output ``partition`` of run ``barrier_run_id`` of shuffle ``id``, built on this worker."""
    plugin = _worker_plugin()
    run = known_run(plugin, id, barrier_run_id)
    if run is None:
        return plugin.get_output_partition(id, barrier_run_id, partition)
    return run.get_output_partition(partition_id=partition, key=thread_state.key)


def raise_if_read(sides: list[tuple[ShuffleId, int]], partition: int) -> None:
    """Where output ``partition`` of any of ``sides`` (a join's two: shuffle
    id, run id) needs another run (``GPUShuffleRun.needs_another_run``),
    have the scheduler run every side again, and raise.  Every side: the
    output tasks the restart of one side releases may have read the other's
    rows already, and would restart it in turn, and so on.  A worker without
    a side's run has read nothing of it."""
    plugin = _worker_plugin()
    # Not isinstance(run, GPUShuffleRun): engine.run imports this module's users.
    runs = [known_run(plugin, id, run_id) for id, run_id in sides]
    ours: list[Any] = [run for run in runs if hasattr(run, "needs_another_run")]
    if any(run.needs_another_run(partition) for run in ours):
        for run in ours:
            run.request_another_run(partition)
        raise ShuffleClosedError(f"output {partition} needs another run of {sides}")


def unpack(id: ShuffleId, output_partition: int, barrier_run_id: int) -> Any:
    """Assemble one output partition from the shards this worker holds."""
    with _phase_errors(id, "unpack", f"output partition {output_partition}"):
        return get_output(id, barrier_run_id, output_partition)


def barrier(id: ShuffleId, *run_ids: int) -> int:
    """Wait until every input has been transferred; flush every worker's sends.

    Like distributed's ``p2p_barrier``, but a failure names its real cause
    (a send that failed names the peer) instead of only "failed during
    barrier phase".
    """
    try:
        return _worker_plugin().barrier(id, run_ids)
    except (Reschedule, P2PConsistencyError, P2POutOfDiskError, ShuffleSchedulerError):
        raise
    except (
        ShuffleCommError,
        ShuffleCodecError,
        ShuffleMemoryError,
        ShuffleDiskFullError,
        ShuffleInputError,
    ):
        raise
    except Exception as e:
        if (peer_error := _error_of_a_peer(e)) is not None:
            raise peer_error from e
        raise RuntimeError(
            f"P2P {id} failed during barrier phase (gpushuffle): {type(e).__name__}: {e}"
        ) from e


_PEER_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ShuffleCommError,
        ShuffleCodecError,
        ShuffleMemoryError,
        ShuffleOutputTooLargeError,
        ShuffleInputError,
    )
}


def _error_of_a_peer(e: Exception) -> Exception | None:
    """The gpushuffle error another worker raised at the barrier, rebuilt from ``e``.

    At the barrier the scheduler tells every worker that inputs are done; a
    worker whose last sends failed answers with its :class:`ShuffleCommError`.
    The scheduler keeps only its text (it does not unpickle workers'
    exceptions) and fails the barrier with ``RuntimeError('Unexpected error
    encountered during P2P barrier: Exception("ShuffleCommError('...')")')``.
    Rebuilding the error gives users the documented type, and its own message
    (which names the peer) instead of three nested reprs.  Anything else:
    None, and the caller reports ``e`` as it is.
    """
    text = str(e)
    start = text.find("Exception(")
    if start < 0 or not text.endswith(")"):
        return None
    try:
        inner = ast.literal_eval(text[start + len("Exception(") : -1])
        if not isinstance(inner, str):
            return None
        name, _, arguments = inner.partition("(")
        cls = _PEER_ERRORS.get(name)
        if cls is None or not arguments.endswith(")"):
            return None
        message = ast.literal_eval(arguments[:-1])
    except (ValueError, SyntaxError):
        return None
    return cls(message) if isinstance(message, str) else None
