"""gpushuffle's page in Dask's dashboard: ``/gpushuffle`` on the scheduler.

distributed's Shuffling panel draws each running shuffle's buffers
(gpushuffle's store among them: :meth:`GPUShuffleRun.heartbeat`); what a
lost worker cost is on this page, in two tables refreshed every second:

- **Recoveries**: each one the scheduler planned (``recovery.history``):
  when, which shuffle, the workers lost, the output partitions that moved
  to survivors, the outputs already built that were kept;
- **Workers**: each worker's recovery counters since it started, from its
  heartbeats (``Worker.metrics``): runs that adopted what a failed run left,
  partitions taken over, bytes kept and bytes sent again.

The page is added to a scheduler's dashboard as its first gpushuffle run is
created (distributed builds its own pages as the scheduler starts, before
gpushuffle is imported there), so it appears with the first shuffle.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from gpushuffle._distributed import add_dashboard_page
from gpushuffle.engine import recovery
from gpushuffle.engine.worker_ops import RECOVERY_METRIC

logger = logging.getLogger(__name__)

#: The page's route on the scheduler's dashboard.
ROUTE = "/gpushuffle"
_REFRESH_MS = 1000
_WORKER_COLUMNS = {
    "runs": "recovering runs",
    "partitions_taken": "partitions taken",
    "bytes_kept": "bytes kept",
    "bytes_resent": "bytes sent again",
    "inputs_split": "inputs split",
    "inputs_skipped": "inputs skipped",
}

_served: weakref.WeakSet[Any] = weakref.WeakSet()


def install(scheduler: Any) -> None:
    """Serve the page on ``scheduler``'s dashboard (once; not where it has
    none).  A page that cannot be made is logged, never a shuffle's failure."""
    if scheduler in _served:
        return
    _served.add(scheduler)
    try:
        add_dashboard_page(scheduler, ROUTE, recovery_doc)
    except Exception:
        logger.warning("gpushuffle could not add its dashboard page %s", ROUTE, exc_info=True)


def recovery_rows() -> dict[str, Any]:
    """The Recoveries table, newest first."""
    rows = list(reversed(recovery.history))
    return {
        "time": [time.strftime("%H:%M:%S", time.localtime(r.time)) for r in rows],
        "shuffle": [r.shuffle_id for r in rows],
        "lost": [", ".join(r.lost) for r in rows],
        "moved": [r.moved for r in rows],
        "built": [r.built for r in rows],
        "survivors": [r.survivors for r in rows],
    }


def worker_rows(scheduler: Any) -> dict[str, Any]:
    """The Workers table: the counters each worker's last heartbeat carried."""
    prefix = recovery.RecoveryStatistics.PREFIX
    table: dict[str, list[Any]] = {"worker": [], **{k: [] for k in _WORKER_COLUMNS}}
    for address, ws in sorted(scheduler.workers.items()):
        counters = ws.metrics.get(RECOVERY_METRIC)
        if not isinstance(counters, dict):
            continue
        table["worker"].append(address)
        for key in _WORKER_COLUMNS:
            table[key].append(int(counters.get(prefix + key, 0)))
    return table


def recovery_doc(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """The page's bokeh document (distributed's page signature)."""
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource
    from bokeh.models.widgets import DataTable, Div, NumberFormatter, TableColumn

    doc.title = "gpushuffle: recoveries"
    recoveries = ColumnDataSource(recovery_rows())
    workers = ColumnDataSource(worker_rows(scheduler))
    size = NumberFormatter(format="0.0 b")
    recovery_table = DataTable(
        source=recoveries,
        columns=[
            TableColumn(field="time", title="time"),
            TableColumn(field="shuffle", title="shuffle"),
            TableColumn(field="lost", title="workers lost"),
            TableColumn(field="moved", title="partitions moved"),
            TableColumn(field="built", title="outputs kept"),
            TableColumn(field="survivors", title="workers in the new run"),
        ],
        sizing_mode="stretch_width",
        height=300,
    )
    columns = [TableColumn(field="worker", title="worker")]
    for key, title in _WORKER_COLUMNS.items():
        if key.startswith("bytes"):
            columns.append(TableColumn(field=key, title=title, formatter=size))
        else:
            columns.append(TableColumn(field=key, title=title))
    worker_table = DataTable(
        source=workers, columns=columns, sizing_mode="stretch_width", height=300
    )

    def refresh() -> None:
        recoveries.data = recovery_rows()
        workers.data = worker_rows(scheduler)

    doc.add_root(
        column(
            Div(text="<h2>Recoveries after a lost worker</h2>"),
            recovery_table,
            Div(text="<h2>Per worker, since it started</h2>"),
            worker_table,
            sizing_mode="stretch_width",
        )
    )
    doc.add_periodic_callback(refresh, _REFRESH_MS)
