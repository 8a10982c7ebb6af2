"""TPC-H benchmark: join-heavy queries with gpushuffle, p2p and tasks in one run.

``python -m benchmarks.tpch --data /tmp/tpch-sf1`` generates the data with
``tpchgen-cli`` (Parquet, ``--parts`` files per table) unless it is there,
starts a ``LocalCluster`` (2 workers x 1 thread by default), reads every
table with ``dd.read_parquet`` and persists it, then runs each query with
each method in turn (``dataframe.shuffle.method`` set for the query: joins,
groupby ``split_out``, ``set_index``, ``sort_values`` and
``drop_duplicates`` all take it): once untimed per method (a warm-up,
recorded but left out of the medians; ``--no-warmup`` skips it), then
``--repeat`` rounds, checking every result against DuckDB on the same
files.  Writes JSON (every run, and medians with
ratios) and, with ``--plot``, a picture.  Needs the ``bench`` extra.

Timings are wall-clock seconds of ``compute()`` of the query; peak RSS is
the largest worker's, sampled on the workers every 20 ms during the query.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.tpch_queries import QUERIES, TPCH, compare, duckdb_results

TABLES = ("customer", "lineitem", "nation", "orders", "part", "partsupp", "region", "supplier")
METHODS = ("gpushuffle", "p2p", "tasks")


def generate(data: str, scale: float, parts: int) -> None:
    """Write the TPC-H tables as Parquet with tpchgen-cli, ``parts`` files each."""
    if all(os.path.isdir(os.path.join(data, t)) for t in TABLES):
        return
    subprocess.run(
        [_tpchgen(), "parquet", "-s", str(scale), "--parts", str(parts), "-o", data], check=True
    )


def generate_table(data: str, table: str, scale: float, parts: int) -> None:
    """Write one TPC-H table under ``data/table`` (unless it is there)."""
    if os.path.isdir(os.path.join(data, table)):
        return
    command = [_tpchgen(), "parquet", "-s", f"{scale:.6f}", "--tables", table]
    subprocess.run([*command, "--parts", str(parts), "-o", data], check=True)


def _tpchgen() -> str:
    exe = shutil.which("tpchgen-cli") or os.path.join(
        os.path.dirname(sys.executable), "tpchgen-cli"
    )
    if not os.path.exists(exe):
        raise SystemExit("tpchgen-cli not found: pip install -e '.[bench]'")
    return exe


def run(
    data: str,
    queries: list[str],
    methods: list[str],
    repeat: int,
    workers: int,
    threads: int,
    on_result: Any = print,
    warmup: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import dask
    import dask.dataframe as dd
    from distributed import Client, wait

    import gpushuffle  # noqa: F401  (registers the method)
    from gpushuffle.bench import (
        _collect,
        _scheduler_task_count,
        _start_sampler,
        _stop_sampler,
        _wait_until_released,
        benchmark_cluster,
        machine_description,
        versions,
    )

    truth = duckdb_results(data, queries)
    records: list[dict[str, Any]] = []
    with (
        dask.config.set({"distributed.worker.memory.terminate": False}),
        benchmark_cluster(workers, threads) as cluster,
        Client(cluster) as client,
    ):
        tables = {t: dd.read_parquet(os.path.join(data, t)).persist() for t in TABLES}
        wait(list(tables.values()))
        baseline_rss = max(
            client.run(lambda: __import__("psutil").Process().memory_info().rss).values()
        )
        baseline_tasks = client.run_on_scheduler(_scheduler_task_count)
        for query in queries:
            # A worker's first query pays for fresh memory (Arrow's and
            # malloc's pages, gpushuffle's pool) whichever method runs it:
            # measured on TPC-H SF1, lineitem x orders took 3.8-4.3 s first
            # against 1.8-2.9 s afterwards for gpushuffle and tasks alike.
            # With ``warmup`` each method runs the query once, untimed in
            # the medians (recorded as ``warmup``), so that cost is not
            # charged to whichever method goes first.  Then methods take
            # turns, round by round, so that a change in the machine's load
            # (it is shared) falls on all of them alike.
            rounds = [(-1, m) for m in methods] if warmup else []
            rounds += [(r, m) for r in range(repeat) for m in methods]
            for r, method in rounds:
                # Before its first run gpushuffle's host pool is emptied:
                # that run pays for fresh memory, as in a new cluster.
                client.run(_collect, r == (-1 if warmup else 0))
                client.run(_start_sampler)
                start = time.perf_counter()
                with dask.config.set({"dataframe.shuffle.method": method}):
                    result = QUERIES[query](tables)
                wall = time.perf_counter() - start
                samples = client.run(_stop_sampler)
                _wait_until_released(client, baseline_tasks)
                compare(query, result, truth[query])  # raises if wrong
                record = {
                    "query": query,
                    "method": method,
                    "repeat": r,
                    "warmup": r < 0,
                    "wall_s": wall,
                    "peak_worker_rss_bytes": max(s["peak"] for s in samples.values()),
                    "checked_against_duckdb": True,
                }
                records.append(record)
                on_result(
                    f"{query:<18}{method:<12}{'warm' if r < 0 else r:>4}{wall:>9.2f} s"
                    f"{record['peak_worker_rss_bytes'] / 2**30:>8.2f} GiB"
                )
        context = {
            "data": os.path.abspath(data),
            "workers": workers,
            "threads_per_worker": threads,
            "repeat": repeat,
            "warmup": warmup,
            "partitions": {t: tables[t].npartitions for t in TABLES},
            "dtypes_as_read": {
                t: {c: str(d) for c, d in tables[t].dtypes.items()} for t in ("lineitem", "orders")
            },
            "baseline_worker_rss_bytes": baseline_rss,
            "machine": machine_description(),
            "versions": versions(),
        }
    return records, context


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median wall time and peak RSS per query and method, with ratios to gpushuffle."""
    out = []
    queries = list(dict.fromkeys(r["query"] for r in records))
    for query in queries:
        runs = [r for r in records if r["query"] == query and not r.get("warmup")]
        warmups = {
            r["method"]: r["wall_s"] for r in records if r["query"] == query and r.get("warmup")
        }
        medians = {
            m: statistics.median(r["wall_s"] for r in runs if r["method"] == m)
            for m in dict.fromkeys(r["method"] for r in runs)
        }
        peaks = {
            m: statistics.median(r["peak_worker_rss_bytes"] for r in runs if r["method"] == m)
            for m in medians
        }
        row: dict[str, Any] = {"query": query, "tpch": query in TPCH}
        for m in medians:
            row[f"{m}_s"] = medians[m]
            row[f"{m}_peak_rss_bytes"] = peaks[m]
            if m in warmups:
                row[f"{m}_warmup_s"] = warmups[m]
            if "gpushuffle" in medians and m != "gpushuffle":
                row[f"{m}_over_gpushuffle"] = medians[m] / medians["gpushuffle"]
        out.append(row)
    return out


