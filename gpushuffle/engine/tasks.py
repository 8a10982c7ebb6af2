"""The functions transfer and unpack tasks run on workers.

They find the run through distributed's worker plugin and translate
failures: restarts pass through untouched (distributed reschedules the task),
bad input surfaces as is, anything else names the shuffle, the partition and
the real cause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

from distributed.exceptions import Reschedule

from gpushuffle._distributed import (
    P2PConsistencyError,
    P2POutOfDiskError,
    ShuffleClosedError,
    ShuffleId,
    get_worker_plugin,
)
from gpushuffle.errors import (
    ShuffleCommError,
    ShuffleDiskFullError,
    ShuffleInputError,
    ShuffleMemoryError,
)


@contextlib.contextmanager
def _phase_errors(id: ShuffleId, what: str) -> Generator[None]:
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
    ):
        raise
    except Exception as e:
        raise RuntimeError(f"gpushuffle {id} failed during {what}: {type(e).__name__}: {e}") from e


def transfer(input: Any, id: ShuffleId, input_partition: int) -> int:
    """Split one input partition and hand its shards to their workers."""
    with _phase_errors(id, f"transfer of input partition {input_partition}"):
        return get_worker_plugin().add_partition(input, input_partition, id)


def unpack(id: ShuffleId, output_partition: int, barrier_run_id: int) -> Any:
    """Assemble one output partition from the shards this worker holds."""
    with _phase_errors(id, f"unpack of output partition {output_partition}"):
        return get_worker_plugin().get_output_partition(id, barrier_run_id, output_partition)


def barrier(id: ShuffleId, *run_ids: int) -> int:
    """Wait until every input has been transferred; flush every worker's sends.

    Like distributed's ``p2p_barrier``, but a failure names its real cause
    (a send that failed names the peer) instead of only "failed during
    barrier phase".
    """
    try:
        return get_worker_plugin().barrier(id, run_ids)
    except (Reschedule, P2PConsistencyError, P2POutOfDiskError):
        raise
    except (ShuffleCommError, ShuffleMemoryError, ShuffleDiskFullError, ShuffleInputError):
        raise
    except Exception as e:
        raise RuntimeError(
            f"gpushuffle {id} failed during the barrier: {type(e).__name__}: {e}"
        ) from e
