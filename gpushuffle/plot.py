"""The picture of a benchmark: ``gpushuffle bench --plot PATH.png``.

Panels: median wall time per method (each run as a dot); median peak RSS of
the largest worker per method; every worker's RSS over the median run of each
method; the largest worker's RSS around the barrier (where the unpack phase
starts) for the P2P-based methods, on one time axis; and, for gpushuffle and
``p2p``, what the shuffle held on that worker over the run (store tiers, pool,
split buffers, comm backlog) beside its RSS.  Needs matplotlib (``pip install 'gpushuffle[plot]'``);
draws with the Agg canvas, so no display is needed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import IO, Any

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


def plot_benchmark(
    results: Sequence[Result], context: dict[str, Any], path: str | IO[bytes]
) -> None:
    """Draw ``results`` (from :func:`gpushuffle.bench.run_benchmark`) into ``path``
    (a PNG file, or a binary file object)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    summary = summarize(results)
    methods = [s["method"] for s in summary]
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    runs = {m: [r for r in results if r.method == m] for m in methods}

    fig = Figure(figsize=(12, 15), layout="constrained")
    fig.suptitle(title(context), fontsize=10)
    grid = fig.add_gridspec(4, 2, height_ratios=[1, 1.1, 1.1, 1.2])
    ax_wall = fig.add_subplot(grid[0, 0])
    ax_peak = fig.add_subplot(grid[0, 1])
    ax_time = fig.add_subplot(grid[1, :])
    ax_barrier = fig.add_subplot(grid[2, :])

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
        largest = _largest(run)
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

    _plot_around_barrier(ax_barrier, runs, colors)

    shown = [m for m in ("gpushuffle", "p2p") if m in runs and _has_breakdown(median_run(runs[m]))]
    for i, m in enumerate(shown):
        ax = fig.add_subplot(grid[3, i] if len(shown) > 1 else grid[3, :])
        _plot_breakdown(ax, m, median_run(runs[m]))

    fig.savefig(path, dpi=110, metadata={"Description": json.dumps(context["versions"])})


#: Components of :func:`gpushuffle.engine.footprint.memory_breakdown` drawn per
#: method, with their labels.  ``store_disk`` is not memory: drawn dashed.
_PARTS: dict[str, list[tuple[str, tuple[str, ...], str]]] = {
    "gpushuffle": [
        ("store, host tier (received + local shards)", ("store_host",), "C0"),
        ("store, on disk (not in RSS)", ("store_disk",), "C0"),
        ("split buffers in use (local part also in store)", ("pool_split",), "C2"),
        ("comm backlog: waiting to be sent", ("comm_out",), "C1"),
        ("comm backlog: received, waiting for the store", ("waiting",), "C3"),
        ("pool: free blocks", ("pool_free",), "C4"),
        ("pool: outputs and reads in use", ("pool_unpack", "pool_read"), "C5"),
    ],
    "p2p": [
        ("comm buffer: waiting to be sent", ("comm_out",), "C1"),
        ("disk buffer: received, not yet on disk", ("p2p_buffer",), "C3"),
    ],
}


def _largest(run: Result) -> str:
    timelines = run.rss_timelines
    return max(timelines, key=lambda w: max(rss for _, rss in timelines[w]))


def _has_breakdown(run: Result) -> bool:
    return bool(run.breakdowns) and any(run.breakdowns.values())


def _barrier_time(run: Result, worker: str) -> float | None:
    """When ``worker`` first saw its run past the barrier (the unpack phase)."""
    samples = run.rss_timelines[worker]
    for (t, _), parts in zip(samples, run.breakdowns.get(worker, []), strict=False):
        if parts.get("phase", 0) >= 2:
            return t
    return None


def _plot_around_barrier(ax: Any, runs: dict[str, list[Result]], colors: dict[str, str]) -> None:
    """RSS growth of the largest worker with time 0 at its barrier, per method."""
    drawn = False
    for m, rs in runs.items():
        run = median_run(rs)
        if not run.rss_timelines or not _has_breakdown(run):
            continue
        worker = _largest(run)
        barrier = _barrier_time(run, worker)
        if barrier is None:
            continue
        samples = run.rss_timelines[worker]
        base = samples[0][1]
        ax.plot(
            [t - barrier for t, _ in samples],
            [(rss - base) / GIB for _, rss in samples],
            color=colors[m],
            linewidth=1.6,
            label=f"{m} (RSS at start: {base / GIB:.2f} GiB)",
        )
        drawn = True
    ax.axvline(0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xlabel("seconds from the barrier (left: transfer, right: unpack)")
    ax.set_ylabel("RSS above the run's start (GiB)")
    ax.set_title(
        "Around the unpack phase: largest worker of the median run, aligned at its barrier"
    )
    if drawn:
        ax.legend(loc="upper left")
    ax.grid(alpha=0.3)


def _plot_breakdown(ax: Any, method: str, run: Result) -> None:
    """What ``method``'s shuffle held on the largest worker, beside its RSS."""
    worker = _largest(run)
    samples = run.rss_timelines[worker]
    parts = run.breakdowns[worker]
    ts = [t for t, _ in samples]
    base = samples[0][1]
    ax.plot(
        ts,
        [(rss - base) / GIB for _, rss in samples],
        color="black",
        linewidth=1.6,
        label="RSS above the run's start",
    )
    for label, keys, color in _PARTS.get(method, []):
        values = [sum(p.get(k, 0) for k in keys) / GIB for p in parts]
        if not any(values):
            continue
        style = "--" if keys == ("store_disk",) else "-"
        linestyle = style if keys != ("pool_free",) else ":"
        ax.plot(
            ts[: len(values)], values, color=color, linewidth=1.1, linestyle=linestyle, label=label
        )
    barrier = _barrier_time(run, worker)
    if barrier is not None:
        ax.axvline(barrier, color="black", linewidth=0.8, linestyle=":")
    ax.set_xlabel("seconds since the run started (dotted: barrier)")
    ax.set_ylabel("GiB")
    ax.set_title(f"{method}: what the shuffle held on the largest worker (median run)", fontsize=10)
    ax.legend(loc="upper left", fontsize=7)
    ax.grid(alpha=0.3)
