"""Beyond one host: gpushuffle beside ``p2p`` across shaped links, and as workers are added.

``python -m benchmarks.hosts link``: hosts of the rig (:mod:`benchmarks.rig`,
root only), each host's link shaped to each ``--rates``; per run the wall
time, the bytes the links carried per byte shuffled, and each link's
utilisation (bytes it sent / wall / rate).  ``python -m benchmarks.hosts
workers``: one host, 2 to 32 single-threaded workers; per run the wall time,
messages, connections and the engine's memory per worker, and the share of
shard bytes same-host reads carried.  Methods alternate run by run; the
input is generated inside the transfer tasks (nothing persisted first);
every run's output partitions are digested and compared between methods.
"""

from __future__ import annotations

import json
import statistics as stats
import time
from collections.abc import Sequence
from typing import Any

import click

from gpushuffle import bench

METHODS = ("gpushuffle", "p2p")


def _run_once(df: Any, method: str) -> tuple[float, str]:
    start = time.perf_counter()
    summary = (
        df.shuffle(on="key", shuffle_method=method)
        .map_partitions(bench._output_summary, meta=bench._output_summary(df._meta))
        .compute()
    )
    return time.perf_counter() - start, bench._digest(summary)


def _engine_counters(client: Any) -> Any:
    import gpushuffle

    return gpushuffle.statistics(client)


def _connections() -> int:
    """This worker's established TCP connections."""
    import psutil

    return sum(c.status == "ESTABLISHED" for c in psutil.Process().net_connections("tcp"))


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def link_runs(
    rates: Sequence[str],
    hosts: Sequence[int],
    rows: int,
    columns: int,
    partitions: int,
    repeat: int,
) -> list[dict[str, Any]]:
    from distributed import Client

    from benchmarks.rig import Rig, link_bits

    results = []
    for rate in rates:
        with Rig(hosts, rate=rate, memory_limit="4GiB") as rig, Client(rig.scheduler_address):
            df = bench.generated_frame(rows, partitions, columns)
            input_bytes = int(df.memory_usage(deep=True, index=True).sum().compute())
            for method in METHODS:  # warm both: imports, connections
                _run_once(bench.generated_frame(20_000, partitions, columns), method)
            for r in range(repeat):
                for method in METHODS if r % 2 == 0 else METHODS[::-1]:
                    before = [rig.link_bytes(h)[0] for h in range(len(hosts))]
                    wall, digest = _run_once(df, method)
                    sent = [rig.link_bytes(h)[0] - b for h, b in enumerate(before)]
                    row = {
                        "rate": rate,
                        "hosts": list(hosts),
                        "method": method,
                        "repeat": r,
                        "wall_s": wall,
                        "input_bytes": input_bytes,
                        "wire_bytes": sum(sent),
                        "wire_per_byte": sum(sent) / input_bytes,
                        "utilisation": [s / wall / (link_bits(rate) / 8) for s in sent],
                        "digest": digest,
                    }
                    results.append(row)
                    click.echo(
                        f"{rate:>8} {method:>10} #{r}: {wall:6.2f} s, wire/byte "
                        f"{row['wire_per_byte']:.2f}, link use "
                        + ", ".join(f"{u:.0%}" for u in row["utilisation"])
                    )
    return results


def worker_runs(
    counts: Sequence[int], rows: int, columns: int, partitions: int, repeat: int
) -> list[dict[str, Any]]:
    from distributed import Client

    results = []
    for workers in counts:
        with (
            bench.benchmark_cluster(workers, 1, memory_limit="2GiB") as cluster,
            Client(cluster) as c,
        ):
            df = bench.generated_frame(rows, partitions, columns)
            input_bytes = int(df.memory_usage(deep=True, index=True).sum().compute())
            for method in METHODS:
                _run_once(bench.generated_frame(20_000, partitions, columns), method)
            for r in range(repeat):
                for method in METHODS if r % 2 == 0 else METHODS[::-1]:
                    counters_before = _engine_counters(c)
                    rss_before = c.run(_rss)
                    wall, digest = _run_once(df, method)
                    counters = _engine_counters(c) - counters_before
                    connections = c.run(_connections)
                    rss_after = c.run(_rss)
                    row = {
                        "workers": workers,
                        "method": method,
                        "repeat": r,
                        "wall_s": wall,
                        "input_bytes": input_bytes,
                        "digest": digest,
                        "connections_per_worker": stats.median(connections.values()),
                        "rss_growth_per_worker": stats.median(
                            rss_after[w] - rss_before[w] for w in rss_after
                        ),
                    }
                    if method == "gpushuffle":
                        sent = counters["wire_bytes_sent"].sum()
                        row |= {
                            "messages": int(counters["wire_messages_sent"].sum()),
                            "same_host_share": float(counters["wire_bytes_lent"].sum() / sent)
                            if sent
                            else 0.0,
                            "store_peak_per_worker": int(counters["host_peak_bytes"].max()),
                            "pool_free_peak_per_worker": int(
                                counters["host_pool_bytes_free_peak"].max()
                            ),
                        }
                    results.append(row)
                    click.echo(
                        f"{workers:>3} workers {method:>10} #{r}: {wall:6.2f} s, "
                        f"{row['connections_per_worker']} connections per worker"
                        + (
                            f", {row['messages']} messages, same-host share "
                            f"{row['same_host_share']:.0%}"
                            if method == "gpushuffle"
                            else ""
                        )
                    )
    return results


