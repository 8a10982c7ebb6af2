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

import contextlib
import json
import os
import re
import statistics as stats
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import click

from gpushuffle import bench

METHODS = ("gpushuffle", "p2p")


def _run_once(df: Any, method: str, key: str = "key") -> tuple[float, str]:
    start = time.perf_counter()
    summary = (
        df.shuffle(on=key, shuffle_method=method)
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


#: A variant is a method with settings: ``p2p+zstd`` turns distributed's
#: compression of every message on (``distributed.comm.compression``, on a
#: rig of its own: a comm takes it when it connects); ``gpushuffle/none``
#: sets ``gpushuffle.comm.compression`` on the workers for its runs, and
#: ``gpushuffle/KEY=VALUE,...`` any ``gpushuffle.KEY``.
DEFAULT_VARIANTS = ("gpushuffle", "p2p")


@dataclass(frozen=True)
class Variant:
    name: str
    method: str
    distributed_codec: str | None
    #: gpushuffle settings (keys under ``gpushuffle.``) for its runs.
    settings: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Variant:
        match = re.fullmatch(r"(gpushuffle|p2p|tasks)(?:\+(\w+))?(?:/([\w.=,-]+))?", text.strip())
        if not match:
            raise click.BadParameter(
                f"{text!r}: write a variant as "
                "METHOD[+DISTRIBUTED_CODEC][/COMPRESSION or /KEY=VALUE,...], "
                "e.g. p2p, p2p+zstd, gpushuffle/none, gpushuffle/comm.link-backlog=0"
            )
        if match[3] and match[1] != "gpushuffle":
            raise click.BadParameter(f"{text!r}: /... sets gpushuffle's configuration")
        settings: list[tuple[str, str]] = []
        for item in (match[3] or "").split(","):
            if not item:
                continue
            key, sep, value = item.partition("=")
            settings.append((key, value) if sep else ("comm.compression", key))
        return cls(text.strip(), match[1], match[2], tuple(settings))


def lineitem_frame(directory: str, rows: int, partitions: int) -> Any:
    """TPC-H lineitem, about ``rows`` rows in ``partitions`` Parquet files,
    read as :mod:`benchmarks.tpch` reads it (decimals, dates and strings
    typed by pyarrow), not yet computed: the transfer tasks read it."""
    import dask.dataframe as dd

    from benchmarks.tpch import generate_table

    path = os.path.join(directory, f"lineitem-{rows}-{partitions}")
    generate_table(path, "lineitem", rows / LINEITEM_ROWS_PER_SCALE, partitions)
    return dd.read_parquet(os.path.join(path, "lineitem"))


#: Rows of lineitem at TPC-H scale factor 1.
LINEITEM_ROWS_PER_SCALE = 6_001_215


def _input(data: str, rows: int, columns: int, partitions: int, directory: str) -> Any:
    if data == "lineitem":
        return lineitem_frame(directory, rows, partitions)
    return bench.generated_frame(rows, partitions, columns)


def _key(df: Any) -> str:
    return "l_orderkey" if "l_orderkey" in df.columns else "key"


def _full_digest(part: Any) -> Any:
    """One row per output partition: its rows and the sum of every row's
    hash over all columns (wrapping; independent of row order)."""
    import pandas as pd

    hashes = pd.util.hash_pandas_object(part, index=False).to_numpy()
    return pd.DataFrame({"rows": [len(part)], "hash": [int(hashes.sum(dtype="uint64"))]})


def _check_against_tasks(client: Any, df: Any, variants: Sequence[Variant]) -> dict[str, bool]:
    """Whether each variant's output partitions hold the rows ``tasks``'
    hold (every column hashed): once per variant, untimed."""
    import pandas as pd

    def digest(method: str) -> str:
        return bench._digest(
            df.shuffle(on=_key(df), shuffle_method=method)
            .map_partitions(_full_digest, meta=_full_digest(df._meta))
            .compute()
        )

    truth = digest("tasks")
    del pd
    return {v.name: digest(v.method) == truth for v in variants}


def _codec_seconds(client: Any) -> float:
    """Seconds gpushuffle's workers spent compressing and decompressing,
    summed over threads (each call's wall time: on busy cores more than its
    CPU time; recorded as ``codec_cpu_s``, a name kept for the results)."""
    counters = _engine_counters(client)
    spent = [c for c in counters.columns if c in ("spent_compress_ns", "spent_decompress_ns")]
    return float(counters[spent].to_numpy().sum()) / 1e9 if spent else 0.0


def link_runs(
    rates: Sequence[str],
    hosts: Sequence[int],
    rows: int,
    columns: int,
    partitions: int,
    repeat: int,
    data: str = "random",
    variants: Sequence[Variant] = tuple(Variant.parse(v) for v in DEFAULT_VARIANTS),
    directory: str = "/tmp",
) -> list[dict[str, Any]]:
    from distributed import Client

    from benchmarks.rig import Rig, link_bits

    results = []
    by_codec: dict[str | None, list[Variant]] = {}
    for variant in variants:
        by_codec.setdefault(variant.distributed_codec, []).append(variant)
    for rate in rates:
        with contextlib.ExitStack() as stack:
            # One rig per distributed codec, all alive at once, so that
            # variants alternate run by run.
            rigs: dict[str | None, tuple[Rig, Any]] = {}
            for codec in by_codec:
                env = {"DASK_DISTRIBUTED__COMM__COMPRESSION": codec} if codec else {}
                rig = stack.enter_context(Rig(hosts, rate=rate, memory_limit="4GiB", env=env))
                rigs[codec] = (rig, stack.enter_context(Client(rig.scheduler_address)))
            df = _input(data, rows, columns, partitions, directory)
            key = _key(df)
            input_bytes = int(df.memory_usage(deep=True, index=True).sum().compute())
            checked: dict[str, bool] = {}
            for codec, (_rig, client) in rigs.items():
                with client.as_current():
                    for variant in by_codec[codec]:  # warm: imports, connections
                        _configure(client, variant)
                        _run_once(df.partitions[:4], variant.method, key)
                    checked |= _check_against_tasks(client, df, by_codec[codec])
            for r in range(repeat):
                order = list(variants) if r % 2 == 0 else list(variants)[::-1]
                for variant in order:
                    rig, client = rigs[variant.distributed_codec]
                    with client.as_current():
                        _configure(client, variant)
                        codec_before = _codec_seconds(client)
                        before = [rig.link_bytes(h)[0] for h in range(len(hosts))]
                        wall, digest = _run_once(df, variant.method, key)
                        sent = [rig.link_bytes(h)[0] - b for h, b in enumerate(before)]
                        codec_s = _codec_seconds(client) - codec_before
                    use = [s / wall / (link_bits(rate) / 8) for s in sent]
                    row = {
                        "rate": rate,
                        "data": data,
                        "hosts": list(hosts),
                        "method": variant.name,
                        "repeat": r,
                        "wall_s": wall,
                        "input_bytes": input_bytes,
                        "link_bytes": sent,
                        "wire_bytes": sum(sent),
                        "wire_per_byte": sum(sent) / input_bytes,
                        "utilisation": use,
                        "busiest_link": max(use),
                        "codec_cpu_s": codec_s,
                        "equals_tasks": checked[variant.name],
                        "digest": digest,
                    }
                    results.append(row)
                    click.echo(
                        f"{rate:>8} {variant.name:>16} #{r}: {wall:6.2f} s, wire/byte "
                        f"{row['wire_per_byte']:.3f}, link use "
                        + ", ".join(f"{u:.0%}" for u in use)
                        + (f", codecs {codec_s:.2f} s in threads" if codec_s else "")
                    )
    return results


def _configure(client: Any, variant: Variant) -> None:
    """Set ``variant``'s gpushuffle settings on the workers (the defaults
    for the others)."""
    if variant.method != "gpushuffle":
        return
    settings = {f"gpushuffle.{key}": value for key, value in variant.settings}

    def configure() -> None:
        import dask

        dask.config.refresh()
        if settings:
            dask.config.set(settings)

    client.run(configure)


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
    """Per ``by`` value: each method's median wall (and, across links, the
    busiest link's utilisation, the bytes the links carried, the codecs' CPU
    time), each method's wall over gpushuffle's (``<method>_over_gpushuffle``),
    its link bytes over p2p's, and whether the digests of every run agree."""
    table = []
    for value in dict.fromkeys(r[by] for r in results):
        rows = [r for r in results if r[by] == value]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        runs = {m: [r for r in rows if r["method"] == m] for m in methods}
        wall = {m: stats.median(r["wall_s"] for r in runs[m]) for m in methods}
        row: dict[str, Any] = {by: value, **{f"{m}_s": wall[m] for m in methods}}
        for m in methods:
            if m != "gpushuffle" and "gpushuffle" in wall:
                row[f"{m}_over_gpushuffle"] = wall[m] / wall["gpushuffle"]
        row["same_outputs"] = len({r["digest"] for r in rows}) == 1
        if all("equals_tasks" in r for r in rows):
            row["equal_to_tasks"] = all(r["equals_tasks"] for r in rows)
        for m in methods:
            if "utilisation" in runs[m][0]:
                row[f"{m}_utilisation"] = stats.median(
                    stats.mean(r["utilisation"]) for r in runs[m]
                )
                row[f"{m}_wire_per_byte"] = stats.median(r["wire_per_byte"] for r in runs[m])
            if "busiest_link" in runs[m][0]:
                row[f"{m}_busiest_link"] = stats.median(r["busiest_link"] for r in runs[m])
                row[f"{m}_wire_bytes"] = stats.median(r["wire_bytes"] for r in runs[m])
                row[f"{m}_codec_cpu_s"] = stats.median(r["codec_cpu_s"] for r in runs[m])
        if "p2p_wire_bytes" in row:
            for m in methods:
                row[f"{m}_wire_over_p2p"] = row[f"{m}_wire_bytes"] / row["p2p_wire_bytes"]
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
@click.option(
    "--data",
    type=click.Choice(["random", "lineitem"]),
    default="random",
    show_default=True,
    help="random numeric columns, or TPC-H lineitem (tpchgen-cli, typed as read)",
)
@click.option("--rows", default=4_000_000, show_default=True)
@click.option("--columns", default=8, show_default=True, help="random data only")
@click.option("--partitions", default=32, show_default=True)
@click.option("--repeat", default=3, show_default=True)
@click.option(
    "--methods",
    default=",".join(DEFAULT_VARIANTS),
    show_default=True,
    help="METHOD[+DISTRIBUTED_CODEC][/COMPRESSION or /KEY=VALUE,...], comma-separated "
    "(p2p+zstd: distributed's compression on; gpushuffle/none: gpushuffle's off; "
    "gpushuffle/comm.link-backlog=0: a gpushuffle setting)",
)
@click.option("--directory", default="/tmp", show_default=True, help="where lineitem is written")
@click.option("--json", "path", default=None, help="write every run and the medians here")
def link(
    rates: str,
    hosts: str,
    data: str,
    rows: int,
    columns: int,
    partitions: int,
    repeat: int,
    methods: str,
    directory: str,
    path: str | None,
) -> None:
    """Across hosts whose links are shaped to each rate (needs root)."""
    host_list = [int(h) for h in hosts.split(",")]
    variants = [Variant.parse(v) for v in methods.split(",")]
    results = link_runs(
        rates.split(","),
        host_list,
        rows,
        columns,
        partitions,
        repeat,
        data=data,
        variants=variants,
        directory=directory,
    )
    context = {
        "data": data,
        "rows": rows,
        "columns": columns if data == "random" else None,
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
