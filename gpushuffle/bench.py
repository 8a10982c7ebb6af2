"""Side-by-side benchmark: gpushuffle against dask's ``p2p`` and ``tasks``.

Every method shuffles the same persisted frame on the same cluster, in turn,
``repeat`` times each.  Before a method's first run the workers collect
garbage, trim malloc and empty gpushuffle's host buffer pool, so no method
inherits memory another one left; a method's later runs show its steady
state in a long-lived cluster (gpushuffle's pool warm).  Reports wall time,
throughput and the peak RSS of the largest worker, sampled on the workers
themselves every 20 ms.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

DEFAULT_METHODS = ("gpushuffle", "p2p", "tasks")


@dataclass
class Result:
    method: str
    repeat: int
    wall_s: float
    input_bytes: int
    rows_out: int
    peak_worker_rss_bytes: int
    spilled_bytes: int = 0
    #: Each worker's RSS when the run started.
    rss_before_bytes: dict[str, int] = field(default_factory=dict)
    #: Each worker's RSS ``settle_s`` seconds after the run ended (with ``settle_s``).
    rss_after_bytes: dict[str, int] = field(default_factory=dict)
    settle_s: float = 0.0
    #: What shuffles held on the largest worker when its RSS peaked
    #: (:func:`gpushuffle.engine.footprint.memory_breakdown`), and the RSS then.
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    #: Bytes gpushuffle's stages copied in this run, summed over workers, by
    #: stage (:mod:`gpushuffle.engine.copies`); empty for other methods.
    copied_bytes: dict[str, int] = field(default_factory=dict)
    #: Seconds each of gpushuffle's stages was under way in this run, summed
    #: over workers (:data:`gpushuffle.engine.copies.busy`).
    busy_seconds: dict[str, float] = field(default_factory=dict)
    #: Seconds spent in each stage, summed over its operations and workers
    #: (:data:`gpushuffle.engine.copies.spent`: thread time).
    spent_seconds: dict[str, float] = field(default_factory=dict)
    #: Seconds per byte of a plain copy on the workers, measured just before
    #: this run, on all of them at once (median over workers).
    memcpy_s_per_byte: float | None = None
    #: Workers restarted during the run (a Nanny's worker killed for its memory).
    restarts: int = 0
    #: Why the run failed (``KilledWorker``, a gpushuffle error); None if it ran.
    error: str | None = None
    #: A digest of each output partition's rows, key sum and first column's
    #: sum: equal between methods that put the same rows in each partition.
    partition_digest: str | None = None
    #: Each worker's RSS over the run: ``(seconds since the run started, bytes)``.
    #: Not written to JSON.
    rss_timelines: dict[str, list[tuple[float, int]]] = field(
        default_factory=dict, repr=False, compare=False
    )
    #: Each worker's :func:`~gpushuffle.engine.footprint.memory_breakdown` at the
    #: same instants as ``rss_timelines``.  Not written to JSON.
    breakdowns: dict[str, list[dict[str, int]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def left_behind_bytes(self) -> int | None:
        """Largest growth of a worker's RSS from before the run to ``settle_s`` after."""
        if not self.rss_after_bytes:
            return None
        return max(self.rss_after_bytes[w] - self.rss_before_bytes[w] for w in self.rss_after_bytes)

    @property
    def gib_per_s(self) -> float:
        return self.input_bytes / 2**30 / self.wall_s if self.error is None else float("nan")

    @property
    def x_of_memcpy(self) -> dict[str, float]:
        """Per stage gpushuffle copies on a thread of its own, its thread
        seconds per byte copied over a plain copy's on one thread: how far
        from the floor.  Left out: ``send`` and ``receive`` (their time is
        that of the comm: waiting for the peer, distributed's reads), and
        stages that copied under 1% of the input (their time is mostly not
        copying)."""
        if not self.memcpy_s_per_byte or self.input_bytes <= 0:
            return {}
        return {
            stage: self.spent_seconds[stage] / nbytes / self.memcpy_s_per_byte
            for stage, nbytes in self.copied_bytes.items()
            if stage in COPYING_STAGES
            and nbytes >= 0.01 * self.input_bytes
            and self.spent_seconds.get(stage)
        }

    @property
    def copies_per_byte(self) -> float | None:
        """Bytes copied per byte shuffled (None for methods other than gpushuffle)."""
        if not self.copied_bytes:
            return None
        return sum(self.copied_bytes.values()) / self.input_bytes


