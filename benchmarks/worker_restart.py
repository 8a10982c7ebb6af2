"""``python -m benchmarks.worker_restart``: what a lost worker's replacement costs the machine.

A Nanny starts a new worker process when its worker is SIGKILLed; on a
machine whose cores the survivors share, that process's start (imports,
registration) competes with the shuffle.  This kills one worker of a
``gpushuffle bench`` cluster at a time (``--kills`` times, a second apart)
and prints how long the replacement took to register and the CPU time its
process had used by then.  Where losses come every ``s`` seconds, their
replacements ask about ``cpu / s`` of the machine's cores.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import click


@click.command()
@click.option("--workers", default=4, show_default=True)
@click.option("--kills", default=4, show_default=True)
def main(workers: int, kills: int) -> None:
    import dask
    import psutil
    from distributed import Client

    import gpushuffle  # noqa: F401  (the workers import it too, as in a benchmark)
    from gpushuffle.bench import benchmark_cluster, machine_description

    back_s: list[float] = []
    cpu_s: list[float] = []
    with benchmark_cluster(workers, 1, quiet=True) as cluster, Client(cluster) as client:
        client.wait_for_workers(workers)
        for _ in range(kills):
            pids = client.run(os.getpid)
            victim = sorted(pids)[0]
            before = set(client.nthreads())
            start = time.perf_counter()
            os.kill(pids[victim], signal.SIGKILL)
            while not (len(now := set(client.nthreads())) == workers and now - before):
                time.sleep(0.01)
            back_s.append(time.perf_counter() - start)
            (new,) = now - before
            times = psutil.Process(client.run(os.getpid, workers=[new])[new]).cpu_times()
            cpu_s.append(times.user + times.system)
            click.echo(f"replacement registered in {back_s[-1]:.2f} s, its CPU {cpu_s[-1]:.2f} s")
            time.sleep(1)
    click.echo(machine_description())
    click.echo(
        f"{dask.config.get('distributed.worker.multiprocessing-method')}: "
        f"median {statistics.median(back_s):.2f} s to register, "
        f"{statistics.median(cpu_s):.2f} CPU s per replacement"
    )


if __name__ == "__main__":
    main()
