"""GPU benchmark: gpushuffle against dask's ``p2p`` and ``tasks`` on cuDF partitions.

Two worker processes share the one GPU (``CUDA_VISIBLE_DEVICES=0`` for both:
dask-cuda's ``LocalCUDACluster`` starts one worker per visible GPU and refuses
more), each with its own RMM memory resource (a pool by default) and cupy
allocating through it.  The same persisted cuDF frame is shuffled by each
method in turn, round-robin, ``repeat`` times:
``df.shuffle(on="key", shuffle_method=M).map_partitions(len).compute()``.
Then each method's output partitions are summarised (row count, sums of the
unique row ids and keys, their range, string lengths, a float sum, dtypes)
and compared with ``tasks``' partition by partition.  The device's own copy
rates (device to device, device to pinned host and back; cupy, in this
process) are measured in the same run, so the shuffle's GB/s can be read
against them.

    python -m benchmarks.gpu_bench [--rows N] [--partitions P] [--repeat R]
        [--protocol tcp|ucx] [--methods gpushuffle,p2p,tasks] [--rmm pool:8GiB|async|none]
        [--deadline-s S] [--expect-device-frames] [--json PATH]

``--backend pandas`` runs the same harness on CPU workers with pandas
partitions (no GPU needed): CI uses it to keep the harness working.  Over
``--protocol ucx`` the frames each worker sends are counted (device frames,
i.e. with ``__cuda_array_interface__``, and host frames) by wrapping
distributed-ucxx's ``to_frames`` on the workers; ``--expect-device-frames``
fails the run unless gpushuffle's shuffle sent device frames.  Exits 1 when a
method fails or its partitions differ from ``tasks``'.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import pandas as pd
from distributed import WorkerPlugin

METHODS = ("gpushuffle", "p2p", "tasks")


# -- data -----------------------------------------------------------------------------------


def make_partition(i: int, rows: int, nkeys: int, backend: str) -> Any:
    """Input partition ``i``: ``rows`` rows, ids ``i * rows ...``, 8 columns of 6 types.

    Built on the device for cuDF (cupy random numbers), so the client never
    holds the data.
    """
    if backend == "cudf":
        import cudf
        import cupy as xp

        frame, series = cudf.DataFrame, cudf.Series
        rs = xp.random.RandomState(i)
    else:
        xp = np
        frame, series = pd.DataFrame, pd.Series
        rs = np.random.RandomState(i)
    row = xp.arange(i * rows, (i + 1) * rows, dtype=xp.int64)
    key = rs.randint(0, nkeys, rows, dtype=xp.int64)
    return frame(
        {
            "key": key,
            "row": row,
            "i1": rs.randint(0, 2**40, rows, dtype=xp.int64),
            "f1": rs.random_sample(rows),
            "f2": rs.random_sample(rows),
            "flag": (key % 3) == 0,
            "ts": series(row * 1_000_000_007).astype("datetime64[ns]"),
            "s": series(key % 1000).astype(str),
        }
    )


def summary(df: Any) -> pd.DataFrame:
    """One row describing a partition (pandas, whatever the backend)."""
    n = len(df)
    return pd.DataFrame(
        {
            "n": [n],
            "row_sum": [int(df["row"].sum()) if n else 0],
            "row_min": [int(df["row"].min()) if n else -1],
            "row_max": [int(df["row"].max()) if n else -1],
            "key_sum": [int(df["key"].sum()) if n else 0],
            "s_len": [int(df["s"].str.len().sum()) if n else 0],
            "flags": [int(df["flag"].sum()) if n else 0],
            "f1_sum": [float(df["f1"].sum()) if n else 0.0],
            "dtypes": [";".join(f"{c}:{t}" for c, t in df.dtypes.items())],
        }
    )


def _nbytes(df: Any) -> pd.DataFrame:
    return pd.DataFrame({"bytes": [int(df.memory_usage(index=True, deep=True).sum())]})


# -- workers --------------------------------------------------------------------------------


class RMMSetup(WorkerPlugin):
    """Give each worker an RMM resource (pool, async or the default), cupy on top of it,
    and RMM's allocation statistics (for the peak device bytes of each run)."""

    name = "gpushuffle-bench-rmm"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def setup(self, worker: Any) -> None:
        import rmm
        import rmm.statistics

        if self.mode.startswith("pool:"):
            rmm.reinitialize(pool_allocator=True, initial_pool_size=self.mode[5:])
        elif self.mode == "async":
            rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource())
        try:
            import cupy
            from rmm.allocators.cupy import rmm_cupy_allocator

            cupy.cuda.set_allocator(rmm_cupy_allocator)
        except ImportError:  # pragma: no cover - cupy is there wherever cuDF is
            pass
        rmm.statistics.enable_statistics()


