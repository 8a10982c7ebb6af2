"""Shuffle methods side by side on the caller's own cluster and data.

:func:`compare` runs the same computation (a shuffle, a merge, a groupby
with ``split_out``) once per method and repeat, times it, checks that every
method put the same rows in each output partition (:func:`partition_checksums`)
and reads how long gpushuffle's stages were under way from the workers'
counters.  The :class:`Comparison` it returns shows as a table and a picture
in Jupyter; ``gpushuffle bench`` is the command-line benchmark on a cluster
of its own.
"""

from __future__ import annotations

import base64
import io
import statistics as stats
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from gpushuffle.engine.copies import STAGES


def _partition_checksum(part: Any, index: bool = True) -> pd.DataFrame:
    """Rows and an order-free checksum of one partition's rows (with their
    index labels, or without: ``index``)."""
    if not isinstance(part, pd.DataFrame | pd.Series) and hasattr(part, "to_pandas"):
        part = part.to_pandas()  # cuDF: hashed on the host, where pandas' hash is defined
    hashed = pd.util.hash_pandas_object(part, index=index).to_numpy()
    # uint64 addition wraps: a sum modulo 2**64, the same in any row order.
    checksum = int(hashed.sum(dtype=np.uint64)) if len(hashed) else 0
    return pd.DataFrame({"rows": [len(part)], "checksum": [checksum]})


def partition_checksums(collection: Any, index: bool = True) -> pd.DataFrame:
    """Each output partition's row count and checksum, one row per partition.

    The checksum is the sum of pandas' row hashes modulo 2**64: equal for two
    partitions with the same rows in any order, so two shuffles agree
    partition by partition when these frames are equal.  With ``index`` the
    rows' index labels count; pass ``index=False`` where the index only
    numbers the rows (a merge's output has a fresh RangeIndex, whose labels
    follow the order in which each method assembled the rows).
    """
    import dask

    parts = dask.compute(
        *[dask.delayed(_partition_checksum)(p, index) for p in collection.to_delayed()]
    )
    frame = (
        pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["rows", "checksum"])
    )
    return frame.rename_axis("partition").astype({"rows": "int64", "checksum": "uint64"})


@dataclass(frozen=True)
class MethodRun:
    """One timed run of one method."""

    method: str
    repeat: int
    wall_s: float
    rows: int
    #: Rows and checksum per output partition (:func:`partition_checksums`).
    checksums: pd.DataFrame = field(repr=False)
    #: Seconds each of gpushuffle's stages was under way, summed over workers
    #: (``busy_<stage>_ns`` of :func:`gpushuffle.statistics`); empty for others.
    stage_seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Comparison:
    """The runs of :func:`compare`; a table and a picture in Jupyter."""

    runs: tuple[MethodRun, ...]
    workers: int

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(r.method for r in self.runs))

    def _of(self, method: str) -> list[MethodRun]:
        return [r for r in self.runs if r.method == method]

    def same_results(self) -> bool:
        """Every run of every method put the same rows in each partition."""
        first = self.runs[0].checksums
        return all(r.checksums.equals(first) for r in self.runs[1:])

    def table(self) -> pd.DataFrame:
        """Per method: runs, median wall seconds, wall / the first method's, rows."""
        base = stats.median(r.wall_s for r in self._of(self.methods[0]))
        first = self.runs[0].checksums
        rows = []
        for method in self.methods:
            runs = self._of(method)
            wall = stats.median(r.wall_s for r in runs)
            rows.append(
                {
                    "method": method,
                    "runs": len(runs),
                    "wall_s": round(wall, 3),
                    f"x_{self.methods[0]}": round(wall / base, 2),
                    "rows": runs[0].rows,
                    "same_partitions": all(r.checksums.equals(first) for r in runs),
                }
            )
        return pd.DataFrame(rows).set_index("method")

    def stage_seconds(self) -> pd.Series:
        """gpushuffle's stages: median seconds under way per worker, per stage."""
        runs = [r for r in self.runs if r.stage_seconds]
        if not runs:
            return pd.Series(dtype="float64", name="seconds per worker")
        per_stage = {
            stage: stats.median(r.stage_seconds.get(stage, 0.0) for r in runs) / self.workers
            for stage in STAGES
        }
        return pd.Series({s: v for s, v in per_stage.items() if v > 0}, name="seconds per worker")

    def plot(self, ax: Any = None) -> Any:
        """Wall time per method beside where gpushuffle's time went (a matplotlib Figure)."""
        from gpushuffle.plot import require_matplotlib

        require_matplotlib()
        import matplotlib.pyplot as plt

        stages = self.stage_seconds()
        if ax is None:
            fig, axes = plt.subplots(1, 2 if len(stages) else 1, figsize=(10, 3.2), squeeze=False)
            wall_ax, stage_ax = axes[0][0], (axes[0][1] if len(stages) else None)
        else:
            fig, wall_ax, stage_ax = ax.figure, ax, None
        table = self.table()
        wall_ax.barh(table.index[::-1], table["wall_s"][::-1], color="tab:blue")
        for y, wall in enumerate(table["wall_s"][::-1]):
            wall_ax.annotate(
                f"{wall:.2f} s", (wall, y), xytext=(3, 0), textcoords="offset points", va="center"
            )
        wall_ax.set_xlabel("wall seconds (median)")
        wall_ax.set_title("the same computation, each method")
        if stage_ax is not None:
            stage_ax.barh(stages.index[::-1], stages.to_numpy()[::-1], color="tab:green")
            stage_ax.set_xlabel("seconds under way, per worker (median)")
            stage_ax.set_title("where gpushuffle's time went")
        fig.tight_layout()
        plt.close(fig)  # shown by Jupyter's display of the figure, not twice
        return fig

    def __repr__(self) -> str:
        return f"Comparison on {self.workers} workers\n{self.table().to_string()}"

    def _repr_html_(self) -> str:
        html = self.table().to_html()
        verdict = (
            "the same rows in every partition" if self.same_results() else "DIFFERENT partitions"
        )
        html += f"<p>{self.workers} workers; every method put {verdict}.</p>"
        try:
            figure = self.plot()
        except ImportError:
            return html
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=90)
        png = base64.b64encode(buffer.getvalue()).decode()
        return html + f'<img src="data:image/png;base64,{png}" alt="wall time per method"/>'