#: Stages whose time is gpushuffle's own copying (:attr:`Result.x_of_memcpy`).
COPYING_STAGES = frozenset({"split", "serialize", "deserialize", "spill", "move", "unpack"})

#: Column kinds of ``--dtypes mixed``, in the order they repeat.
MIXED_KINDS = (
    "str",
    "category",
    "datetime",
    "datetime-tz",
    "Int64",
    "boolean",
    "float-nan",
    "int64",
)
DTYPES = ("numeric", "mixed")


def make_partition(
    i: int, rows: int, ncols: int, nkeys: int, dtypes: str = "numeric", skew: float = 0.0
) -> pd.DataFrame:
    """One input partition: an int64 ``key`` and ``ncols - 1`` more columns.

    ``numeric``: int64 and float64 columns.  ``mixed``: what users' frames
    hold, in turn (:data:`MIXED_KINDS`): strings of 4 to 40 characters in
    pandas' default string dtype, categoricals, naive and tz-aware
    timestamps, nullable Int64 and boolean with 10% missing, floats with 10%
    NaN, int64.  ``skew``: the share of rows whose key is 0 (a hot key).
    """
    rng = np.random.default_rng(i)
    data: dict[str, Any] = {"key": rng.integers(0, nkeys, rows)}
    if skew:
        data["key"][rng.random(rows) < skew] = 0
    for c in range(1, ncols):
        if dtypes == "numeric":
            data[f"c{c}"] = rng.integers(0, 2**40, rows) if c % 2 else rng.random(rows)
        else:
            kind = MIXED_KINDS[(c - 1) % len(MIXED_KINDS)]
            data[f"{kind}{c}"] = _mixed_column(kind, rng, rows)
    return pd.DataFrame(data)


@contextlib.contextmanager
def benchmark_cluster(
    workers: int, threads: int = 1, quiet: bool = True, **kwargs: Any
) -> Iterator[Any]:
    """The ``LocalCluster`` a benchmark starts and closes itself: no
    dashboard, and the embedded-worker preload, so that closing it prints no
    shutdown noise (a heartbeat cut by the close).  With ``quiet`` the
    scheduler's WARNING at every shuffle's start and end stays out of the
    output (``gpushuffle bench`` leaves that to its ``--debug``)."""
    from distributed import LocalCluster

    from gpushuffle.cluster import _quiet_shuffle_log, embedded_worker_preloads

    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=threads,
            dashboard_address=":0",
            preload=embedded_worker_preloads(),
            **kwargs,
        ) as cluster,
        _quiet_shuffle_log(debug=not quiet),
    ):
        yield cluster


def generated_frame(
    rows: int, partitions: int, columns: int = 16, dtypes: str = "numeric", skew: float = 0.0
) -> Any:
    """The benchmarks' input, not yet computed: ``rows`` rows of
    :func:`make_partition` in ``partitions`` partitions of equal size (the
    last ones smaller where ``rows`` does not divide evenly)."""
    import dask.dataframe as dd

    sizes = _partition_rows(rows, partitions)
    return dd.from_map(
        make_partition,
        range(partitions),
        sizes,
        [columns] * partitions,
        [rows] * partitions,
        [dtypes] * partitions,
        [skew] * partitions,
        meta=make_partition(0, 0, columns, rows, dtypes),
        enforce_metadata=False,
    )


