"""Worker preload of ``gpushuffle shuffle``'s embedded cluster.

Ctrl-C in a terminal signals every process in the foreground process group,
the embedded cluster's worker processes included.  The ``gpushuffle``
process handles it: it closes the cluster and removes its partial output.
Workers that handled it too would each print a ``KeyboardInterrupt``
traceback while being shut down, so they ignore SIGINT; and the warning
each of them logs for every task cancelled by that shutdown is left out.
Their other warnings, such as pausing for lack of memory, still show.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any


def dask_setup(worker: Any) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("distributed.worker.state_machine").setLevel(logging.ERROR)
