"""Worker preload of ``gpushuffle shuffle``'s embedded cluster.

Ctrl-C in a terminal signals every process in the foreground process group,
the embedded cluster's worker processes included.  The ``gpushuffle``
process handles it: it closes the cluster and removes its partial output.
Workers that handled it too would each print a ``KeyboardInterrupt``
traceback while being shut down, so they ignore SIGINT; and the warning
each of them logs for every task cancelled by that shutdown is left out.

A worker whose heartbeat is in flight when the cluster closes logs
"Failed to communicate with scheduler during heartbeat" with a traceback
(its connection was closed under it).  That record is left out too, but only
once the worker is closing: a heartbeat that fails while the worker runs
still shows, as do the workers' other warnings (pausing for lack of memory).
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from typing import Any

_HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat"


class _ShutdownHeartbeatFilter(logging.Filter):
    """Drop a failed-heartbeat record logged while its worker shuts down."""

    def __init__(self, worker: Any) -> None:
        super().__init__()
        self._worker = weakref.ref(worker)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(_HEARTBEAT_FAILED):
            return True
        worker = self._worker()
        return worker is not None and _is_running(worker)


def _is_running(worker: Any) -> bool:
    from distributed.core import Status

    return worker.status not in (Status.closing, Status.closing_gracefully, Status.closed)


def dask_setup(worker: Any) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("distributed.worker.state_machine").setLevel(logging.ERROR)
    logging.getLogger("distributed.worker").addFilter(_ShutdownHeartbeatFilter(worker))
