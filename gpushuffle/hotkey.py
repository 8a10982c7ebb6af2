"""The hot-key boundary: shuffles with a growing share of rows on one key,
at a fixed worker memory, each in a fresh cluster.

``gpushuffle bench --skew 0.6:0.95:0.05 --worker-memory 1GiB`` runs it.  For
each share and run it records whether the hot output partition was built or
refused (:class:`~gpushuffle.ShuffleOutputTooLargeError`), how many workers
were restarted (distributed's Nanny kills a worker over 95% of its limit)
and the largest worker's peak RSS against its limit: the same share must get
the same verdict every run, and no run may restart a worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SweepPoint:
    method: str
    share: float
    run: int
    #: "built", "refused" (ShuffleOutputTooLargeError) or "failed" (anything else).
    verdict: str
    restarts: int
    wall_s: float
    #: The largest worker's peak RSS, and each worker's memory limit.
    peak_bytes: int
    limit_bytes: int
    #: Rows of the largest output partition (built runs only).
    hot_rows: int | None
    error: str | None = None


def parse_shares(text: str) -> tuple[float, ...]:
    """``"0.7"``, ``"0.6,0.8"`` or ``"0.6:0.95:0.05"`` (start, stop, step; stop included)."""
    try:
        if ":" in text:
            start, stop, step = (float(x) for x in text.split(":"))
            if step <= 0:
                raise ValueError
            count = round((stop - start) / step) + 1
            shares = tuple(round(start + i * step, 6) for i in range(count))
        else:
            shares = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not a share, a list of shares or START:STOP:STEP") from None
    if not shares:
        raise ValueError(f"{text!r}: no shares from START to STOP")
    if any(not 0.0 <= s <= 1.0 for s in shares):
        raise ValueError(f"{text!r}: shares are between 0 and 1")
    return shares


def run_skew_sweep(
    shares: Sequence[float],
    *,
    worker_memory: str,
    rows: int,
    columns: int,
    partitions: int,
    workers: int = 2,
    threads: int = 1,
    methods: Sequence[str] = ("gpushuffle",),
    repeat: int = 1,
    dtypes: str = "numeric",
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Each share, ``repeat`` times per method, in a fresh cluster of Nanny
    workers with ``worker_memory`` each and no retries
    (``distributed.scheduler.allowed-failures`` 0: a restart fails the run)."""
    import dask
    from dask.utils import parse_bytes
    from distributed import Client

    import gpushuffle
    from gpushuffle.bench import (
        _output_summary,
        _start_sampler,
        _stop_sampler,
        benchmark_cluster,
        generated_frame,
    )

    limit = int(parse_bytes(worker_memory))
    points: list[SweepPoint] = []
    for run in range(repeat):
        for share in shares:
            df = generated_frame(rows, partitions, columns, dtypes, share)
            for method in methods:
                with (
                    dask.config.set({"distributed.scheduler.allowed-failures": 0}),
                    benchmark_cluster(workers, threads, memory_limit=worker_memory) as cluster,
                    Client(cluster) as client,
                ):
                    client.run(_start_sampler)
                    before = set(client.nthreads())
                    start = time.perf_counter()
                    error: str | None = None
                    hot_rows: int | None = None
                    try:
                        summary = (
                            df.shuffle("key", npartitions=partitions, shuffle_method=method)
                            .map_partitions(_output_summary, meta=_output_summary(df._meta))
                            .compute()
                        )
                        verdict, hot_rows = "built", int(summary["rows"].max())
                    except gpushuffle.ShuffleOutputTooLargeError as e:
                        verdict, error = "refused", _verdict_text(e)
                    except Exception as e:  # a failed run is a point too
                        verdict, error = "failed", f"{type(e).__name__}: {e}"[:300]
                    wall = time.perf_counter() - start
                    client.wait_for_workers(workers, timeout=300)
                    after = set(client.nthreads())
                    samples = [s for s in client.run(_stop_sampler).values() if s is not None]
                point = SweepPoint(
                    method=method,
                    share=share,
                    run=run,
                    verdict=verdict,
                    restarts=len(after - before),
                    wall_s=wall,
                    peak_bytes=max((s["peak"] for s in samples), default=0),
                    limit_bytes=limit,
                    hot_rows=hot_rows,
                    error=error,
                )
                points.append(point)
                if on_point is not None:
                    on_point(point)
    return points


def _verdict_text(error: Exception) -> str:
    """The error from its partition on: no shuffle id or worker address."""
    text = str(error)
    at = text.find("output partition")
    return text[at:] if at >= 0 else text


def summarize_sweep(points: Sequence[SweepPoint]) -> list[dict[str, Any]]:
    """Per method and share: the verdicts seen, restarts, the highest peak."""
    rows: dict[tuple[str, float], list[SweepPoint]] = {}
    for p in points:
        rows.setdefault((p.method, p.share), []).append(p)
    return [
        {
            "method": method,
            "share": share,
            "runs": len(ps),
            "verdicts": sorted({p.verdict for p in ps}),
            "restarts": sum(p.restarts for p in ps),
            "peak_of_limit": max(p.peak_bytes for p in ps) / ps[0].limit_bytes,
        }
        for (method, share), ps in rows.items()
    ]


def format_sweep(summary: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'method':<11}{'share':>7}{'runs':>6}  {'verdict':<16}{'restarts':>9}{'peak':>8}"]
    for s in summary:
        verdict = "/".join(s["verdicts"])
        lines.append(
            f"{s['method']:<11}{s['share']:>7.2f}{s['runs']:>6}  {verdict:<16}"
            f"{s['restarts']:>9}{s['peak_of_limit']:>8.0%}"
        )
    flips = [s for s in summary if len(s["verdicts"]) > 1]
    restarts = sum(s["restarts"] for s in summary)
    lines.append(
        f"{len(flips)} share(s) with more than one verdict, {restarts} restart(s); "
        "peak: the largest worker's RSS against its memory limit"
    )
    return "\n".join(lines)
