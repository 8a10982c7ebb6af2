"""``python -m benchmarks.task_floor``: distributed's cost per task, beside a shuffle.

With many small partitions a shuffle's time is mostly per-task cost.  This
times, on one ``LocalCluster`` and one persisted frame of ``--partitions``
partitions: a blockwise ``map_partitions(len)`` (one task per partition),
the same summed (a tree reduction on top), and a gpushuffle shuffle
followed by ``len``.  Task counts are those the scheduler ran: dask
2026.7.1's ``compute`` does no blockwise fusion, so every step is a task
(``len`` after each unpack too), and a persisted frame reaches each
computation through one alias task per partition (gpushuffle's transfers
read the persisted keys instead).  The first two give distributed's cost
per task on the machine; the shuffle's time less that cost for its tasks
other than transfer and unpack, divided by its transfer and unpack tasks,
is what each of those costs.
"""

from __future__ import annotations

import statistics
import time

import click
from distributed.diagnostics.plugin import SchedulerPlugin


class CountFinished(SchedulerPlugin):
    """Counts tasks that finished on a worker (processing -> memory)."""

    name = "task-floor-count"

    def __init__(self) -> None:
        self.count = 0

    def transition(self, key: object, start: str, finish: str, *args: object, **kw: object) -> None:
        if (start, finish) == ("processing", "memory"):
            self.count += 1


@click.command()
@click.option("--partitions", default=1000, show_default=True)
@click.option("--rows", default=50_000, show_default=True)
@click.option("--workers", default=2, show_default=True)
@click.option("--repeat", default=3, show_default=True)
def main(partitions: int, rows: int, workers: int, repeat: int) -> None:
    from distributed import Client, wait

    import gpushuffle  # noqa: F401  (registers the method)
    from gpushuffle.bench import benchmark_cluster, machine_description, persisted_evenly

    with (
        benchmark_cluster(workers) as cluster,
        Client(cluster) as client,
    ):
        df = persisted_evenly(client, rows, partitions)
        wait(df)
        cases = {
            "len": lambda: df.map_partitions(len),
            "sum": lambda: df.map_partitions(len).sum(),
            "gpushuffle, len": lambda: df.shuffle(
                on="key", shuffle_method="gpushuffle"
            ).map_partitions(len),
        }
        counter = CountFinished()
        cluster.scheduler.add_plugin(counter)
        ntasks: dict[str, int] = {}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeat):
            for name, build in cases.items():
                before = counter.count
                start = time.perf_counter()
                build().compute()
                times[name].append(time.perf_counter() - start)
                ntasks[name] = counter.count - before
        click.echo(
            f"{partitions} partitions, {workers} workers x 1 thread; {machine_description()}"
        )
        floor = []
        for name in cases:
            median = statistics.median(times[name])
            per_task = median / ntasks[name] * 1000
            runs = " / ".join(f"{t:.2f}" for t in times[name])
            click.echo(
                f"{name:<16} {runs} s, median {median:.2f} s,"
                f" {per_task:.2f} ms per task ({ntasks[name]} tasks)"
            )
            if name != "gpushuffle, len":
                floor.append(per_task)
        shuffle = statistics.median(times["gpushuffle, len"])
        others = ntasks["gpushuffle, len"] - 2 * partitions  # not transfer or unpack
        spent = shuffle - others * min(floor) / 1000
        click.echo(
            f"gpushuffle: {shuffle / (2 * partitions) * 1000:.2f} ms per transfer or unpack task; "
            f"{spent / (2 * partitions) * 1000:.2f} ms of it above distributed's per-task floor"
        )


if __name__ == "__main__":
    main()
