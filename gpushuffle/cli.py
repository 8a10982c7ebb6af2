"""The ``gpushuffle`` command line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import click

from gpushuffle.bench import DEFAULT_METHODS


class BadArguments(click.ClickException):
    """Input, output, key or cluster are wrong: one line on stderr, exit status 2."""

    exit_code = 2


class Failed(click.ClickException):
    """The shuffle itself failed: one line on stderr, exit status 1."""

    exit_code = 1


class Interrupted(click.ClickException):
    """Ctrl-C: one line on stderr, exit status 130 as shells report SIGINT."""

    exit_code = 130


class Terminated(Interrupted):
    """SIGTERM (a CI job cancelled, ``timeout``): exit status 143, as for SIGTERM."""

    exit_code = 143


class _SIGTERM(KeyboardInterrupt):
    """Raised by the SIGTERM handler, so that the job cleans up as on Ctrl-C."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise _SIGTERM

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@click.group()
@click.version_option(package_name="gpushuffle")
def main() -> None:
    """A peer-to-peer shuffle for Dask DataFrames."""


@main.command()
@click.option("--rows", default=24_000_000, show_default=True, help="Total rows.")
@click.option("--columns", default=16, show_default=True, help="Columns, the key included.")
@click.option(
    "--dtypes",
    type=click.Choice(["numeric", "mixed"]),
    default="numeric",
    show_default=True,
    help="numeric: int64 and float64 columns.  mixed: strings of varied length, "
    "categoricals, naive and tz-aware timestamps, nullable Int64 and boolean, floats "
    "with NaN, int64.",
)
@click.option("--partitions", default=40, show_default=True, help="Input (= output) partitions.")
@click.option("--workers", default=2, show_default=True)
@click.option("--threads", default=1, show_default=True, help="Threads per worker.")
@click.option(
    "--methods",
    default=",".join(DEFAULT_METHODS),
    show_default=True,
    help="Comma-separated shuffle methods, run in this order.",
)
@click.option(
    "--repeat",
    default=1,
    show_default=True,
    help="Runs per method, back to back (the first of each with gpushuffle's pool emptied).",
)
@click.option("--protocol", default="tcp", show_default=True, type=click.Choice(["tcp", "ucx"]))
@click.option(
    "--memory-limit",
    default=None,
    help="gpushuffle's store budget per worker (host and device), e.g. '256MiB'.",
)
@click.option(
    "--skew",
    default="0",
    show_default=True,
    metavar="F|F,F|START:STOP:STEP",
    help="Share of the rows on one key (a hot key: a null or default value).  Several "
    "shares (with --worker-memory) sweep the hot-key boundary instead: each share and "
    "run in a fresh cluster, reporting built or refused, restarts and peak against the "
    "limit.",
)
@click.option(
    "--worker-memory",
    default=None,
    metavar="SIZE",
    help="Each worker's memory limit, enforced as distributed does (a worker over it is "
    "restarted), e.g. '1.5GiB'; the input is generated inside the shuffle instead of "
    "persisted first, so it can be larger than the cluster. Runs count restarts and "
    "record failures.",
)
@click.option(
    "--settle",
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="After each run, keep sampling this long and record how much RSS each worker "
    "kept (the 'left MiB' column: the largest worker's growth over the run).",
)
@click.option(
    "--kill-at",
    type=float,
    default=None,
    metavar="FRACTION",
    help="Measure what losing a worker costs: each method runs without a fault, then "
    "again with one worker process SIGKILLed at this fraction of that run's time (its "
    "Nanny restarts it); results checked against the tasks shuffle.  Methods: gpushuffle "
    "(recovery: partial), gpushuffle-restart, p2p.",
)
@click.option(
    "--kill-every",
    type=float,
    default=None,
    metavar="FRACTION",
    help="As --kill-at, but a worker is SIGKILLed every FRACTION of the no-fault time "
    "for as long as the run lasts (given up after 10x plus the connect timeout and 10 s).",
)
@click.option("--json", "json_path", default=None, help="Write per-run results here.")
@click.option("--debug", is_flag=True, help="Show the scheduler's shuffle log.")
@click.option(
    "--plot",
    "plot_path",
    default=None,
    metavar="PATH.png",
    help="Draw wall time, peak worker memory and worker memory over time per method "
    "into this PNG (needs matplotlib: pip install 'gpushuffle[plot]').",
)
def bench(
    rows: int,
    columns: int,
    dtypes: str,
    partitions: int,
    workers: int,
    threads: int,
    methods: str,
    repeat: int,
    protocol: str,
    memory_limit: str | None,
    skew: str,
    worker_memory: str | None,
    settle: float,
    kill_at: float | None,
    kill_every: float | None,
    json_path: str | None,
    debug: bool,
    plot_path: str | None,
) -> None:
    """Time gpushuffle against dask's p2p and tasks shuffles on one cluster.

    Prints each method's medians (wall time, peak worker RSS, what was
    spilled and copied), then gpushuffle's stages: bytes copied per byte
    shuffled, seconds under way and time per byte as a multiple of a plain
    copy measured on the workers in the same run ("x of memcpy").
    """
    from gpushuffle.bench import (
        Result,
        format_stages,
        format_table,
        run_benchmark,
        summarize,
        write_json,
    )
    from gpushuffle.cluster import _quiet_shuffle_log
    from gpushuffle.hotkey import parse_shares

    try:
        shares = parse_shares(skew)
    except ValueError as e:
        raise BadArguments(f"--skew {e}") from None
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    if kill_at is not None or kill_every is not None:
        with _quiet_shuffle_log(debug):
            _bench_losses(
                rows, columns, dtypes, partitions, workers, method_list, repeat,
                kill_at, kill_every, json_path,
            )  # fmt: skip
        return
    if len(shares) > 1:
        if not worker_memory:
            raise BadArguments("--skew with several shares sweeps them: give --worker-memory")
        with _quiet_shuffle_log(debug):
            _sweep_skew(
                shares, worker_memory, rows, columns, partitions, workers, threads,
                method_list, repeat, dtypes, json_path,
            )  # fmt: skip
        return

    if plot_path:
        from gpushuffle.plot import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as e:
            raise BadArguments(str(e)) from None
        folder = os.path.dirname(os.path.abspath(plot_path))
        if not os.path.isdir(folder):
            raise BadArguments(f"--plot {plot_path}: no directory {folder}")

    def progress(r: Result) -> None:
        outcome = f"FAILED ({r.error})" if r.error else f"{r.rows_out:,} rows"
        restarts = f", {r.restarts} worker restart(s)" if r.restarts else ""
        click.echo(
            f"  {r.method:<11} run {r.repeat}: {r.wall_s:7.2f} s, {outcome}, "
            f"peak worker RSS {r.peak_worker_rss_bytes / 2**30:.2f} GiB{restarts}",
            err=True,
        )

    with _quiet_shuffle_log(debug):
        results, context = run_benchmark(
            rows=rows,
            columns=columns,
            partitions=partitions,
            workers=workers,
            threads=threads,
            methods=method_list,
            repeat=repeat,
            protocol=protocol,
            memory_limit=memory_limit,
            settle=settle,
            on_result=progress,
            dtypes=dtypes,
            skew=shares[0],
            worker_memory=worker_memory,
        )
    click.echo(
        f"{context['rows']:,} rows x {context['columns']} {context['dtypes']} columns, "
        f"{context['partitions']} partitions, {context['input_bytes'] / 2**30:.2f} GiB"
        + (f", {context['skew']:.0%} of the rows on one key" if context["skew"] else "")
        + f"; {context['workers']} workers x {context['threads_per_worker']} threads"
        + (f" of {context['worker_memory']}" if context["worker_memory"] else "")
        + f" over {context['protocol']}\n{context['machine']}\n"
        f"{json.dumps(context['versions'])}"
    )
    summary = summarize(results)
    click.echo(format_table(summary))
    for row in summary:
        for error in row["errors"]:
            click.echo(f"{row['method']} failed: {error}")
        if row["same_partitions_as"]:
            click.echo(
                f"{row['method']}: the same rows in each output partition as "
                f"{', '.join(row['same_partitions_as'])}"
            )
    for row in summary:
        if row.get("copies_per_byte_by_stage"):
            stages = ", ".join(
                f"{stage} {ratio:.2f}" for stage, ratio in row["copies_per_byte_by_stage"].items()
            )
            click.echo(f"{row['method']} bytes copied per byte shuffled, by stage: {stages}")
        if (table := format_stages(row)) is not None:
            click.echo(table)
    if json_path:
        write_json(json_path, results, context)
        click.echo(f"wrote {json_path}")
    if plot_path:
        from gpushuffle.plot import plot_benchmark

        plot_benchmark(results, context, plot_path)
        click.echo(f"wrote {plot_path}")


