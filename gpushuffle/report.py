"""``gpushuffle bench`` from Python, for a notebook: :func:`benchmark` runs
it and returns a :class:`BenchmarkReport`, which Jupyter shows as the
medians' table and the benchmark's picture.

A module of its own: it uses both :mod:`gpushuffle.bench` (the runs) and
:mod:`gpushuffle.plot` (the picture), and the plot uses the bench.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import pandas as pd

from gpushuffle.bench import Result, format_table, run_benchmark, summarize
from gpushuffle.plot import plot_benchmark


@dataclass(frozen=True)
class BenchmarkReport:
    """What :func:`run_benchmark` measured, shown in Jupyter as a table (the
    medians per method) and the benchmark's picture (``gpushuffle bench --plot``)."""

    results: tuple[Result, ...]
    context: dict[str, Any]

    def table(self) -> pd.DataFrame:
        """Per method: runs, median wall seconds, ratio to gpushuffle, peak and spill."""
        rows = [
            {
                "method": s["method"],
                "runs": s["runs"],
                "failed": s["failed"],
                "wall_s": round(s["wall_s"], 3),
                "x_gpushuffle": round(s["vs_gpushuffle"], 2),
                "GiB_per_s": round(s["gib_per_s"], 3),
                "peak_rss_GiB": round(s["peak_worker_rss_bytes"] / 2**30, 2),
                "spilled_GiB": round(s["spilled_bytes"] / 2**30, 2),
                "same_partitions_as": ", ".join(s["same_partitions_as"] or []),
            }
            for s in summarize(self.results)
        ]
        return pd.DataFrame(rows).set_index("method")

    def __repr__(self) -> str:
        return format_table(summarize(self.results))

    def _repr_html_(self) -> str:
        html = self.table().to_html()
        try:
            buffer = io.BytesIO()
            plot_benchmark(self.results, self.context, buffer)
        except ImportError:  # matplotlib not installed: the table alone
            return html
        png = base64.b64encode(buffer.getvalue()).decode()
        return html + f'<img src="data:image/png;base64,{png}" alt="gpushuffle bench"/>'


def benchmark(**options: Any) -> BenchmarkReport:
    """:func:`run_benchmark` (same options) for a notebook: a cluster of its
    own, each method in turn; the results as a :class:`BenchmarkReport`."""
    results, context = run_benchmark(**options)
    return BenchmarkReport(tuple(results), context)