def _rmm_push() -> bool:
    import rmm.statistics

    return rmm.statistics.push_statistics() is not None


def _rmm_pop_peak() -> int | None:
    import rmm.statistics

    stats = rmm.statistics.pop_statistics()
    return None if stats is None else int(stats.peak_bytes)


def _count_frames() -> bool:
    """Wrap distributed-ucxx's ``to_frames`` to count what this worker sends.

    The counts live on that module: functions sent with ``client.run`` from
    ``__main__`` are pickled by value, each with its own globals.
    """
    import distributed_ucxx.ucxx as ucxx_comm
    from distributed.utils import nbytes

    if hasattr(ucxx_comm, "_gpushuffle_frames"):
        return True
    original = ucxx_comm.to_frames
    counts: dict[str, int] = {}

    async def counting(*args: Any, **kwargs: Any) -> Any:
        frames = await original(*args, **kwargs)
        for frame in frames:
            kind = "device" if hasattr(frame, "__cuda_array_interface__") else "host"
            counts[f"{kind}_frames"] = counts.get(f"{kind}_frames", 0) + 1
            counts[f"{kind}_bytes"] = counts.get(f"{kind}_bytes", 0) + nbytes(frame)
        return frames

    ucxx_comm.to_frames = counting
    ucxx_comm._gpushuffle_frames = counts
    return True


def _take_frame_counts() -> dict[str, int]:
    import distributed_ucxx.ucxx as ucxx_comm

    counts: dict[str, int] = ucxx_comm._gpushuffle_frames
    taken = dict(counts)
    counts.clear()
    return taken


def _gc() -> None:
    import gc

    gc.collect()


# -- the device's own copy rates ------------------------------------------------------------