def _bench_losses(
    rows: int,
    columns: int,
    dtypes: str,
    partitions: int,
    workers: int,
    methods: list[str],
    repeat: int,
    kill_at: float | None,
    kill_every: float | None,
    json_path: str | None,
) -> None:
    """``bench --kill-at`` / ``--kill-every`` (:mod:`gpushuffle.bench_loss`)."""
    from gpushuffle.bench_loss import (
        LOSS_METHODS,
        LossResult,
        format_losses,
        run_loss_benchmark,
        summarize_losses,
    )

    if kill_at is not None and kill_every is not None:
        raise BadArguments("give --kill-at or --kill-every, not both")
    if not 0 < (kill_at or kill_every or 0) < 10:
        raise BadArguments("--kill-at/--kill-every: a fraction of the no-fault time, above 0")
    if set(methods) - LOSS_METHODS.keys():
        # The default list has tasks, which this does not time; others are errors.
        methods = [m for m in methods if m in LOSS_METHODS] or list(LOSS_METHODS)

    def progress(r: LossResult) -> None:
        fault = "not finished" if r.fault_s is None else f"{r.fault_s:.2f} s"
        click.echo(
            f"  {r.method:<19} run {r.repeat}: {r.no_fault_s:.2f} s, with {r.kills} "
            f"loss(es) {fault}, {'right' if r.correct else 'WRONG'}"
            + (f" ({r.error})" if r.error else ""),
            err=True,
        )

    results, context = run_loss_benchmark(
        rows=rows,
        columns=columns,
        partitions=partitions,
        workers=workers,
        methods=methods,
        repeat=repeat,
        kill_at=kill_at,
        kill_every=kill_every,
        dtypes=dtypes,
        on_result=progress,
    )
    what = (
        f"one worker killed at {kill_at:g}x"
        if kill_at
        else f"a worker killed every {kill_every:g}x"
    )
    click.echo(
        f"{rows:,} rows x {columns} {dtypes} columns, {partitions} partitions, "
        f"{workers} workers; {what} of the no-fault time\n{context['machine']}"
    )
    click.echo(format_losses(summarize_losses(results)))
    if json_path:
        import dataclasses

        with open(json_path, "w") as f:
            json.dump(
                {"context": context, "results": [dataclasses.asdict(r) for r in results]},
                f,
                indent=1,
            )
        click.echo(f"wrote {json_path}")


