"""The picture of a benchmark: ``gpushuffle bench --plot PATH.png``.

Three panels: median wall time per method (each run as a dot), median peak
RSS of the largest worker per method, and every worker's RSS over the median
run of each method.  Needs matplotlib (``pip install 'gpushuffle[plot]'``);
draws with the Agg canvas, so no display is needed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gpushuffle.bench import Result, summarize

GIB = 2**30
#: Value labels inside the bars, clear of the per-run dots above them.
_INSIDE: dict[str, Any] = {"label_type": "center", "color": "white", "fontweight": "bold"}


def require_matplotlib() -> None:
    """Raise ImportError with the install command if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'gpushuffle[plot]'") from e


def median_run(runs: Sequence[Result]) -> Result:
    """The run whose wall time is the (lower) median of ``runs``."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    return ordered[(len(ordered) - 1) // 2]


def title(context: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {v}" for name, v in context["versions"].items())
    return (
        f"gpushuffle bench: {context['rows']:,} rows x {context['columns']} columns, "
        f"{context['partitions']} partitions, {context['input_bytes'] / GIB:.2f} GiB; "
        f"{context['workers']} workers x {context['threads_per_worker']} "
        f"thread{'s' if context['threads_per_worker'] != 1 else ''} over "
        f"{context['protocol']}\n{context['machine']}\n{versions}"
    )


def plot_benchmark(results: Sequence[Result], context: dict[str, Any], path: str) -> None:
    """Draw ``results`` (from :func:`gpushuffle.bench.run_benchmark`) into ``path``."""
    require_matplotlib()
    from matplotlib.figure import Figure

    summary = summarize(results)
    methods = [s["method"] for s in summary]
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    runs = {m: [r for r in results if r.method == m] for m in methods}

    fig = Figure(figsize=(12, 8.5), layout="constrained")
    fig.suptitle(title(context), fontsize=10)
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.2])
    ax_wall = fig.add_subplot(grid[0, 0])
    ax_peak = fig.add_subplot(grid[0, 1])
    ax_time = fig.add_subplot(grid[1, :])

    x = list(range(len(methods)))
    wall = [s["wall_s"] for s in summary]
    bars = ax_wall.bar(x, wall, color=[colors[m] for m in methods])
    ax_wall.bar_label(bars, labels=[f"{w:.2f} s" for w in wall], **_INSIDE)
    for i, m in enumerate(methods):
        walls = [r.wall_s for r in runs[m]]
        if len(walls) > 1:
            ax_wall.plot([i] * len(walls), walls, "o", color="black", markersize=4, zorder=3)
    ax_wall.set_xticks(x, methods)
    ax_wall.set_ylabel("wall time (s)")
    nruns = max(len(r) for r in runs.values())
    ax_wall.set_title(
        "Wall time, median" + (f" of {nruns} runs (dots: each run)" if nruns > 1 else "")
    )

    peak = [s["peak_worker_rss_bytes"] / GIB for s in summary]
    bars = ax_peak.bar(x, peak, color=[colors[m] for m in methods])
    ax_peak.bar_label(bars, labels=[f"{p:.2f} GiB" for p in peak], **_INSIDE)
    ax_peak.set_xticks(x, methods)
    ax_peak.set_ylabel("GiB")
    ax_peak.set_title("Peak RSS of the largest worker, median")

    for m in methods:
        run = median_run(runs[m])
        timelines = run.rss_timelines
        if not timelines:
            continue
        largest = max(timelines, key=lambda w: max(rss for _, rss in timelines[w]))
        for worker, samples in sorted(timelines.items()):
            ts = [t for t, _ in samples]
            gib = [rss / GIB for _, rss in samples]
            if worker == largest:
                ax_time.plot(ts, gib, color=colors[m], linewidth=1.8, label=m)
            else:
                ax_time.plot(ts, gib, color=colors[m], linewidth=0.8, alpha=0.45)
    ax_time.set_xlabel("seconds since the run started")
    ax_time.set_ylabel("worker RSS (GiB)")
    ax_time.set_title(
        "Worker memory over the median run of each method "
        "(thick: the largest worker, thin: the others; sampled every 20 ms)"
    )
    ax_time.set_ylim(bottom=0)
    ax_time.set_xlim(left=0)
    if ax_time.lines:
        ax_time.legend(loc="upper right")
    ax_time.grid(alpha=0.3)

    fig.savefig(path, dpi=110, metadata={"Description": json.dumps(context["versions"])})