def _partition_rows(rows: int, partitions: int) -> list[int]:
    """Rows of each input partition: equal, the last ones smaller where
    ``rows`` does not divide evenly."""
    per_part = -(-rows // partitions)
    return [max(0, min(per_part, rows - i * per_part)) for i in range(partitions)]


def persisted_evenly(
    client: Any,
    rows: int,
    partitions: int,
    columns: int = 16,
    dtypes: str = "numeric",
    skew: float = 0.0,
) -> Any:
    """:func:`generated_frame`, persisted with partition ``i`` on the
    ``i % n``-th of the client's ``n`` workers (by address).

    Left to the scheduler, 40 partitions land 20/20 on two workers, or
    21/19, or 23/17: the worker with more does more of every method's
    work and sets its time, a spread of several percent from one run to
    the next that has nothing to do with the shuffle.
    """
    import dask.dataframe as dd

    # Worker lists here come from client.nthreads(), not
    # scheduler_info()['workers']: the client's periodic refresh of that
    # cache asks for no workers, and can empty it between the call's fetch
    # and its return (distributed 2026.7.1 and 2026.8.0).
    workers = sorted(client.nthreads())
    meta = generated_frame(rows, partitions, columns, dtypes)._meta
    sizes = _partition_rows(rows, partitions)
    futures: list[Any] = [None] * partitions
    for w, worker in enumerate(workers):
        mine = list(range(w, partitions, len(workers)))
        placed = client.map(
            _partition_as,
            mine,
            [sizes[i] for i in mine],
            columns=columns,
            nkeys=rows,
            dtypes=dtypes,
            skew=skew,
            like=dict(meta.dtypes),
            workers=[worker],
            # a preference: a worker lost meanwhile leaves none waiting
            allow_other_workers=True,
            pure=False,
        )
        for i, future in zip(mine, placed, strict=True):
            futures[i] = future
    _placement_only(client, futures)
    # The persisted keys alias the futures' results where they are: no copy.
    return dd.from_delayed(futures, meta=meta, verify_meta=False).persist()


def _placement_only(client: Any, futures: Sequence[Any]) -> None:
    """Drop the inputs' worker restrictions once they are computed where
    they were placed: a worker lost later has its inputs recomputed on any
    worker, as inputs read from files would be.

    Kept, a restriction strands its task where every worker is lost at once
    (a soak on 2 workers, losses every half-run): the task goes
    ``no-worker``, and distributed (2026.7.1,
    ``Scheduler.bulk_schedule_unrunnable_after_adding_worker``) gives a
    joining worker only tasks whose restrictions name it, whatever
    ``allow_other_workers`` says, so the shuffle never finishes.
    """
    from distributed import wait

    wait(list(futures))
    client.sync(client.scheduler.set_restrictions, worker={future.key: None for future in futures})


def _partition_as(
    i: int,
    rows: int,
    columns: int,
    nkeys: int,
    dtypes: str,
    like: dict[str, Any],
    skew: float = 0.0,
) -> pd.DataFrame:
    """:func:`make_partition` with the dtypes dask gives the lazy frame
    (pandas' "str" columns become dask's Arrow strings, as in
    :func:`generated_frame`)."""
    part = make_partition(i, rows, columns, nkeys, dtypes, skew)
    changed = {c: d for c, d in like.items() if part.dtypes[c] != d}
    return part.astype(changed) if changed else part


_VOCABULARY: Any = None


def _strings(rng: np.random.Generator, rows: int) -> Any:
    import pyarrow as pa

    global _VOCABULARY
    if _VOCABULARY is None:
        lengths = np.random.default_rng(0).integers(4, 41, 10_000)
        _VOCABULARY = pa.array(
            ["".join(chr(97 + (j * 7 + w) % 26) for j in range(n)) for w, n in enumerate(lengths)]
        )
    values = _VOCABULARY.take(pa.array(rng.integers(0, len(_VOCABULARY), rows)))
    # pandas' default string dtype: "str" (Arrow-backed) from pandas 3 on.
    return pd.array(values, dtype=pd.Series(["x"]).dtype)


def _mixed_column(kind: str, rng: np.random.Generator, rows: int) -> Any:
    missing = rng.random(rows) < 0.1
    if kind == "str":
        return _strings(rng, rows)
    if kind == "category":
        return pd.Categorical.from_codes(
            rng.integers(0, 50, rows), categories=pd.Index([f"group-{g}" for g in range(50)])
        )
    if kind in ("datetime", "datetime-tz"):
        seconds = rng.integers(0, 365 * 86400, rows)
        values = pd.Series(np.datetime64("2026-01-01", "ns") + seconds.astype("m8[s]"))
        return (
            values.dt.tz_localize("UTC").dt.tz_convert("Europe/Berlin") if "tz" in kind else values
        )
    if kind == "Int64":
        return pd.arrays.IntegerArray(rng.integers(-(10**6), 10**6, rows), missing)
    if kind == "boolean":
        return pd.arrays.BooleanArray(rng.random(rows) < 0.5, missing)
    if kind == "float-nan":
        floats = rng.random(rows)
        floats[missing] = np.nan
        return floats
    return rng.integers(0, 2**40, rows)


# -- worker RSS, sampled on each worker in a thread of its own ---------------

_SAMPLERS: dict[str, dict[str, Any]] = {}


def _start_sampler(
    interval: float = 0.02, name: str = "bench", breakdown: bool = False, dask_worker: Any = None
) -> None:
    """Sample this worker's RSS every ``interval`` seconds until :func:`_stop_sampler`.

    Runs on workers (``client.run``).  ``name`` keeps samplers of different
    callers on one worker apart.  With ``breakdown``, each sample also
    records what shuffles hold (:func:`gpushuffle.engine.footprint.memory_breakdown`).
    """
    import psutil

    from gpushuffle.engine.footprint import memory_breakdown

    process = psutil.Process()
    stop = threading.Event()

    def parts() -> dict[str, int]:
        return memory_breakdown(dask_worker) if breakdown else {}

    rss = process.memory_info().rss
    state: dict[str, Any] = {
        "process": process,
        "peak": rss,
        "stop": stop,
        "timeline": [(time.time(), rss)],
        "breakdown": [parts()],
        "parts": parts,
    }
    _SAMPLERS[name] = state

    def sample() -> None:
        timeline, breakdowns = state["timeline"], state["breakdown"]
        while not stop.wait(interval):
            rss = process.memory_info().rss
            breakdowns.append(parts())
            timeline.append((time.time(), rss))
            state["peak"] = max(state["peak"], rss)

    thread = threading.Thread(target=sample, daemon=True, name=f"gpushuffle-rss-sampler-{name}")
    state["thread"] = thread
    thread.start()


def _stop_sampler(name: str = "bench") -> dict[str, Any] | None:
    """Stop the sampler; its peak RSS, ``(unix time, RSS)`` samples and
    breakdowns (None on a worker that started after it: a restarted one)."""
    state = _SAMPLERS.pop(name, None)
    if state is None:
        return None
    state["stop"].set()
    state["thread"].join()
    rss = state["process"].memory_info().rss
    state["breakdown"].append(state["parts"]())
    state["timeline"].append((time.time(), rss))
    state["peak"] = max(state["peak"], rss)
    return {
        "peak": int(state["peak"]),
        "timeline": state["timeline"],
        "breakdown": state["breakdown"],
    }


def _output_summary(part: pd.DataFrame) -> pd.DataFrame:
    """One row per output partition: its rows and a sum of each plain numeric
    column's bits (floats as their int64 bit patterns), which wraps exactly
    and does not depend on the rows' order; cheap enough beside a large
    output (no per-row hashes)."""
    sums = {"rows": [len(part)]}
    for name in part.columns:
        values = part[name]
        if isinstance(values.dtype, np.dtype) and values.dtype.kind in "iuf":
            data = np.ascontiguousarray(values.to_numpy())
            bits = data.view(np.int64) if data.dtype.itemsize == 8 else data.astype(np.int64)
            sums[f"sum_{name}"] = [int(bits.sum(dtype=np.int64))]
    return pd.DataFrame(sums)


def _digest(summary: pd.DataFrame) -> str:
    import hashlib

    return hashlib.sha1(
        pd.util.hash_pandas_object(summary.reset_index(drop=True)).to_numpy().tobytes()
    ).hexdigest()[:16]


def _collect(release_pool: bool) -> None:
    from gpushuffle.engine.pool import host_pool

    gc.collect()
    if release_pool:
        host_pool().release_idle(0)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - not glibc
        pass


def _copied() -> dict[str, int]:
    from gpushuffle.engine import copies

    return copies.statistics.as_dict()


def _stage_ns() -> dict[str, int]:
    from gpushuffle.engine import copies

    return {**copies.busy.as_dict(), **copies.spent.as_dict()}


def _stage_seconds(client: Any) -> dict[str, dict[str, float]]:
    """Seconds each stage was under way (``busy``) and spent (``spent``) so
    far, summed over workers."""
    total: dict[str, dict[str, float]] = {"busy": {}, "spent": {}}
    for row in client.run(_stage_ns).values():
        for key, value in row.items():
            kind, _, rest = key.partition("_")
            stage = rest.removesuffix("_ns")
            total[kind][stage] = total[kind].get(stage, 0.0) + value / 1e9
    return total


def _memcpy() -> float:
    from gpushuffle.engine import copies

    return copies.memcpy_seconds_per_byte()


def _copied_total(client: Any) -> dict[str, int]:
    """Bytes copied per stage so far, summed over workers."""
    total: dict[str, int] = {}
    for row in client.run(_copied).values():
        for key, value in row.items():
            stage = key.removeprefix("copied_").removesuffix("_bytes")
            total[stage] = total.get(stage, 0) + value
    return total


def _spilled(client: Any) -> int:
    from gpushuffle.api import statistics

    return int(statistics(client)["spilled_bytes"].sum())


def _scheduler_task_count(dask_scheduler: Any) -> int:
    return len(dask_scheduler.tasks)


def _wait_until_released(client: Any, baseline: int, timeout: float = 30) -> None:
    """Wait until the scheduler forgot the last run's tasks.

    The next run builds the same graph; keys still held would be reused
    instead of recomputed.
    """
    deadline = time.monotonic() + timeout
    while client.run_on_scheduler(_scheduler_task_count) > baseline:
        if time.monotonic() > deadline:
            raise RuntimeError("tasks of the previous run were not released")
        time.sleep(0.05)


def run_benchmark(
    *,
    rows: int = 24_000_000,
    columns: int = 16,
    partitions: int = 40,
    workers: int = 2,
    threads: int = 1,
    methods: Sequence[str] = DEFAULT_METHODS,
    repeat: int = 1,
    protocol: str = "tcp",
    memory_limit: str | None = None,
    settle: float = 0.0,
    on_result: Any = None,
    dtypes: str = "numeric",
    skew: float = 0.0,
    worker_memory: str | None = None,
) -> tuple[list[Result], dict[str, Any]]:
    """Run each method ``repeat`` times on one cluster; return results and context.

    With ``settle``, workers keep being sampled for that many seconds after
    each run, and their RSS then is recorded (what a run left behind).
    ``skew`` puts that share of the rows on one key.  ``worker_memory`` gives
    each worker that memory limit, as distributed enforces it (a worker over
    it is restarted by its Nanny), and the input is generated in the
    transfer tasks instead of persisted first, so that it can be larger than
    the cluster: each run counts the restarts it caused, and one that fails
    is recorded with its error.
    """
    import dask
    from distributed import Client, wait

    import gpushuffle  # noqa: F401  (registers the method)

    # Benchmarks of persisted inputs measure what each method needs: no
    # worker is killed for it.  With worker_memory, the limit is the point.
    settings: dict[str, Any] = (
        {} if worker_memory else {"distributed.worker.memory.terminate": False}
    )
    if memory_limit is not None:
        # The store's budget on each worker (the Nanny hands the worker this
        # configuration); p2p keeps its own fixed buffers.
        settings["gpushuffle.memory.host-limit"] = memory_limit
        settings["gpushuffle.memory.device-limit"] = memory_limit
    results: list[Result] = []
    with (
        dask.config.set(settings),
        benchmark_cluster(
            workers,
            threads,
            quiet=False,
            protocol=protocol,
            **({"memory_limit": worker_memory} if worker_memory else {}),
        ) as cluster,
        Client(cluster) as client,
    ):
        if worker_memory:
            df = generated_frame(rows, partitions, columns, dtypes, skew)
        else:
            df = persisted_evenly(client, rows, partitions, columns, dtypes, skew)
            wait(df)
        input_bytes = int(df.memory_usage(deep=True, index=True).sum().compute())
        context = {
            "rows": rows,
            "columns": columns,
            "dtypes": dtypes,
            "partitions": partitions,
            "workers": workers,
            "threads_per_worker": threads,
            "protocol": protocol,
            "skew": skew,
            "worker_memory": worker_memory,
            "input_bytes": input_bytes,
            "machine": machine_description(),
            "versions": versions(),
        }
        baseline_tasks = client.run_on_scheduler(_scheduler_task_count)
        for method in methods:
            for r in range(repeat):
                # Every worker at once, as the stages run; before _collect,
                # which trims what the copy's buffers leave in malloc's heaps.
                memcpy = (
                    statistics.median(client.run(_memcpy).values())
                    if method == "gpushuffle"
                    else None
                )
                client.run(_collect, r == 0)
                spilled_before = _spilled(client)
                copied_before = _copied_total(client)
                times_before = _stage_seconds(client)
                client.run(_start_sampler, breakdown=True)
                before = set(client.nthreads())
                start_time = time.time()
                start = time.perf_counter()
                error = None
                outputs = df.shuffle(on="key", shuffle_method=method).map_partitions(
                    _output_summary, meta=_output_summary(df._meta)
                )
                try:
                    summary = outputs.compute()
                except Exception as e:  # a failed run is a result too
                    summary, error = None, f"{type(e).__name__}: {e}"[:500]
                wall = time.perf_counter() - start
                if worker_memory:
                    client.wait_for_workers(workers, timeout=300)
                restarts = len(set(client.nthreads()) - before)
                if settle:
                    _wait_until_released(client, baseline_tasks)
                    time.sleep(max(0.0, settle - (time.perf_counter() - start - wall)))
                # A restarted worker's sampler went with it.
                samples = {w: s for w, s in client.run(_stop_sampler).items() if s is not None}
                copied = {
                    stage: value - copied_before.get(stage, 0)
                    for stage, value in _copied_total(client).items()
                }
                times = {
                    kind: {
                        stage: value - times_before[kind].get(stage, 0.0)
                        for stage, value in by_stage.items()
                    }
                    for kind, by_stage in _stage_seconds(client).items()
                }
                _wait_until_released(client, baseline_tasks)
                # Every worker restarted (each one's sampler went with it):
                # nothing is known of this run's memory but that it was too much.
                samples = samples or {
                    "": {"peak": 0, "timeline": [(start_time, 0)], "breakdown": [{}]}
                }
                largest = max(samples, key=lambda w: samples[w]["peak"])
                timeline = samples[largest]["timeline"]
                at_peak = max(range(len(timeline)), key=lambda i: timeline[i][1])
                result = Result(
                    method=method,
                    repeat=r,
                    wall_s=wall,
                    input_bytes=input_bytes,
                    rows_out=int(summary["rows"].sum()) if summary is not None else 0,
                    restarts=restarts,
                    error=error,
                    partition_digest=_digest(summary) if summary is not None else None,
                    peak_worker_rss_bytes=max(s["peak"] for s in samples.values()),
                    spilled_bytes=max(0, _spilled(client) - spilled_before),
                    copied_bytes=copied if method == "gpushuffle" else {},
                    busy_seconds=times["busy"] if method == "gpushuffle" else {},
                    spent_seconds=times["spent"] if method == "gpushuffle" else {},
                    memcpy_s_per_byte=memcpy,
                    rss_before_bytes={w: s["timeline"][0][1] for w, s in samples.items()},
                    rss_after_bytes=(
                        {w: s["timeline"][-1][1] for w, s in samples.items()} if settle else {}
                    ),
                    settle_s=settle,
                    peak_breakdown={
                        "rss": timeline[at_peak][1],
                        "rss_before": timeline[0][1],
                        **samples[largest]["breakdown"][at_peak],
                    },
                    rss_timelines={
                        worker: [(t - start_time, rss) for t, rss in s["timeline"]]
                        for worker, s in samples.items()
                    },
                    breakdowns={worker: s["breakdown"] for worker, s in samples.items()},
                )
                results.append(result)
                if on_result is not None:
                    on_result(result)
    return results, context


def summarize(results: Sequence[Result]) -> list[dict[str, Any]]:
    """Median per method, with the ratio to gpushuffle's median wall time."""
    by_method: dict[str, list[Result]] = {}
    for r in results:
        by_method.setdefault(r.method, []).append(r)

    def median_wall(rs: Sequence[Result]) -> float:
        ran = [r.wall_s for r in rs if r.error is None]
        return statistics.median(ran) if ran else float("nan")

    base = median_wall(by_method.get("gpushuffle", results))
    digests = {
        method: {r.partition_digest for r in rs if r.partition_digest}
        for method, rs in by_method.items()
    }
    rows = []
    for method, rs in by_method.items():
        wall = median_wall(rs)
        rows.append(
            {
                "method": method,
                "runs": len(rs),
                "failed": sum(r.error is not None for r in rs),
                "restarts": sum(r.restarts for r in rs),
                "errors": sorted({r.error for r in rs if r.error}),
                # Methods whose runs all put the same rows in each partition as
                # this one's (None if this one has no complete run).
                "same_partitions_as": sorted(
                    other
                    for other, seen in digests.items()
                    if other != method and seen and seen == digests[method]
                )
                if len(digests[method]) == 1
                else None,
                "wall_s": wall,
                "wall_s_all": [round(r.wall_s, 2) if r.error is None else None for r in rs],
                "input_bytes": rs[0].input_bytes,
                "gib_per_s": rs[0].input_bytes / 2**30 / wall,
                "rows_out": max(r.rows_out for r in rs),
                "peak_worker_rss_bytes": int(
                    statistics.median(r.peak_worker_rss_bytes for r in rs)
                ),
                "spilled_bytes": int(statistics.median(r.spilled_bytes for r in rs)),
                "left_behind_bytes": (
                    int(statistics.median(r.left_behind_bytes or 0 for r in rs))
                    if rs[0].settle_s
                    else None
                ),
                "vs_gpushuffle": wall / base,
                "copies_per_byte": (
                    statistics.median(r.copies_per_byte or 0 for r in rs)
                    if rs[0].copied_bytes
                    else None
                ),
                "copies_per_byte_by_stage": (
                    {
                        stage: statistics.median(r.copied_bytes[stage] for r in rs)
                        / rs[0].input_bytes
                        for stage in rs[0].copied_bytes
                    }
                    if rs[0].copied_bytes
                    else None
                ),
                "busy_seconds_by_stage": _median_by_stage([r.busy_seconds for r in rs]),
                "x_of_memcpy_by_stage": _median_by_stage([r.x_of_memcpy for r in rs]),
                "memcpy_gib_per_s": (
                    1 / statistics.median(r.memcpy_s_per_byte or 0 for r in rs) / 2**30
                    if rs[0].memcpy_s_per_byte
                    else None
                ),
            }
        )
    return rows


def machine_description() -> str:
    import psutil

    return (
        f"{platform.node() or 'host'}: {os.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"
    )


def versions() -> dict[str, str]:
    import dask
    import distributed

    import gpushuffle

    return {
        "gpushuffle": gpushuffle.__version__,
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "pandas": pd.__version__,
        "numpy": np.__version__,
    }


def format_table(summary: Sequence[dict[str, Any]]) -> str:
    settled = any(s.get("left_behind_bytes") is not None for s in summary)
    faults = any(s.get("failed") or s.get("restarts") for s in summary)
    header = (
        f"{'method':<12}{'runs':>5}{'wall s':>9}{'GiB/s':>8}{'rows out':>13}"
        f"{'peak RSS GiB':>14}{'spilled GiB':>13}{'x gpushuffle':>14}"
        + (f"{'left MiB':>10}" if settled else "")
        + (f"{'failed':>8}{'restarts':>10}" if faults else "")
        + f"{'copies/B':>10}"
    )
    lines = [header, "-" * len(header)]
    for s in summary:
        left = s.get("left_behind_bytes")
        lines.append(
            f"{s['method']:<12}{s['runs']:>5}{s['wall_s']:>9.2f}{s['gib_per_s']:>8.3f}"
            f"{s['rows_out']:>13,}{s['peak_worker_rss_bytes'] / 2**30:>14.2f}"
            f"{s['spilled_bytes'] / 2**30:>13.2f}{s['vs_gpushuffle']:>14.2f}"
            + (f"{(left or 0) / 2**20:>10.0f}" if settled else "")
            + (f"{s.get('failed', 0):>8}{s.get('restarts', 0):>10}" if faults else "")
            + (
                f"{copied:>10.2f}"
                if (copied := s.get("copies_per_byte")) is not None
                else f"{'-':>10}"
            )
        )
    return "\n".join(lines)


def _median_by_stage(rows: Sequence[dict[str, float]]) -> dict[str, float] | None:
    """Each stage's median over the runs that have it (None if none has any)."""
    stages = dict.fromkeys(stage for row in rows for stage in row)
    if not stages:
        return None
    return {stage: statistics.median(r[stage] for r in rows if stage in r) for stage in stages}


def format_stages(row: dict[str, Any]) -> str | None:
    """A method's stages (medians over its runs): bytes copied per byte
    shuffled, seconds under way (summed over workers) and time per byte
    copied as a multiple of a plain copy's; None for other methods."""
    copies = row.get("copies_per_byte_by_stage")
    if not copies:
        return None
    busy = row.get("busy_seconds_by_stage") or {}
    times = row.get("x_of_memcpy_by_stage") or {}
    memcpy = row.get("memcpy_gib_per_s")
    header = f"{'stage':<14}{'copies/B':>10}{'busy s':>9}{'x of memcpy':>13}"
    lines = [
        f"{row['method']} by stage (busy: while under way, summed over workers; x of memcpy: "
        "thread time per byte over a plain copy's, "
        + (f"{memcpy:.2f} GiB/s on each worker, all at once;" if memcpy else "not measured;")
        + " send waits for the peer, receive is the comm's)",
        header,
        "-" * len(header),
    ]
    for stage, ratio in copies.items():
        if not ratio and not busy.get(stage):
            continue
        x = times.get(stage)
        lines.append(
            f"{stage:<14}{ratio:>10.2f}{busy.get(stage, 0.0):>9.2f}"
            + (f"{x:>13.1f}" if x else f"{'-':>13}")
        )
    return "\n".join(lines)


def write_json(path: str, results: Sequence[Result], context: dict[str, Any]) -> None:
    records = []
    for r in results:
        record = asdict(r)
        del record["rss_timelines"], record["breakdowns"]
        records.append(
            {
                **record,
                "gib_per_s": r.gib_per_s,
                "left_behind_bytes": r.left_behind_bytes,
                "copies_per_byte": r.copies_per_byte,
                "x_of_memcpy": r.x_of_memcpy,
                "machine": context["machine"],
            }
        )
    with open(path, "w") as f:
        json.dump(records, f, indent=2)
