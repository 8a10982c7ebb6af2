"""``python -m benchmarks.worker_cpu``: where a worker's CPU goes during a shuffle.

Per worker and thread, the CPU time a shuffle took (read from
``/proc/<pid>/task/<tid>/stat`` before and after it), and the time Python's
garbage collector spent in each generation, with the tracked objects at the
last full collection.  These counters are exact, where a sampling profiler
such as py-spy, with the event loop and the task thread contending for the
GIL, puts much of the time on whatever line takes the GIL back (at 1,000 x
1,000 partitions, distributed's ``ContextMeter.meter``).  On a machine whose
speed changes from hour to hour CPU seconds also vary less than wall time.

Linux only (``/proc``).  One warm-up shuffle first, then ``--repeat``.
"""

from __future__ import annotations

import collections
import gc
import os
import statistics
import threading
import time
from typing import Any

import click

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = collections.Counter()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), f"thread {tid}")
        # Thread pools number their threads: one name per kind of thread.
        name = "task threads" if "Dask-Default-Threads" in name else name
        out[name] += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return dict(out)


class _GCTimer:
    """Seconds and collections per generation, and the tracked objects at
    the last full collection, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[int] = collections.Counter()
        self.collections: collections.Counter[int] = collections.Counter()
        self.tracked = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            if generation == 2:
                self.tracked = len(gc.get_objects())
            self._start = time.perf_counter()
        else:
            self.seconds[generation] += time.perf_counter() - self._start
            self.collections[generation] += 1


def _start(dask_worker: Any) -> None:
    timer = _GCTimer()
    gc.callbacks.append(timer)
    dask_worker._worker_cpu = (timer, _thread_cpu())


def _stop(dask_worker: Any) -> dict[str, Any]:
    timer, before = dask_worker._worker_cpu
    gc.callbacks.remove(timer)
    after = _thread_cpu()
    cpu = {name: after[name] - before.get(name, 0.0) for name in after}
    return {
        "cpu": {name: seconds for name, seconds in cpu.items() if seconds >= 0.01},
        "gc_seconds": dict(timer.seconds),
        "gc_collections": dict(timer.collections),
        "tracked": timer.tracked,
    }


@click.command()
@click.option("--rows", default=50_000, show_default=True)
@click.option("--partitions", default=1000, show_default=True)
@click.option("--workers", default=2, show_default=True)
@click.option("--dtypes", type=click.Choice(["numeric", "mixed"]), default="numeric")
@click.option("--method", default="gpushuffle", show_default=True)
@click.option("--repeat", default=1, show_default=True)
def main(rows: int, partitions: int, workers: int, dtypes: str, method: str, repeat: int) -> None:
    from distributed import Client, wait

    import gpushuffle  # noqa: F401  (registers the method)
    from gpushuffle.bench import benchmark_cluster, machine_description, persisted_evenly

    with (
        benchmark_cluster(workers) as cluster,
        Client(cluster) as client,
    ):
        df = persisted_evenly(client, rows, partitions, dtypes=dtypes)
        wait(df)

        def shuffle() -> float:
            start = time.perf_counter()
            df.shuffle(on="key", shuffle_method=method).map_partitions(len).compute()
            return time.perf_counter() - start

        shuffle()  # warm-up: fresh pages, imports
        click.echo(
            f"{rows:,} rows in {partitions} partitions, {dtypes}, {method}, "
            f"{workers} workers x 1 thread; {machine_description()}"
        )
        for r in range(repeat):
            client.run(_start)
            wall = shuffle()
            reports = client.run(_stop)
            click.echo(f"run {r + 1}: {wall:.2f} s")
            for address, report in sorted(reports.items()):
                cpu = ", ".join(
                    f"{name} {seconds:.2f}"
                    for name, seconds in sorted(report["cpu"].items(), key=lambda kv: -kv[1])
                )
                collected = report["gc_collections"]
                gc_line = ", ".join(
                    f"gen{g} {report['gc_seconds'][g]:.2f} s ({collected[g]}x)"
                    for g in sorted(collected)
                )
                click.echo(f"  {address}: CPU s: {cpu}")
                click.echo(
                    f"  {' ' * len(address)}  gc: {gc_line or 'none'}; tracked objects at "
                    f"the last full collection: {report['tracked'] or '-'}"
                )
            totals = [sum(report["cpu"].values()) for report in reports.values()]
            click.echo(f"  CPU per worker, median: {statistics.median(totals):.2f} s")


if __name__ == "__main__":
    main()
