"""Shuffle a Parquet dataset by key on a Dask cluster: what ``gpushuffle shuffle`` runs.

A job, in order:

1. checks what it can before any cluster starts: the output (it must not exist
   unless ``overwrite``, must not hold the input nor lie inside an input
   directory), the input (Parquet files, read through their footers, which
   also gives the row count) and the key columns;
2. connects to a cluster: an embedded one sized to the machine, or an
   existing one at a scheduler address;
3. reads the input with dask, shuffles it with gpushuffle and writes one
   Parquet file per output partition into a hidden directory beside the
   output (``.NAME.tmp-XXXXXXXX``);
4. checks the written files (one per partition, as many rows as the input),
   writes a ``_SUCCESS`` marker holding the summary, and renames the
   directory to the output.

A job that fails or is interrupted removes its hidden directory, so the output
path holds either what it held before or a complete dataset with ``_SUCCESS``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from gpushuffle.cluster import (
    BACKENDS,
    ClusterOptions,
    _check_memory_limit,
    _first_line,
    check_gpu_workers,
    cluster_backend,
    connect,
    detect_cluster_plan,
    rmm_options,
)
from gpushuffle.errors import JobError

GIB = 2**30

#: Written last into a finished output, as Hadoop and Spark do.
SUCCESS = "_SUCCESS"


# -- input --------------------------------------------------------------------


@dataclass(frozen=True)
class InputInfo:
    """A Parquet input as found on disk, before dask reads it."""

    path: str
    #: What dask reads: the directory as given, or the list of files.
    source: str | list[str]
    files: list[str]
    rows: int
    file_bytes: int
    #: The Arrow schema of the first file (``pyarrow.Schema``).
    schema: Any


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def inspect_input(path: str) -> InputInfo:
    """Find the Parquet files of ``path`` (a file, a directory or a glob).

    Reads every file's footer, so a file that is not Parquet fails here, and
    counts the rows.  Directories are read as dask and pyarrow read them:
    recursively, skipping names that start with ``_`` or ``.``.
    """
    import glob

    import pyarrow as pa
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    if "://" in path:
        raise JobError(f"input {path}: only local paths are supported")
    source: str | list[str]
    if _is_glob(path):
        source = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not source:
            raise JobError(f"input not found: no file matches {path}")
    elif os.path.isdir(path) or os.path.isfile(path):
        source = path
    else:
        raise JobError(f"input not found: {path}")
    try:
        dataset = pads.dataset(source, format="parquet")
        files = list(dataset.files)
        if not files:
            raise JobError(f"no Parquet files in {path}")
        rows = dataset.count_rows()
        schema = pq.read_schema(files[0])
    except PermissionError as e:
        raise JobError(f"cannot read the input: {_first_line(e)}") from e
    except (pa.ArrowException, OSError) as e:
        raise JobError(f"input is not Parquet: {_first_line(e)}") from e
    return InputInfo(
        path=path,
        source=source if isinstance(source, str) else files,
        files=files,
        rows=rows,
        file_bytes=sum(os.path.getsize(f) for f in files),
        schema=schema,
    )


def read_input(info: InputInfo, backend: str = "pandas") -> Any:
    """The input as a dask DataFrame."""
    import dask
    import dask.dataframe as dd

    try:
        with dask.config.set({"dataframe.backend": backend}):
            return dd.read_parquet(info.source)
    except Exception as e:
        raise JobError(f"cannot read {info.path} with dask: {_first_line(e)}") from e


def check_columns(on: Sequence[str], meta: Any, path: str) -> None:
    """Raise :class:`JobError` naming the existing columns if a key is missing."""
    if not on:
        raise JobError("no key column given: pass --on COL[,COL...]")
    index = meta.index.name
    valid = set(meta.columns)
    if len(on) == 1 and index is not None:
        valid.add(index)
    missing = [c for c in on if c not in valid]
    if not missing:
        return
    columns = [str(c) for c in meta.columns]
    shown = ", ".join(columns[:30]) + (
        f", ... ({len(columns)} in all)" if len(columns) > 30 else ""
    )
    if index is not None:
        shown += f"; index: {index}"
    what = "key column" if len(missing) == 1 else "key columns"
    raise JobError(f"{what} {', '.join(map(repr, missing))} not in {path}; its columns: {shown}")


# -- output -------------------------------------------------------------------


def check_output(output: str, overwrite: bool, info: InputInfo) -> Path:
    """The absolute output path, if the job may write it.

    Refuses an existing output without ``overwrite``, an output that holds
    the input (replacing it would delete the input) and an output inside an
    input directory (the next read of the input would include it).
    """
    if "://" in output:
        raise JobError(f"output {output}: only local paths are supported")
    out = Path(os.path.abspath(output))
    exists = os.path.lexists(out)
    if exists and not overwrite:
        raise JobError(f"output exists: {output} (pass --overwrite to replace it)")
    real = os.path.realpath(out)

    def within(path: str, directory: str) -> bool:
        return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)

    if isinstance(info.source, str) and os.path.isdir(info.source):
        source = os.path.realpath(info.source)
        if within(real, source) and real != source:
            raise JobError(
                f"output {output} is inside the input directory {info.path}; "
                "reading the input again would include it"
            )
    if exists and any(within(os.path.realpath(f), real) for f in info.files):
        raise JobError(f"output {output} holds the input; replacing it would delete the input")
    return out


def _make_temporary(out: Path) -> Path:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as e:
        raise JobError(f"cannot create the output directory: {_first_line(e)}") from e
    return tmp


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _commit(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``, replacing what is there."""
    if os.path.lexists(out):
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        _remove(old)
    else:
        os.rename(tmp, out)