def medians(results: Sequence[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    """Median wall per (``by``, method), the ratio p2p / gpushuffle, and
    whether the digests of every run of both methods agree."""
    table = []
    for value in dict.fromkeys(r[by] for r in results):
        runs = {m: [r for r in results if r[by] == value and r["method"] == m] for m in METHODS}
        wall = {m: stats.median(r["wall_s"] for r in runs[m]) for m in METHODS}
        row: dict[str, Any] = {by: value, **{f"{m}_s": wall[m] for m in METHODS}}
        row["p2p_over_gpushuffle"] = wall["p2p"] / wall["gpushuffle"]
        row["same_outputs"] = len({r["digest"] for m in METHODS for r in runs[m]}) == 1
        for m in METHODS:
            if "utilisation" in runs[m][0]:
                row[f"{m}_utilisation"] = stats.median(
                    stats.mean(r["utilisation"]) for r in runs[m]
                )
                row[f"{m}_wire_per_byte"] = stats.median(r["wire_per_byte"] for r in runs[m])
        table.append(row)
    return table


def _write(path: str | None, kind: str, results: Any, context: dict[str, Any]) -> None:
    summary = medians(results, "rate" if kind == "link" else "workers")
    for row in summary:
        click.echo(json.dumps(row, default=str))
    if path:
        with open(path, "w") as f:
            json.dump(
                {"kind": kind, "context": context, "summary": summary, "runs": results},
                f,
                indent=1,
                default=str,
            )


@click.group()
def main() -> None:
    """gpushuffle beside p2p across hosts and with many workers."""


@main.command()
@click.option("--rates", default="1gbit,200mbit", show_default=True)
@click.option("--hosts", default="2,2", show_default=True, help="workers per host")
@click.option("--rows", default=4_000_000, show_default=True)
@click.option("--columns", default=8, show_default=True)
@click.option("--partitions", default=32, show_default=True)
@click.option("--repeat", default=3, show_default=True)
@click.option("--json", "path", default=None, help="write every run and the medians here")
def link(rates: str, hosts: str, rows: int, columns: int, partitions: int, repeat: int, path):
    """Across hosts whose links are shaped to each rate (needs root)."""
    host_list = [int(h) for h in hosts.split(",")]
    results = link_runs(rates.split(","), host_list, rows, columns, partitions, repeat)
    context = {
        "rows": rows,
        "columns": columns,
        "partitions": partitions,
        "hosts": host_list,
        "machine": bench.machine_description(),
        "versions": bench.versions(),
    }
    _write(path, "link", results, context)


@main.command()
@click.option("--workers", "counts", default="2,4,8,16,32", show_default=True)
@click.option("--rows", default=2_000_000, show_default=True)
@click.option("--columns", default=16, show_default=True)
@click.option("--partitions", default=64, show_default=True)
@click.option("--repeat", default=2, show_default=True)
@click.option("--json", "path", default=None, help="write every run and the medians here")
def workers(counts: str, rows: int, columns: int, partitions: int, repeat: int, path):
    """One host, more and more single-threaded workers."""
    results = worker_runs([int(w) for w in counts.split(",")], rows, columns, partitions, repeat)
    context = {
        "rows": rows,
        "columns": columns,
        "partitions": partitions,
        "machine": bench.machine_description(),
        "versions": bench.versions(),
    }
    _write(path, "workers", results, context)


if __name__ == "__main__":
    main()