def totals(summary: list[dict[str, Any]], methods: list[str]) -> dict[str, float]:
    """Sum of the medians of the TPC-H entries, per method."""
    return {
        m: sum(row[f"{m}_s"] for row in summary if row["tpch"] and f"{m}_s" in row) for m in methods
    }


def format_summary(summary: list[dict[str, Any]], methods: list[str]) -> str:
    header = f"{'query':<18}" + "".join(f"{m + ' s':>14}" for m in methods)
    header += "".join(f"{m + '/gs':>10}" for m in methods if m != "gpushuffle")
    lines = [header, "-" * len(header)]
    for row in summary:
        line = f"{row['query']:<18}" + "".join(f"{row[f'{m}_s']:>14.2f}" for m in methods)
        line += "".join(
            f"{row[f'{m}_over_gpushuffle']:>10.2f}" for m in methods if m != "gpushuffle"
        )
        lines.append(line)
    total = totals(summary, methods)
    if not total.get("gpushuffle"):
        return "\n".join(lines)
    line = f"{'total (TPC-H)':<18}" + "".join(f"{total[m]:>14.2f}" for m in methods)
    line += "".join(
        f"{total[m] / total['gpushuffle']:>10.2f}" for m in methods if m != "gpushuffle"
    )
    lines.append(line)
    return "\n".join(lines)


def plot(
    summary: list[dict[str, Any]], methods: list[str], context: dict[str, Any], path: str
) -> None:
    """Median wall time per query and method (top), median peak worker RSS (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [row["query"] for row in summary]
    x = np.arange(len(names))
    width = 0.8 / len(methods)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    for k, m in enumerate(methods):
        offset = (k - (len(methods) - 1) / 2) * width
        bars = top.bar(x + offset, [row[f"{m}_s"] for row in summary], width, label=m)
        top.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
        peaks = [row[f"{m}_peak_rss_bytes"] / 2**30 for row in summary]
        bars = bottom.bar(x + offset, peaks, width, label=m)
        bottom.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
    top.set_ylabel(f"wall seconds (median of {context['repeat']})")
    bottom.set_ylabel("peak RSS of the largest worker, GiB")
    bottom.set_xticks(x, names, rotation=20)
    versions = context.get("versions", {})
    top.set_title(
        f"TPC-H SF{context.get('scale', 1):g} (tpchgen-cli Parquet) on dask "
        f"{versions.get('dask', '')}, pandas {versions.get('pandas', '')}: "
        f"{context['workers']} workers x {context['threads_per_worker']} thread, "
        f"persisted inputs\n{context['machine']}; results checked against DuckDB",
        fontsize=9,
    )
    top.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tpch", description=__doc__)
    parser.add_argument(
        "--data", default="/tmp/tpch-sf1", help="Parquet directory (generated if missing)"
    )
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--parts", type=int, default=8, help="files per table")
    parser.add_argument("--queries", default=",".join(QUERIES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="time every run: without it each method first runs each query once, untimed",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write every run and the medians here")
    parser.add_argument("--plot", default=None, help="write a bar chart of the medians here")
    parser.add_argument(
        "--replot", default=None, metavar="JSON", help="only draw --plot from a result file"
    )
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        methods = [m for m in METHODS if f"{m}_s" in saved["summary"][0]]
        plot(saved["summary"], methods, saved["context"], args.plot or "tpch.png")
        return 0
    queries = args.queries.split(",")
    unknown = [q for q in queries if q not in QUERIES]
    if unknown:
        parser.error(f"unknown queries {unknown}; known: {list(QUERIES)}")
    methods = args.methods.split(",")
    generate(args.data, args.scale, args.parts)
    records, context = run(
        args.data, queries, methods, args.repeat, args.workers, args.threads, warmup=args.warmup
    )
    context["scale"] = args.scale
    summary = summarize(records)
    print(format_summary(summary, methods))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "context": context,
                    "summary": summary,
                    "totals_tpch_s": totals(summary, methods),
                    "runs": records,
                },
                f,
                indent=2,
            )
    if args.plot:
        plot(summary, methods, context, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
