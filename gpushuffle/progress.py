"""A terminal progress display for a shuffle job, one bar per phase.

The counting is Dask's own: :class:`distributed.diagnostics.progressbar.MultiProgressBar`
installs distributed's ``MultiProgress`` plugin on the scheduler, which groups
every task the job depends on with :func:`phase_of` and reports how many of
each group remain.  This module only draws those counts with ``rich``.
"""

from __future__ import annotations

from typing import Any

from dask.utils import key_split
from distributed.diagnostics.progressbar import MultiProgressBar

#: The phases drawn, in the order they run.  Other groups (the barrier, and
#: the blockwise steps dask adds between reading and transfer and between
#: unpack and writing, which move in step with their neighbours) are counted
#: but not drawn.
PHASES = ("read", "transfer", "unpack", "write")


def phase_of(key: Any) -> str:
    """The phase of a task, from its key (runs on the scheduler).

    ``gpushuffle-transfer-<id>`` and ``gpushuffle-unpack-<id>`` are
    gpushuffle's own tasks (``gpushuffle-<step>-<id>`` an unpack that dask
    fused with the blockwise steps after it).  dask names the reader tasks ``read_parquet-...``
    (``read_parquet-operation-...`` when fused with the next step) and the
    writer tasks ``toparquetdata-...`` and ``toparquetbarrier-...``; any
    other group keeps its prefix.
    """
    name = key_split(key)
    if name == "gpushuffle-transfer":
        return "transfer"
    if name.split("-")[0] == "gpushuffle":
        # gpushuffle-unpack, or an unpack fused with the blockwise steps
        # after it (gpushuffle-<step>..., as dask names fused tasks).
        return "unpack"
    if name == "shuffle-barrier":
        return "barrier"
    if "toparquet" in name:
        return "write"
    if name.startswith("read_parquet"):
        return "read"
    return name


class PhaseProgress(MultiProgressBar):
    """Bars for the read, transfer, unpack and write phases of ``futures``.

    Call :meth:`run` with the client; it returns when the computation
    finished or failed (the caller gathers the result and sees the error).
    """

    def __init__(self, futures: list[Any], scheduler: str, stream: Any = None) -> None:
        super().__init__(futures, scheduler, group_by=phase_of, interval="100ms", complete=True)
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description:<9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tasks"),
            TimeElapsedColumn(),
            console=Console(file=stream, stderr=stream is None),
        )
        self._bars: dict[str, Any] = {}

    def run(self, client: Any) -> None:
        with self._progress:
            client.sync(self.listen)

    def _draw_bar(self, remaining: dict[str, int], all: dict[str, int], **kwargs: Any) -> None:
        for phase in PHASES:
            if phase not in all:
                continue
            if phase not in self._bars:
                self._bars[phase] = self._progress.add_task(phase, total=all[phase])
            self._progress.update(
                self._bars[phase], total=all[phase], completed=all[phase] - remaining[phase]
            )

    def _draw_stop(self, **kwargs: Any) -> None:
        self._progress.refresh()