def _sweep_skew(
    shares: tuple[float, ...],
    worker_memory: str,
    rows: int,
    columns: int,
    partitions: int,
    workers: int,
    threads: int,
    methods: list[str],
    repeat: int,
    dtypes: str,
    json_path: str | None,
) -> None:
    """``bench --skew`` with several shares: the hot-key boundary (gpushuffle.hotkey)."""
    from dataclasses import asdict

    from gpushuffle.bench import machine_description, versions
    from gpushuffle.hotkey import SweepPoint, format_sweep, run_skew_sweep, summarize_sweep

    def progress(p: SweepPoint) -> None:
        restarts = f", {p.restarts} worker restart(s)" if p.restarts else ""
        click.echo(
            f"  {p.method:<11} share {p.share:.2f} run {p.run}: {p.verdict}, {p.wall_s:6.2f} s, "
            f"peak {p.peak_bytes / p.limit_bytes:.0%} of the limit{restarts}",
            err=True,
        )

    points = run_skew_sweep(
        shares,
        worker_memory=worker_memory,
        rows=rows,
        columns=columns,
        partitions=partitions,
        workers=workers,
        threads=threads,
        methods=methods,
        repeat=repeat,
        dtypes=dtypes,
        on_point=progress,
    )
    click.echo(
        f"{rows:,} rows x {columns} {dtypes} columns, {partitions} partitions; {workers} "
        f"workers x {threads} threads of {worker_memory}, a fresh cluster per run\n"
        f"{machine_description()}"
    )
    summary = summarize_sweep(points)
    click.echo(format_sweep(summary))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "context": {
                        "rows": rows,
                        "columns": columns,
                        "dtypes": dtypes,
                        "partitions": partitions,
                        "workers": workers,
                        "threads_per_worker": threads,
                        "worker_memory": worker_memory,
                        "machine": machine_description(),
                        "versions": versions(),
                    },
                    "summary": summary,
                    "points": [asdict(p) for p in points],
                },
                f,
                indent=1,
            )
        click.echo(f"wrote {json_path}")