def copy_rates(nbytes: int = 1 << 30, repeat: int = 10) -> dict[str, float]:
    """GB/s (1e9 bytes copied per second) for cupy copies in this process."""
    import cupy
    from cupyx import empty_pinned

    src = cupy.arange(nbytes // 8, dtype=cupy.int64)
    dst = cupy.empty_like(src)
    host = empty_pinned(src.shape, dtype=np.int64)
    rates = {}
    for name, run in {
        "device_to_device": lambda: dst.__setitem__(slice(None), src),
        "device_to_host_pinned": lambda: src.get(out=host),
        "host_pinned_to_device": lambda: dst.set(host),
    }.items():
        run()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            run()
        cupy.cuda.Device().synchronize()
        rates[name] = repeat * nbytes / (time.perf_counter() - start) / 1e9
    return rates


# -- the run --------------------------------------------------------------------------------


def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in (
        "gpushuffle",
        "dask",
        "distributed",
        "pandas",
        "numpy",
        "pyarrow",
        "cudf-cu13",
        "dask-cudf-cu13",
        "rmm-cu13",
        "dask-cuda",
        "cupy-cuda13x",
        "distributed-ucxx-cu13",
        "cudf-cu12",
        "rmm-cu12",
        "distributed-ucxx-cu12",
    ):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def start_cluster(args: argparse.Namespace) -> Any:
    import dask
    from distributed import LocalCluster

    env: dict[str, str] = {}
    config: dict[str, Any] = {"gpushuffle.p2p-on-cudf": False}
    if args.backend == "cudf":
        os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"] = "0"
    if args.protocol == "ucx":
        if args.backend == "cudf":
            # tcp + cuda_copy + cuda_ipc: device frames between the two processes.
            config.update(
                {
                    "distributed-ucxx.create-cuda-context": True,
                    "distributed-ucxx.tcp": True,
                    "distributed-ucxx.cuda-copy": True,
                    "distributed-ucxx.nvlink": True,
                    "distributed-ucxx.infiniband": False,
                    "distributed-ucxx.rdmacm": False,
                }
            )
        else:
            os.environ.setdefault("UCX_TLS", "tcp,self,sm")
            os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
            config["distributed-ucxx.create-cuda-context"] = False
    dask.config.set(config)
    return LocalCluster(
        n_workers=args.workers,
        threads_per_worker=args.threads,
        processes=True,
        protocol=args.protocol,
        dashboard_address=None,
        worker_dashboard_address=None,
        env=env,
    )


def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Fill ``report``; what it holds stays there if a step raises."""
    import dask.dataframe as dd
    from distributed import Client, wait

    import gpushuffle  # noqa: F401  (registers shuffle_method="gpushuffle")

    # Every p2p-based shuffle logs its start and end at WARNING.
    logging.getLogger("distributed.shuffle._scheduler_plugin").setLevel(logging.ERROR)
    started = time.perf_counter()
    report |= {
        "benchmark": "gpu_bench",
        "backend": args.backend,
        "protocol": args.protocol,
        "workers": args.workers,
        "threads_per_worker": args.threads,
        "rows": args.rows,
        "partitions": args.partitions,
        "output_partitions": args.partitions,
        "keys": args.keys,
        "repeat": args.repeat,
        "rmm": args.rmm if args.backend == "cudf" else None,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": versions(),
        "statement": 'df.shuffle(on="key", shuffle_method=M).map_partitions(len).compute()',
    }
    if args.backend == "cudf":
        import cupy
        import dask_cudf  # noqa: F401  (registers cuDF-backed collections)

        props = cupy.cuda.runtime.getDeviceProperties(0)
        report["device"] = props["name"].decode()
        report["copy_gbps"] = copy_rates()
        cupy.get_default_memory_pool().free_all_blocks()
        report["copy_note"] = "bytes copied per second (each byte read once and written once)"
    methods = [m for m in args.methods.split(",") if m]
    results: dict[str, dict[str, Any]] = {m: {"runs_s": [], "error": None} for m in methods}
    report["methods"] = results
    per = args.rows // args.partitions
    with start_cluster(args) as cluster, Client(cluster) as client:
        cluster_ready = time.perf_counter()
        if args.backend == "cudf":
            client.register_plugin(RMMSetup(args.rmm))
        counting = args.protocol == "ucx" and all(client.run(_count_frames).values())
        meta = make_partition(0, 2, args.keys, args.backend).iloc[:0]
        df = dd.from_map(
            make_partition,
            range(args.partitions),
            rows=per,
            nkeys=args.keys,
            backend=args.backend,
            meta=meta,
            enforce_metadata=False,
        ).persist()
        wait(df)
        nbytes = df.map_partitions(_nbytes, meta=_nbytes(meta).iloc[:0]).compute()
        report["input_bytes"] = int(nbytes["bytes"].sum())
        report["setup_s"] = {
            "cluster": cluster_ready - started,
            "data": time.perf_counter() - cluster_ready,
        }

        def shuffled(method: str) -> Any:
            return df.shuffle(on="key", npartitions=args.partitions, shuffle_method=method)

        stopped_early = False
        for repeat in range(args.repeat):
            for method in methods:
                result = results[method]
                if result["error"]:
                    continue
                # This run, then the checks (about one more run of each method).
                elapsed = time.perf_counter() - started
                guess = max(result["runs_s"], default=10.0) * 1.5 + 5
                checks = sum(max(r["runs_s"], default=10.0) for r in results.values()) + 10
                if repeat and args.deadline_s and elapsed + guess + checks > args.deadline_s:
                    stopped_early = True
                    continue
                client.run(_gc)
                if counting:
                    client.run(_take_frame_counts)
                tracked = args.backend == "cudf" and all(client.run(_rmm_push).values())
                start = time.perf_counter()
                try:
                    lengths = shuffled(method).map_partitions(len).compute()
                except Exception as error:  # recorded; the other methods go on
                    result["error"] = f"{type(error).__name__}: {error}"
                    print(f"gpu_bench: {method} failed: {result['error']}", file=sys.stderr)
                    continue
                finally:
                    if tracked:
                        peaks = [p for p in client.run(_rmm_pop_peak).values() if p is not None]
                        result.setdefault("peak_rmm_bytes", []).append(max(peaks, default=None))
                wall = time.perf_counter() - start
                result["runs_s"].append(wall)
                result["rows_out"] = int(lengths.sum())
                if counting:
                    counts: dict[str, int] = {}
                    for worker_counts in client.run(_take_frame_counts).values():
                        for k, v in worker_counts.items():
                            counts[k] = counts.get(k, 0) + v
                    result.setdefault("frames_sent", []).append(counts)
                print(f"gpu_bench: {method} run {repeat + 1}: {wall:.3f} s", flush=True)
        report["stopped_early_for_deadline"] = stopped_early

        # Checks: every method's partitions against tasks' (or, without tasks, pandas' rules).
        summaries: dict[str, pd.DataFrame] = {}
        for method in methods:
            if results[method]["error"]:
                continue
            try:
                out = shuffled(method).map_partitions(summary, meta=summary(meta).iloc[:0])
                summaries[method] = out.compute().reset_index(drop=True)
            except Exception as error:
                results[method]["error"] = f"check: {type(error).__name__}: {error}"
    report["checks"] = check(summaries, args.rows - args.rows % args.partitions)
    for method, result in results.items():
        runs = result["runs_s"]
        if runs:
            result["median_s"] = statistics.median(runs)
            result["gb_per_s"] = report["input_bytes"] / result["median_s"] / 1e9
        if method in report["checks"]:
            result["check"] = report["checks"][method]
    if "p2p" in results and results["p2p"].get("median_s"):
        for result in results.values():
            if result.get("median_s"):
                result["p2p_median_over_this"] = results["p2p"]["median_s"] / result["median_s"]
    if args.expect_device_frames:
        frames = results.get("gpushuffle", {}).get("frames_sent", [])
        sent = sum(f.get("device_bytes", 0) for f in frames)
        report["device_frames_check"] = (
            f"ok: gpushuffle sent {sent} bytes as device frames"
            if sent
            else "FAILED: gpushuffle sent no device frames over UCX"
        )
    # gpushuffle must run and match tasks; p2p's errors and differences are
    # reported (they are dask's), not failures of this run.
    required = [m for m in ("gpushuffle", "tasks") if m in results]
    failed = [m for m in required if results[m]["error"] or not results[m]["runs_s"]]
    bad = [m for m in required if not report["checks"].get(m, "").startswith("ok")]
    if args.expect_device_frames and not report["device_frames_check"].startswith("ok"):
        bad.append("device frames")
    report["failed"] = failed + bad
    report["ok"] = not failed and not bad
    report["wall_s"] = time.perf_counter() - started


def check(summaries: dict[str, pd.DataFrame], rows: int) -> dict[str, str]:
    """``ok: ...`` or what differs, for each method."""
    out = {}
    truth = summaries.get("tasks")
    for method, s in summaries.items():
        problems = []
        if int(s["n"].sum()) != rows:
            problems.append(f"{int(s['n'].sum())} rows, not {rows}")
        if int(s["row_sum"].sum()) != rows * (rows - 1) // 2:
            problems.append("row ids lost or repeated")
        if truth is not None and method != "tasks":
            exact = ["n", "row_sum", "row_min", "row_max", "key_sum", "s_len", "flags", "dtypes"]
            if len(s) != len(truth):
                problems.append(f"{len(s)} partitions, tasks {len(truth)}")
            else:
                for column in exact:
                    differ = np.flatnonzero((s[column] != truth[column]).to_numpy())
                    if len(differ):
                        problems.append(f"{column} differs in partitions {differ[:5].tolist()}")
                if not np.allclose(s["f1_sum"], truth["f1_sum"], rtol=1e-9, atol=1e-6):
                    problems.append("f1 sums differ")
        against = "tasks" if truth is not None and method != "tasks" else "the input"
        out[method] = (
            f"ok: {len(s)} partitions match {against} (rows, ids, keys, strings, dtypes)"
            if not problems
            else "MISMATCH: " + "; ".join(problems)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cudf", "pandas"), default="cudf")
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per worker")
    parser.add_argument("--protocol", choices=("tcp", "ucx"), default="tcp")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rmm", default="pool:8GiB", help="pool:SIZE, async or none")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=float(os.environ.get("GPU_BENCH_DEADLINE_S", 0)),
        help="seconds from the start: begin no repeat that would end, checks included, "
        "after this (default $GPU_BENCH_DEADLINE_S, set by ci/gpu_run.sh; 0: none)",
    )
    parser.add_argument("--expect-device-frames", action="store_true")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    bad_methods = set(args.methods.split(",")) - set(METHODS)
    if bad_methods:
        parser.error(f"unknown methods {sorted(bad_methods)}; choose from {METHODS}")
    if not (args.rmm in ("async", "none") or args.rmm.startswith("pool:")):
        parser.error("--rmm is pool:SIZE, async or none")
    report: dict[str, Any] = {"ok": False}
    started = time.perf_counter()
    try:
        run(args, report)
    except BaseException as error:  # the report so far still gets written
        import traceback

        report["ok"] = False
        report["error"] = f"{type(error).__name__}: {error}"
        report["wall_s"] = time.perf_counter() - started
        traceback.print_exc()
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    for method, result in report.get("methods", {}).items():
        runs = ", ".join(f"{r:.3f}" for r in result["runs_s"])
        line = f"{method:>10}: runs {runs or '-'} s"
        if result.get("median_s"):
            line += f", median {result['median_s']:.3f} s, {result['gb_per_s']:.2f} GB/s"
        print(line + f"; {result.get('check') or result['error']}")
    if "copy_gbps" in report:
        print(
            "copy rates here, GB/s: "
            + json.dumps({k: round(v, 1) for k, v in report["copy_gbps"].items()})
        )
    if "device_frames_check" in report:
        print(f"device frames: {report['device_frames_check']}")
    if report["ok"]:
        print(f"gpu_bench: ok in {report['wall_s']:.1f} s")
    else:
        why = report.get("error") or ", ".join(report.get("failed", []))
        print(f"gpu_bench: FAILED ({why}) after {report['wall_s']:.1f} s")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