def part_name(width: int, i: int) -> str:
    """``part.00007.parquet``: zero-padded, so names sort in partition order."""
    return f"part.{i:0{width}d}.parquet"


def _output_schema(info: InputInfo, meta: Any, keep_index: bool) -> Any:
    """The input's Arrow schema if it describes the output exactly, else ``"infer"``.

    Writing with the input's schema keeps its types (and an empty partition
    still gets them); a schema that does not match, such as hive-partitioned
    input whose partition columns live in directory names, is left to dask.
    """
    names = [str(c) for c in meta.columns]
    if keep_index:
        names.append(str(meta.index.name))
    schema = info.schema.remove_metadata()
    return schema if sorted(schema.names) == sorted(names) else "infer"


def _verify(tmp: Path, npartitions: int, rows: int) -> tuple[int, int]:
    """Files and rows written match what was asked; ``(rows, bytes)`` on disk."""
    import pyarrow.parquet as pq

    files = sorted(tmp.glob("part.*.parquet"))
    if len(files) != npartitions:
        raise RuntimeError(f"wrote {len(files)} files for {npartitions} output partitions")
    written = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    if written != rows:
        raise RuntimeError(f"wrote {written:,} rows but the input has {rows:,}")
    return written, sum(f.stat().st_size for f in files)


# -- cluster ------------------------------------------------------------------


def _worker_counters(span_id: str | None, dask_worker: Any) -> dict[str, int]:
    """Shard bytes this job's span produced, and bytes spilled so far.

    From distributed's fine performance metrics: gpushuffle's transfer
    records ``p2p-shards`` bytes; a worker's ``SpillBuffer`` records
    ``disk-write`` bytes whenever it spills a task result.  Plus the bytes
    gpushuffle's store moved down a tier.  (``p2p`` with
    ``disk=True`` also records ``disk-write`` under its own context, which is
    not spilling and is left out.)
    """
    shard_bytes = spilled = 0.0
    for key, value in dask_worker.digests_total.items():
        if not isinstance(key, tuple) or len(key) < 3:
            continue
        if key[0] == "p2p":
            if key[1] == span_id and key[-2:] == ("shards", "bytes"):
                shard_bytes += value
        elif key[-2:] == ("disk-write", "bytes"):
            spilled += value
    # And what gpushuffle's own store moved down a tier (device -> host -> disk).
    from gpushuffle.engine.memory import worker_memory

    spilled += worker_memory().snapshot()["spilled_bytes"]
    return {"shard_bytes": int(shard_bytes), "spilled": int(spilled)}


# -- the job ------------------------------------------------------------------


@dataclass
class Summary:
    """What a finished job reports; see the README for each figure."""

    input: str
    output: str
    on: list[str]
    rows: int
    bytes: int
    input_files: int
    input_file_bytes: int
    input_partitions: int
    output_partitions: int
    output_file_bytes: int
    wall_s: float
    gib_per_s: float
    peak_worker_rss_bytes: int
    bytes_spilled: int
    workers: int
    backend: str = "pandas"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        from dask.utils import format_bytes

        spilled = format_bytes(self.bytes_spilled) if self.bytes_spilled else "0"
        return "\n".join(
            [
                f"shuffled {self.input} by {','.join(self.on)} into {self.output}",
                f"  rows                {self.rows:,}",
                f"  bytes               {format_bytes(self.bytes)} shuffled in memory "
                f"(input: {self.input_files} files, {format_bytes(self.input_file_bytes)})",
                f"  output partitions   {self.output_partitions} files, "
                f"{format_bytes(self.output_file_bytes)} "
                f"(input: {self.input_partitions} partitions)",
                f"  wall time           {self.wall_s:.2f} s",
                f"  throughput          {self.gib_per_s:.3f} GiB/s",
                f"  peak worker memory  {format_bytes(self.peak_worker_rss_bytes)} "
                f"(RSS of the largest of {self.workers} workers)",
                f"  bytes spilled       {spilled}",
                f"  frames              {self.backend}",
            ]
        )