@main.command()
@click.argument("input", metavar="INPUT")
@click.argument("output", metavar="OUTPUT")
@click.option(
    "--on", "on", required=True, metavar="COL[,COL...]", help="Key column(s) to shuffle by."
)
@click.option(
    "--npartitions",
    type=click.IntRange(min=1),
    default=None,
    help="Output partitions, one file each.  [default: as many as the input]",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Workers of the embedded cluster.  [default: sized to the machine]",
)
@click.option(
    "--protocol",
    type=click.Choice(["tcp", "ucx"]),
    default="tcp",
    show_default=True,
    help="Comms of the embedded cluster.",
)
@click.option(
    "--memory-limit",
    default=None,
    help="Memory limit of each embedded worker, e.g. '8GiB'.  "
    "[default: the machine's memory shared among the workers]",
)
@click.option(
    "--scheduler",
    metavar="ADDRESS",
    default=None,
    help="Run on the cluster at this scheduler address instead of an embedded one; "
    "its workers must see INPUT and OUTPUT at the same paths (a shared filesystem).",
)
@click.option(
    "--backend",
    type=click.Choice(["auto", "pandas", "cudf"]),
    default="auto",
    show_default=True,
    help="Frames to shuffle: cuDF on GPU workers or pandas on CPU workers.  auto: cuDF "
    "where dask-cuda is installed and cuDF computes on a GPU (with --scheduler: where "
    "every worker is a dask-cuda worker), else pandas.",
)
@click.option(
    "--rmm",
    type=click.Choice(["pool", "async", "none"]),
    default="pool",
    show_default=True,
    help="Device memory of an embedded dask-cuda cluster: an RMM pool starting at half "
    "the device (needed for UCX), CUDA's async allocator, or plain cudaMalloc.",
)
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option(
    "--quiet", "-q", is_flag=True, help="No progress bar and no notes; the summary still prints."
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option(
    "--debug", is_flag=True, help="Show tracebacks, and the embedded scheduler's shuffle log."
)
def shuffle(
    input: str,
    output: str,
    on: str,
    npartitions: int | None,
    workers: int | None,
    protocol: str,
    memory_limit: str | None,
    scheduler: str | None,
    backend: str,
    rmm: str,
    overwrite: bool,
    quiet: bool,
    as_json: bool,
    debug: bool,
) -> None:
    """Shuffle the Parquet dataset INPUT by key into OUTPUT.

    INPUT is a Parquet file, a directory of them or a glob (quote it).  Rows
    with equal keys end up in the same output partition, the one dask's
    partitioning_index assigns, as with any dask shuffle.  OUTPUT becomes a
    directory with one file per output partition, part.N.parquet (N
    zero-padded, so names sort in partition order), and a _SUCCESS marker
    holding the summary.  It is written beside OUTPUT under a hidden name and
    renamed into place when complete, so a failed or interrupted run leaves
    OUTPUT as it was.

    \b
    Exit status: 0 done, 1 the shuffle failed, 2 bad arguments (input,
    output, key or scheduler), 130 interrupted (Ctrl-C), 143 terminated
    (SIGTERM).
    """
    from gpushuffle.cluster import ClusterOptions
    from gpushuffle.errors import JobError
    from gpushuffle.job import shuffle_parquet

    def note(message: str) -> None:
        if not quiet:
            click.echo(message, err=True)

    def fail(error: type[click.ClickException], message: str) -> click.ClickException:
        if debug:
            traceback.print_exc()
        return error(message)

    try:
        with _sigterm_interrupts():
            summary = shuffle_parquet(
                input,
                output,
                [c.strip() for c in on.split(",") if c.strip()],
                npartitions=npartitions,
                overwrite=overwrite,
                cluster=ClusterOptions(
                    scheduler=scheduler,
                    workers=workers,
                    protocol=protocol,
                    memory_limit=memory_limit,
                    rmm=rmm,
                ),
                progress=not quiet and sys.stderr.isatty(),
                note=note,
                debug=debug,
                backend=backend,
            )
    except JobError as e:
        raise fail(BadArguments, str(e)) from None
    except _SIGTERM:
        raise fail(Terminated, f"terminated; {output} left as it was") from None
    except KeyboardInterrupt:
        raise fail(Interrupted, f"interrupted; {output} left as it was") from None
    except Exception as e:
        lines = str(e).strip().splitlines()
        detail = f": {lines[0]}" if lines else ""
        raise fail(Failed, f"shuffle failed: {type(e).__name__}{detail}") from None
    if as_json:
        click.echo(json.dumps(summary.as_dict(), indent=2))
    else:
        click.echo(summary.format())


@main.command()
@click.option("--rows", default=4_000_000, show_default=True)
@click.option("--partitions", default=16, show_default=True)
@click.option("--workers", default=2, show_default=True)
def demo(rows: int, partitions: int, workers: int) -> None:
    """Shuffle a generated frame on an embedded local cluster and check it.

    On a machine with a usable GPU, dask-cuda and cuDF, the cluster is a
    LocalCUDACluster and the frame is cuDF-backed; otherwise CPU workers
    shuffle pandas partitions.  dask-cuda runs one worker per GPU, so on GPUs
    --workers is capped by their number (with one GPU no shard crosses the
    network: the check then covers partitioning, not the transport).
    """
    from distributed import Client, LocalCluster

    import gpushuffle
    from gpushuffle.bench import generated_frame
    from gpushuffle.cluster import _quiet_shuffle_log, detect_cluster_plan, embedded_worker_preloads

    plan = detect_cluster_plan()
    if plan.note:
        click.echo(plan.note)
    if plan.kind == "LocalCUDACluster":
        from dask_cuda import LocalCUDACluster

        from gpushuffle.cluster import rmm_options

        if workers > plan.gpus:
            click.echo(
                f"--workers {workers}: dask-cuda runs one worker per GPU; "
                f"using {plan.gpus} (one per visible GPU)"
            )
        cluster_cm: Any = LocalCUDACluster(
            n_workers=min(workers, plan.gpus),
            dashboard_address=":0",
            preload=embedded_worker_preloads(),  # as the CPU branch and cluster.connect do
            **rmm_options("pool"),
        )
    else:
        cluster_cm = LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            dashboard_address=":0",
            preload=embedded_worker_preloads(),
        )
    with cluster_cm as cluster, _quiet_shuffle_log(debug=False), Client(cluster) as client:
        nworkers = len(client.nthreads())
        click.echo(f"cluster: {plan.kind} with {nworkers} workers ({plan.backend} partitions)")
        df = generated_frame(rows, partitions, columns=8)
        if plan.backend == "cudf":
            df = df.to_backend("cudf")
        df = df.persist()
        nbytes = int(df.memory_usage(deep=True).sum().compute())
        start = time.perf_counter()
        out = gpushuffle.shuffle(df, "key").persist()
        lengths = out.map_partitions(len).compute()
        wall = time.perf_counter() - start
        # Every key must sit in exactly one output partition.
        keys = out.map_partitions(lambda p: p["key"].drop_duplicates()).compute()
        ok = int(lengths.sum()) == rows and bool(keys.is_unique)
        click.echo(
            f"shuffled {rows:,} rows ({nbytes / 2**30:.2f} GiB) into {len(lengths)} partitions "
            f"in {wall:.2f} s ({nbytes / 2**30 / wall:.2f} GiB/s); "
            f"every row present once, each key in one partition: {'yes' if ok else 'NO'}"
        )
        if not ok:
            sys.exit(1)