def _held(dask_scheduler: Any, keys: list[Any]) -> list[Any]:
    """Which of ``keys`` the scheduler still knows (in memory or on their way)."""
    return [k for k in keys if k in dask_scheduler.tasks]


def _output_keys(collection: Any) -> list[Any]:
    from dask.core import flatten

    return list(flatten(collection.__dask_keys__()))


def _wait_forgotten(client: Any, keys: list[Any], timeout: float = 30.0) -> list[Any]:
    """Released results leave the scheduler asynchronously: wait, so that the
    next run computes its own instead of finding these; return those still held."""
    deadline = time.monotonic() + timeout
    while (held := client.run_on_scheduler(_held, keys=keys)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


def _stage_ns(client: Any) -> dict[str, int]:
    from gpushuffle.api import statistics

    frame = statistics(client)
    return {s: int(frame[f"busy_{s}_ns"].sum()) for s in STAGES if f"busy_{s}_ns" in frame}


def compare(
    compute: Callable[[str], Any],
    methods: Sequence[str] = ("gpushuffle", "p2p"),
    *,
    repeat: int = 1,
    client: Any = None,
    index: bool = True,
) -> Comparison:
    """Run ``compute(method)`` for each method, ``repeat`` times, alternating.

    ``compute`` returns a dask collection that uses the shuffle method it is
    given, for example ``lambda m: left.merge(right, on="k", shuffle_method=m)``
    (with ``index=False``: a merge's index only numbers its rows, see
    :func:`partition_checksums`).
    Each run is persisted and waited for (the wall time), then its partitions
    are checksummed (not timed) and released.  Check the answers with
    :meth:`Comparison.same_results`.
    """
    from distributed import default_client

    if not methods:
        raise ValueError("compare: name at least one shuffle method, e.g. ('gpushuffle', 'p2p')")
    if repeat < 1:
        raise ValueError(f"compare: repeat={repeat}; run each method at least once")
    client = client or default_client()
    with client.as_current():  # persist, wait and the checksums on this client
        runs = _run_all(client, compute, methods, repeat, index)
    workers = len(client.nthreads())
    return Comparison(runs=tuple(runs), workers=workers)


def _run_all(
    client: Any, compute: Callable[[str], Any], methods: Sequence[str], repeat: int, index: bool
) -> list[MethodRun]:
    from distributed import wait

    runs = []
    for i in range(repeat):
        for method in methods:
            # The keys a persist would compute are those of the optimized graph.
            collection = compute(method)
            if hasattr(collection, "optimize"):  # dask's DataFrame collections
                collection = collection.optimize()
            keys = _output_keys(collection)
            # This client's futures (a collection persisted here) are known at
            # once; the scheduler also knows other clients', and a result
            # released just before may take a moment to leave it.
            mine = [k for k in keys if k in client.futures]
            if held := mine or _wait_forgotten(client, keys, timeout=2.0):
                raise ValueError(
                    f"compare: the cluster already holds the result of compute({method!r})"
                    f" (key {held[0]!r}, persisted earlier?), so it would not run again:"
                    " release it first (del the persisted collection)"
                )
            before = _stage_ns(client) if method == "gpushuffle" else {}
            start = time.perf_counter()
            result = collection.persist()
            wait(result)
            wall = time.perf_counter() - start
            after = _stage_ns(client) if method == "gpushuffle" else {}
            checksums = partition_checksums(result, index)
            del result, collection
            if still := _wait_forgotten(client, keys):
                raise RuntimeError(
                    f"compare: {len(still)} results of compute({method!r}) were still held"
                    f" 30 s after their release (key {still[0]!r}); another client holds them?"
                )
            runs.append(
                MethodRun(
                    method=method,
                    repeat=i,
                    wall_s=wall,
                    rows=int(checksums["rows"].sum()),
                    checksums=checksums,
                    stage_seconds={s: (after[s] - before.get(s, 0)) / 1e9 for s in after},
                )
            )
    return runs
