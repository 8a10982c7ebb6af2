"""What losing a worker costs a shuffle: ``gpushuffle bench --kill-at`` / ``--kill-every``.

Each method runs on a fresh evenly persisted input, first without a fault
(its wall time ``T``), then again while worker processes are SIGKILLed
(their Nannies start new ones): once at ``kill_at x T``, or every
``kill_every x T`` for as long as the run lasts.  Every result is checked
against dask's ``tasks`` shuffle of the same input (rows and sums per output
partition).  ``gpushuffle`` runs with ``gpushuffle.recovery: partial``,
``gpushuffle-restart`` with ``restart`` (what ``p2p`` does).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: Methods of the loss benchmark: name -> (shuffle method, configuration).
LOSS_METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpushuffle": ("gpushuffle", {"gpushuffle.recovery": "partial"}),
    "gpushuffle-restart": ("gpushuffle", {"gpushuffle.recovery": "restart"}),
    "p2p": ("p2p", {}),
}


@dataclass
class LossResult:
    method: str
    repeat: int
    no_fault_s: float
    #: Wall time of the run with losses; None if it did not finish in time.
    fault_s: float | None
    kills: int
    #: Whether both runs' outputs equal the ``tasks`` shuffle's.
    correct: bool
    error: str | None = None
    #: gpushuffle's recovery counters summed over the workers that survived
    #: (``recovery_...``; a killed worker's are gone with it: :func:`recovered`).
    recovery: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return None if self.fault_s is None else self.fault_s / self.no_fault_s


#: Added to a run's give-up time: noticing a loss and starting the shuffle's
#: next run take seconds whatever the run's length (a 0.26 s run given 10x
#: was given up in a full CI run).
_LOSS_GRACE_S = 10.0


def _loss_grace_s() -> float:
    """:data:`_LOSS_GRACE_S` plus ``distributed.comm.timeouts.connect``: a
    worker killed while the scheduler broadcasts a run's barrier is retried
    by distributed's ``ShuffleSchedulerPlugin.barrier``, and the retry waits
    out the connect timeout to the dead address before the shuffle goes on
    (seen once in a full CI run: a 0.25 s run given up 12.5 s after the
    kill).  gpushuffle's plugin gives such a barrier up at once
    (``_distributed.PartialRestartPlugin.barrier``); ``p2p`` on a scheduler
    where no gpushuffle run was made still waits."""
    import dask
    from dask.utils import parse_timedelta

    connect = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), default="s")
    return _LOSS_GRACE_S + float(connect or 0)


class Killer:
    """SIGKILLs random worker processes of ``client`` at given moments, in a thread."""

    def __init__(self, client: Any, rng: random.Random) -> None:
        self.client = client
        self.random = rng
        self.kills = 0
        #: (seconds from start, address) of each kill.
        self.killed: list[tuple[float, str]] = []
        self._started = time.perf_counter()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def kill_one(self) -> None:
        pids = {
            a: pid
            for a, pid in self.client.run(os.getpid, on_error="return").items()
            if isinstance(pid, int)
        }
        if pids:
            address = self.random.choice(sorted(pids))
            os.kill(pids[address], signal.SIGKILL)
            self.kills += 1
            self.killed.append((round(time.perf_counter() - self._started, 3), address))

    def start(self, moments_s: Iterable[float]) -> None:
        """Kill one worker at each of ``moments_s`` (seconds from now, in
        order) until :meth:`stop`."""
        self._done.clear()
        self._started = time.perf_counter()

        def loop() -> None:
            for at in moments_s:
                if self._done.wait(max(0.0, at - (time.perf_counter() - self._started))):
                    return
                # A worker restarting (no pid yet): the next moment kills.
                with contextlib.suppress(Exception):
                    self.kill_one()

        self._thread = threading.Thread(target=loop, daemon=True, name="gpushuffle-killer")
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def all_workers_back(client: Any, cluster: Any, workers: int) -> None:
    """Wait for ``workers`` workers after kills; start new Nannies for those
    that do not come back, rather than failing the run (a LocalCluster closes
    a Nanny whose worker misses ``lost-worker-timeout``)."""
    try:
        client.wait_for_workers(workers, timeout=60)
    except TimeoutError:
        logger.warning("workers did not come back after the kills: starting new ones")
        cluster.scale(workers)
        client.wait_for_workers(workers, timeout=300)


def run_loss_benchmark(
    *,
    rows: int = 8_000_000,
    columns: int = 8,
    partitions: int = 32,
    workers: int = 4,
    methods: Sequence[str] = ("gpushuffle", "p2p"),
    repeat: int = 4,
    kill_at: float | None = 0.7,
    kill_every: float | None = None,
    give_up_after: float = 10.0,
    dtypes: str = "numeric",
    seed: int = 0,
    on_result: Callable[[LossResult], None] | None = None,
) -> tuple[list[LossResult], dict[str, Any]]:
    """Each method ``repeat`` times: a run without a fault, then one with
    losses; a run with losses that takes more than ``give_up_after`` times
    the run without, plus :func:`_loss_grace_s` (the connect timeout and
    10 s), is recorded as not finished."""
    import dask
    from distributed import Client, wait

    import gpushuffle  # noqa: F401  (registers the method)
    from gpushuffle.bench import (
        _digest,
        _output_summary,
        benchmark_cluster,
        machine_description,
        persisted_evenly,
        versions,
    )

    unknown = [m for m in methods if m not in LOSS_METHODS]
    if unknown:
        raise ValueError(f"no loss benchmark for {unknown}: choose from {sorted(LOSS_METHODS)}")
    if (kill_at is None) == (kill_every is None):
        raise ValueError("give one of kill_at (one loss) and kill_every (losses all along)")
    results: list[LossResult] = []
    with (
        dask.config.set(
            {
                "distributed.worker.memory.terminate": False,
                # A LocalCluster closes a Nanny whose worker has not come back
                # within this (15 s by default): after a burst of kills every
                # 0.5x, all four replacements were seen to miss it (restart
                # and partial alike; cause not found), leaving no workers.
                "distributed.deploy.lost-worker-timeout": "120s",
                # Under losses all along, some task is running on one of the
                # workers killed, again and again: distributed's default (3)
                # failed every run at every 0.5x with KilledWorker on an input
                # task, whatever the method. What is measured is the shuffle.
                "distributed.scheduler.allowed-failures": 1000,
            }
        ),
        benchmark_cluster(workers, 1, quiet=True) as cluster,
        Client(cluster) as client,
    ):

        def shuffled(df: Any, method: str) -> Any:
            shuffle_method, _ = LOSS_METHODS.get(method, (method, {}))
            out = df.shuffle(on="key", shuffle_method=shuffle_method)
            return out.map_partitions(_output_summary, meta=_output_summary(df._meta))

        def settings(method: str) -> Any:
            # Read as the graph is built: by compute(), not by shuffle().
            return dask.config.set(LOSS_METHODS.get(method, (method, {}))[1])

        def fresh_input() -> Any:
            all_workers_back(client, cluster, workers)
            df = persisted_evenly(client, rows, partitions, columns, dtypes)
            wait(df)
            return df

        df = fresh_input()
        truth = _digest(shuffled(df, "tasks").compute())
        killer = Killer(client, random.Random(seed))
        grace = _loss_grace_s()
        for method in methods:
            for r in range(repeat):
                df = fresh_input()
                start = time.perf_counter()
                with settings(method):
                    clean = _digest(shuffled(df, method).compute())
                no_fault = time.perf_counter() - start
                before = recovery_counters(client)
                kills_before = killer.kills
                with settings(method):
                    future = client.compute(shuffled(df, method))
                start = time.perf_counter()
                if kill_every is None:
                    killer.start([(kill_at or 0.0) * no_fault])
                else:
                    killer.start(kill_every * no_fault * n for n in itertools.count(1))
                error = None
                fault_s: float | None = None
                try:
                    limit = give_up_after * no_fault + grace
                    got = _digest(future.result(timeout=limit))
                    fault_s = time.perf_counter() - start
                except TimeoutError:
                    got, error = None, f"not finished in {give_up_after:g}x + {grace:g} s"
                except Exception as e:
                    got, error = None, f"{type(e).__name__}: {e}"[:300]
                finally:
                    killer.stop()
                    future.cancel()
                all_workers_back(client, cluster, workers)
                after = recovery_counters(client)
                result = LossResult(
                    method=method,
                    repeat=r,
                    no_fault_s=no_fault,
                    fault_s=fault_s,
                    kills=killer.kills - kills_before,
                    correct=clean == truth and (got is None or got == truth),
                    error=error,
                    recovery=recovered(before, after),
                )
                results.append(result)
                if on_result is not None:
                    on_result(result)
                del df
    context = {
        "rows": rows,
        "columns": columns,
        "dtypes": dtypes,
        "partitions": partitions,
        "workers": workers,
        "kill_at": kill_at,
        "kill_every": kill_every,
        "give_up_after": give_up_after,
        "machine": machine_description(),
        "versions": versions(),
    }
    return results, context


def recovery_counters(client: Any) -> Any:
    """The workers' recovery counters (``gpushuffle.statistics``), a row each."""
    from gpushuffle.api import statistics

    frame = statistics(client)
    return frame[[c for c in frame.columns if c.startswith("recovery_")]]