@main.command()
@click.option("--rounds", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--first",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="The first round's number: with --rounds 1, reruns that round alone.",
)
@click.option("--workers", type=click.IntRange(min=2), default=4, show_default=True)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run each round this many times (a fault that shows now and then).",
)
@click.option(
    "--recovery",
    type=click.Choice(["partial", "restart"]),
    default=None,
    help="gpushuffle.recovery for the rounds.  [default: as configured]",
)
@click.option("--json", "json_path", default=None, help="Write per-round results here.")
def soak(
    rounds: int,
    seed: int,
    first: int,
    workers: int,
    repeat: int,
    recovery: str | None,
    json_path: str | None,
) -> None:
    """Many seeded rounds of shuffles and merges with workers SIGKILLed at
    random moments, every output partition checked against the tasks method
    and the workers checked for leftovers (gpushuffle.soak).  Exit status 1
    if any round went wrong."""
    from gpushuffle.soak import format_round, run_soak

    def progress(result: Any) -> None:
        click.echo(format_round(result))

    with _sigterm_interrupts():
        results = run_soak(
            rounds=rounds,
            seed=seed,
            first=first,
            workers=workers,
            recovery=recovery,
            repeat=repeat,
            on_result=progress,
        )
    wrong = [r.round.number for r in results if not r.right]
    killed = sum(r.killed for r in results)
    mode = results[0].round.recovery if results else recovery
    click.echo(
        f"{len(results)} rounds (seed {seed}), {killed} workers killed, recovery {mode}: "
        + (f"rounds {wrong} went WRONG" if wrong else "every round right and clean")
    )
    if json_path:
        import dataclasses

        with open(json_path, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    if wrong:
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