def shuffle_parquet(
    input: str,
    output: str,
    on: Sequence[str],
    *,
    npartitions: int | None = None,
    overwrite: bool = False,
    cluster: ClusterOptions | None = None,
    progress: bool = False,
    note: Callable[[str], None] = lambda message: None,
    debug: bool = False,
    backend: str = "auto",
) -> Summary:
    """Shuffle the Parquet dataset ``input`` by ``on`` into ``output``.

    Raises :class:`JobError` for problems with the arguments (before any
    cluster starts where it can), and the task's own error if the
    computation fails; ``KeyboardInterrupt`` passes through.  In every case
    but success ``output`` is left as it was.
    """
    import gpushuffle

    options = cluster or ClusterOptions()
    on = list(on)
    if options.scheduler and (
        options.workers
        or options.memory_limit
        or options.protocol != "tcp"
        or options.rmm != "pool"
    ):
        raise JobError(
            "--workers, --protocol, --memory-limit and --rmm apply only without --scheduler"
        )
    if backend not in BACKENDS:
        raise JobError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    rmm_options(options.rmm)
    _check_memory_limit(options.memory_limit)
    info = inspect_input(input)
    out = check_output(output, overwrite, info)

    def prepare(frame_backend: str) -> tuple[Any, Any, int, bool]:
        df = read_input(info, frame_backend)
        check_columns(on, df._meta, input)
        nout = npartitions or df.npartitions
        if nout < 1:
            raise JobError(f"--npartitions must be at least 1, got {nout}")
        keep_index = df._meta.index.name is not None
        shuffled = gpushuffle.shuffle(
            df, on if len(on) > 1 else on[0], nout, ignore_index=not keep_index
        )
        return df, shuffled, nout, keep_index

    plan = None
    if not options.scheduler:
        # Everything that can be wrong is found before a cluster starts.
        plan = detect_cluster_plan(backend)
        check_gpu_workers(plan, options.workers)
        chosen = plan.backend
        df, shuffled, nout, keep_index = prepare(chosen)

    tmp: Path | None = None
    try:
        with connect(options, plan, note, debug) as client:
            if plan is None:
                chosen = cluster_backend(client, backend)
                note(f"partitions: {chosen}")
                df, shuffled, nout, keep_index = prepare(chosen)
            tmp = _make_temporary(out)
            write = shuffled.to_parquet(
                str(tmp),
                compute=False,
                write_index=keep_index,
                write_metadata_file=False,
                name_function=partial(part_name, len(str(nout - 1))),
                # dask_cudf's writer takes no Arrow schema; cuDF keeps its types.
                **(
                    {"schema": _output_schema(info, shuffled._meta, keep_index)}
                    if chosen == "pandas"
                    else {}
                ),
            )
            wall, peak, shard_bytes, spilled, nworkers = _compute(client, write, progress)
        rows, out_bytes = _verify(tmp, nout, info.rows)
        summary = Summary(
            input=input,
            output=output,
            on=on,
            rows=rows,
            bytes=shard_bytes,
            input_files=len(info.files),
            input_file_bytes=info.file_bytes,
            input_partitions=df.npartitions,
            output_partitions=nout,
            output_file_bytes=out_bytes,
            wall_s=wall,
            gib_per_s=shard_bytes / GIB / wall if wall > 0 else 0.0,
            peak_worker_rss_bytes=peak,
            bytes_spilled=spilled,
            workers=nworkers,
            backend=chosen,
        )
        (tmp / SUCCESS).write_text(json.dumps(summary.as_dict(), indent=2) + "\n")
        _commit(tmp, out)
        return summary
    finally:
        if tmp is not None and os.path.lexists(tmp):
            _remove(tmp)


def _compute(client: Any, write: Any, progress: bool) -> tuple[float, int, int, int, int]:
    """Run ``write``; wall time, peak worker RSS, shard bytes, bytes spilled, workers."""
    from distributed import span

    from gpushuffle.bench import _start_sampler, _stop_sampler

    sampler = f"shuffle-{uuid.uuid4().hex}"
    client.run(_start_sampler, name=sampler)
    before = client.run(_worker_counters, None)
    samples: dict[str, Any] = {}
    future = None
    try:
        start = time.perf_counter()
        # Optimized here, not by compute: dask 2026.7.1's compute stops at the
        # physical plan without blockwise fusion; fused, each input file is
        # read in its transfer task and each output written in its unpack
        # task (no partition held between two tasks).  Outside the span, whose
        # annotations dask's optimizer warns about.
        optimized = write.optimize()
        with span("gpushuffle shuffle") as span_id:
            future = client.compute(optimized)
        if progress:
            _show_progress(client, future)
        future.result()
        wall = time.perf_counter() - start
    except BaseException:
        if future is not None:
            with contextlib.suppress(Exception):
                client.cancel(future)
        raise
    finally:
        with contextlib.suppress(Exception):
            samples = client.run(_stop_sampler, name=sampler, on_error="ignore")
    after = client.run(_worker_counters, span_id)
    peak = max((s["peak"] for s in samples.values()), default=0)
    shard_bytes = sum(c["shard_bytes"] for c in after.values())
    spilled = sum(c["spilled"] - before.get(w, {"spilled": 0})["spilled"] for w, c in after.items())
    return wall, peak, shard_bytes, spilled, len(after)


def _show_progress(client: Any, future: Any) -> None:
    from gpushuffle.progress import PhaseProgress

    try:
        PhaseProgress([future], client.scheduler.address).run(client)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception:  # pragma: no cover - a display problem must not fail the job
        logging.getLogger(__name__).debug("progress display failed", exc_info=True)