def recovered(before: Any, after: Any) -> dict[str, int]:
    """What the workers present at both :func:`recovery_counters` recovered
    in between (a lost worker's counters go with it; its replacement's start
    at nothing, and it takes no partition in the run that recovers)."""
    both = before.index.intersection(after.index)
    delta = after.loc[both] - before.loc[both]
    return {c: int(delta[c].sum()) for c in delta.columns}


def summarize_losses(results: Sequence[LossResult]) -> list[dict[str, Any]]:
    """Per method: median wall without and with losses, their ratio, how many
    runs finished and were right."""
    rows = []
    for method in dict.fromkeys(r.method for r in results):
        mine = [r for r in results if r.method == method]
        finished = [r for r in mine if r.fault_s is not None]
        rows.append(
            {
                "method": method,
                "runs": len(mine),
                "finished": len(finished),
                "correct": sum(r.correct for r in mine),
                "kills": sum(r.kills for r in mine),
                "no_fault_s": statistics.median(r.no_fault_s for r in mine),
                "fault_s": (
                    statistics.median(r.fault_s for r in finished if r.fault_s is not None)
                    if finished
                    else None
                ),
                "ratio": (
                    statistics.median(r.ratio for r in finished if r.ratio is not None)
                    if finished
                    else None
                ),
            }
        )
    return rows


def format_losses(summary: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"{'method':<20}{'no fault s':>12}{'with loss s':>13}{'ratio':>8}"
        f"{'finished':>10}{'right':>7}{'kills':>7}"
    ]
    for row in summary:
        fault = "-" if row["fault_s"] is None else f"{row['fault_s']:.2f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(
            f"{row['method']:<20}{row['no_fault_s']:>12.2f}{fault:>13}{ratio:>8}"
            f"{row['finished']:>6}/{row['runs']:<3}{row['correct']:>5}/{row['runs']:<1}"
            f"{row['kills']:>7}"
        )
    return "\n".join(lines)
