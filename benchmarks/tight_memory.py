"""Shuffles on workers whose memory limit the persisted input nearly fills.

``python -m benchmarks.tight_memory --memory-limit 700MiB --rows 12000000``
starts a ``LocalCluster`` (2 workers x 1 thread, each with that memory
limit, Nanny-started, so distributed spills, pauses and restarts workers as
it does for users), persists a frame of ``--rows`` rows x 8 int64/float64
columns in 16 partitions, then runs
``df.shuffle("key", shuffle_method=M).map_partitions(len).sum()`` with each
method in ``--methods``, in order, ``--repeat`` rounds.  For each run it
records whether it finished and gave every row, its wall time, and how many
times the Nanny restarted a worker meanwhile (distributed restarts a worker
that passes ``distributed.worker.memory.terminate``).  A run that has not
finished after ``--timeout`` seconds is reported as hung and the benchmark
stops: a paused worker that never resumes does not come back by itself.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import pandas as pd


def _part(i: int, rows: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    return pd.DataFrame(
        {"key": rng.integers(0, 10**6, rows), **{f"c{j}": rng.random(rows) for j in range(7)}}
    )


def run(
    memory_limit: str, rows: int, methods: list[str], repeat: int, timeout: float
) -> list[dict[str, Any]]:
    import dask.dataframe as dd
    from distributed import Client, wait

    import gpushuffle  # noqa: F401  (registers the method)
    from gpushuffle.bench import benchmark_cluster, machine_description, versions
    from gpushuffle.cluster import _quiet_shuffle_log

    records: list[dict[str, Any]] = []
    parts = 16
    with (
        _quiet_shuffle_log(debug=False),
        benchmark_cluster(2, memory_limit=memory_limit) as cluster,
        Client(cluster) as client,
    ):
        df = dd.from_map(_part, range(parts), [rows // parts] * parts).persist()
        wait(df)
        input_bytes = int(df.memory_usage(deep=True).sum().compute())
        for r in range(repeat):
            for method in methods:
                # client.nthreads(), not scheduler_info(), whose cache the
                # client's periodic refresh empties of workers (gpushuffle/bench.py).
                workers_before = set(client.nthreads())
                start = time.perf_counter()
                future = client.compute(
                    df.shuffle("key", shuffle_method=method).map_partitions(len).sum()
                )
                record: dict[str, Any] = {
                    "method": method,
                    "repeat": r,
                    "memory_limit": memory_limit,
                    "input_bytes": input_bytes,
                }
                try:
                    rows_out = future.result(timeout=timeout)
                    record["outcome"] = "ok" if rows_out == rows // parts * parts else "wrong"
                    record["rows_out"] = int(rows_out)
                except TimeoutError:
                    record["outcome"] = "hung"
                except Exception as e:
                    record["outcome"] = f"failed: {type(e).__name__}"
                record["wall_s"] = time.perf_counter() - start
                # Workers that left during the run (the Nanny restarts a worker
                # that passes the terminate threshold under a new address).
                record["workers_replaced"] = len(workers_before - set(client.nthreads()))
                record["machine"] = machine_description()
                record["versions"] = versions()
                records.append(record)
                print(
                    f"{method:<11} round {r}: {record['outcome']:<24} "
                    f"{record['wall_s']:7.2f} s, {record['workers_replaced']} worker(s) replaced",
                    flush=True,
                )
                if record["outcome"] == "hung":
                    return records
                future.release()
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-limit", default="700MiB", help="Each worker's memory limit.")
    parser.add_argument("--rows", type=int, default=12_000_000)
    parser.add_argument("--methods", default="gpushuffle,p2p")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds before 'hung'.")
    parser.add_argument("--json", default=None, help="Write the records here.")
    args = parser.parse_args(argv)
    records = run(
        args.memory_limit,
        args.rows,
        [m.strip() for m in args.methods.split(",") if m.strip()],
        args.repeat,
        args.timeout,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
