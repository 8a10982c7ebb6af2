"""The ``gpushuffle`` command line: ``shuffle`` end to end and its errors, ``bench --plot``.

Most tests run ``gpushuffle shuffle --scheduler`` in-process (click's
``CliRunner``) against the session's cluster, so they start no cluster of
their own; one test per concern runs the real console script with an
embedded cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from distributed.diagnostics.plugin import SchedulerPlugin
from pandas_versions import BORROWS_FROM_INPUTS
from truth import checksum, partitions_of

from gpushuffle import cluster as cluster_plans
from gpushuffle import job
from gpushuffle.cli import main
from gpushuffle.errors import JobError

pytestmark = pytest.mark.timeout(180)

GPUSHUFFLE = str(Path(sys.executable).parent / "gpushuffle")


def make_events(root: Path, files: int, rows: int, seed: int = 0) -> Path:
    """A multi-file Parquet dataset of click events: skewed user ids, strings, nulls, times."""
    root.mkdir(parents=True, exist_ok=True)
    assert rows % files == 0
    for i in range(files):
        rng = np.random.default_rng(seed + i)
        n = int(rows // files + 50 * (i - (files - 1) / 2))  # sizes differ; `rows` in all
        coupon = np.where(rng.random(n) < 0.3, None, rng.choice(["SPRING", "VIP"], n))
        pd.DataFrame(
            {
                "event_id": np.arange(n) + 1_000_000 * i,
                "user_id": rng.zipf(1.5, n) % 1000,
                "kind": rng.choice(["view", "click", "cart", "buy"], n),
                "amount": rng.gamma(2.0, 20.0, n).round(2),
                "ts": pd.Timestamp("2026-01-01")
                + pd.to_timedelta(rng.integers(0, 86400 * 30, n), unit="s"),
                "coupon": pd.array(coupon, dtype="string"),
            }
        ).to_parquet(root / f"events-{i:03d}.parquet", index=False)
    return root


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> Path:
    return make_events(tmp_path_factory.mktemp("data") / "events", files=5, rows=4000)


def gpushuffle(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def leftovers(directory: Path) -> list[str]:
    """Hidden temporary directories a job left beside its output."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``df`` (index ignored) in a canonical order, to compare multisets."""
    return df.sort_values(list(df.columns), kind="stable").reset_index(drop=True)


def read_files(out: Path) -> list[pd.DataFrame]:
    # The files record a string column as "string"; pandas 2 reads that back
    # as string[python] unless told which storage (pandas 3: Arrow's).
    with pd.option_context("mode.string_storage", "pyarrow"):
        return [pd.read_parquet(f) for f in sorted(out.glob("part.*.parquet"))]


# -- round trips --------------------------------------------------------------


def test_round_trip(client, cluster, events, tmp_path):
    out = tmp_path / "by_user"
    r = gpushuffle(
        "shuffle", events, out, "--on", "user_id", "--npartitions", 7,
        "--scheduler", cluster.scheduler_address, "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)

    names = sorted(p.name for p in out.iterdir())
    assert names == ["_SUCCESS"] + [f"part.{i}.parquet" for i in range(7)]
    assert json.loads((out / "_SUCCESS").read_text()) == summary
    assert leftovers(tmp_path) == []

    # Every row present once.  (Compared with the input as dask reads it:
    # dask turns strings into string[pyarrow], and the files record that.)
    source = dd.read_parquet(events).compute()
    parts = read_files(out)
    whole = pd.concat(parts, ignore_index=True)
    assert len(whole) == len(source)
    pd.testing.assert_frame_equal(rows(whole), rows(source))

    # Each file holds exactly the rows dask's own shuffle puts in that partition.
    truth = partitions_of(
        dd.read_parquet(events).shuffle(
            "user_id", npartitions=7, ignore_index=True, shuffle_method="tasks"
        )
    )
    for i, (ours, theirs) in enumerate(zip(parts, truth, strict=True)):
        assert len(ours) == len(theirs), f"file {i}"
        assert checksum(ours, index=False) == checksum(theirs, index=False), f"file {i}"
    keys = [set(p["user_id"]) for p in parts]
    assert sum(len(k) for k in keys) == len(set().union(*keys))

    # The output keeps the input's Arrow types, including in empty files.
    in_schema = pq.read_schema(next(events.glob("*.parquet")))
    for f in out.glob("part.*.parquet"):
        assert pq.read_schema(f).remove_metadata() == in_schema.remove_metadata()

    assert summary["rows"] == len(source)
    assert summary["output_partitions"] == 7
    assert summary["input_files"] == 5
    assert summary["input_partitions"] == 5
    assert summary["on"] == ["user_id"]
    assert summary["workers"] == 2
    assert summary["bytes"] > 0
    assert summary["wall_s"] > 0
    assert summary["gib_per_s"] == pytest.approx(summary["bytes"] / 2**30 / summary["wall_s"])
    assert summary["peak_worker_rss_bytes"] > 10 * 2**20
    assert summary["bytes_spilled"] == 0
    assert summary["output_file_bytes"] == sum(f.stat().st_size for f in out.glob("part.*"))


def test_several_keys_default_partitions_and_summary_text(client, cluster, events, tmp_path):
    out = tmp_path / "by_user_kind"
    r = gpushuffle(
        "shuffle", str(events / "*.parquet"), out, "--on", "user_id,kind",
        "--scheduler", cluster.scheduler_address,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"cluster: {cluster.scheduler_address}, 2 workers" in r.stderr
    for figure in (
        "rows                4,000",
        "bytes ",
        "output partitions   5 files",
        "wall time",
        "throughput",
        "peak worker memory",
        "bytes spilled       0",
    ):
        assert figure in r.stdout

    parts = read_files(out)
    truth = partitions_of(
        dd.read_parquet(sorted(events.glob("*.parquet"))).shuffle(
            ["user_id", "kind"], ignore_index=True, shuffle_method="tasks"
        )
    )
    assert len(parts) == len(truth) == 5
    for ours, theirs in zip(parts, truth, strict=True):
        assert checksum(ours, index=False) == checksum(theirs, index=False)


class _CountTasks(SchedulerPlugin):
    """A scheduler plugin counting the tasks run (processing -> memory) by name."""

    name = "test-count-tasks"

    def __init__(self) -> None:
        self.names: list[str] = []

    def transition(self, key, start, finish, *args, **kwargs):
        if (start, finish) == ("processing", "memory"):
            name = key[0] if isinstance(key, tuple) else key
            self.names.append(name.rsplit("-", 1)[0])  # less the token


def test_files_are_read_in_transfers_and_written_in_unpacks(client, cluster, events, tmp_path):
    """The command fuses what dask's ``compute`` leaves unfused (dask
    2026.7.1): each input file is read inside its transfer task and each
    output file written inside its unpack task, so no partition waits in
    worker memory between two tasks; one task per input and per output."""
    counter = _CountTasks()
    cluster.scheduler.add_plugin(counter)
    try:
        out = tmp_path / "fused"
        r = gpushuffle(
            "shuffle", str(events / "*.parquet"), out, "--on", "user_id", "--npartitions", "7",
            "--quiet", "--scheduler", cluster.scheduler_address,
        )  # fmt: skip
    finally:
        cluster.scheduler.remove_plugin(name=counter.name)
    assert r.exit_code == 0, r.output
    names = counter.names
    assert names.count("gpushuffle-transfer") == 5, names
    outputs = [n for n in names if n.startswith("gpushuffle-") and n != "gpushuffle-transfer"]
    # The unpack, then dask's steps before the write (reset_index), then the write.
    assert len(outputs) == 7 and all(n.endswith("-toparquetdata") for n in outputs), names
    assert len(names) == 5 + 1 + 7 + 1, names  # and the shuffle's and the write's barriers
    assert len(read_files(out)) == 7


def test_named_index_is_kept(client, cluster, tmp_path):
    source = tmp_path / "indexed"
    source.mkdir()
    frames = []
    for i in range(3):
        df = pd.DataFrame(
            {"key": np.arange(50) % 7, "value": np.arange(50.0) + i},
            index=pd.Index(np.arange(50) + 50 * i, name="row"),
        )
        df.to_parquet(source / f"p{i}.parquet")
        frames.append(df)
    out = tmp_path / "out"
    r = gpushuffle(
        "shuffle", source, out, "--on", "key", "--quiet", "--scheduler", cluster.scheduler_address
    )
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    whole = pd.concat(read_files(out))
    assert whole.index.name == "row"
    pd.testing.assert_frame_equal(whole.sort_index(), pd.concat(frames).sort_index())


def test_overwrite_replaces_the_output(client, cluster, events, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.parquet").write_text("old")
    r = gpushuffle(
        "shuffle", events, out, "--on", "user_id", "--npartitions", 2,
        "--overwrite", "--scheduler", cluster.scheduler_address,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == [
        "_SUCCESS",
        "part.0.parquet",
        "part.1.parquet",
    ]
    assert leftovers(tmp_path) == []


def test_interrupted_job_leaves_the_output_as_it_was(
    client, cluster, events, tmp_path, monkeypatch
):
    # Ctrl-C after every file is written, before _SUCCESS and the rename.
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "_verify", interrupt)
    out = tmp_path / "out"
    r = gpushuffle(
        "shuffle", events, out, "--on", "user_id", "--scheduler", cluster.scheduler_address
    )
    assert r.exit_code == 130
    assert r.stderr.splitlines()[-1] == f"Error: interrupted; {out} left as it was"
    assert not out.exists()
    assert leftovers(tmp_path) == []

    out.mkdir()
    (out / "keep.txt").write_text("precious")
    r = gpushuffle(
        "shuffle", events, out, "--on", "user_id", "--overwrite",
        "--scheduler", cluster.scheduler_address,
    )  # fmt: skip
    assert r.exit_code == 130
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert leftovers(tmp_path) == []


def test_failed_job_is_one_line_and_exit_status_1(client, cluster, events, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(job, "_verify", broken)
    out = tmp_path / "out"
    args = ["shuffle", events, out, "--on", "user_id", "--scheduler", cluster.scheduler_address]
    r = gpushuffle(*args)
    assert r.exit_code == 1
    assert r.stderr.splitlines()[-1] == "Error: shuffle failed: RuntimeError: disk on fire"
    assert "Traceback" not in r.stderr
    assert not out.exists() and leftovers(tmp_path) == []

    r = gpushuffle(*args, "--debug")
    assert r.exit_code == 1
    assert "Traceback" in r.stderr


def test_progress_bars_show_each_phase(client, cluster, events, tmp_path, capsys):
    job.shuffle_parquet(
        str(events),
        str(tmp_path / "out"),
        ["user_id"],
        npartitions=3,
        cluster=cluster_plans.ClusterOptions(scheduler=cluster.scheduler_address),
        progress=True,
    )
    err = capsys.readouterr().err
    for line in ("5/5", "transfer ", "unpack ", "3/3", "write "):
        assert line in err
    # Files are read inside the transfer tasks: no read phase of its own.
    assert "barrier" not in err and "read " not in err


def test_phase_of_task_keys():
    from gpushuffle.progress import phase_of

    token = "e3b292791278554e8bb2a11593791b6f"
    assert phase_of((f"gpushuffle-transfer-{token}", 3)) == "transfer"
    assert phase_of((f"gpushuffle-unpack-{token}", 0)) == "unpack"
    assert phase_of((f"gpushuffle-toparquetdata-{token}", 0)) == "unpack"  # fused
    assert phase_of((f"gpushuffle-lambda-getitem-{token}", 0)) == "unpack"
    assert phase_of(f"shuffle-barrier-{token}") == "barrier"
    assert phase_of((f"read_parquet-{token}", 1)) == "read"
    assert phase_of((f"read_parquet-operation-{token}", 1)) == "read"
    assert phase_of((f"toparquetdata-{token}", 1)) == "write"
    assert phase_of((f"reset_index-toparquetdata-{token}", 1)) == "write"
    assert phase_of((f"toparquetbarrier-{token}", 0)) == "write"
    assert phase_of((f"operation-{token}", 0)) == "operation"


# -- the console script with an embedded cluster ------------------------------


def test_console_script_on_an_embedded_cluster(events, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [GPUSHUFFLE, "shuffle", events, out, "--on", "user_id", "--workers", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["rows"] == 4000 and summary["workers"] == 2
    # Not a terminal: notes, but no progress bar and no log lines.
    assert proc.stderr.startswith("cluster: embedded LocalCluster, 2 workers x 1 thread")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert len(list(out.glob("part.*.parquet"))) == 5


@pytest.mark.ucx
def test_console_script_over_ucx(events, tmp_path):
    pytest.importorskip("distributed_ucxx", reason="the ucx extra is not installed")
    env = {
        **os.environ,
        "UCX_TLS": "tcp,self,sm",
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        "DASK_DISTRIBUTED__COMM__UCX__CREATE_CUDA_CONTEXT": "False",
    }
    out = tmp_path / "out"
    proc = subprocess.run(
        [GPUSHUFFLE, "shuffle", events, out, "--on", "user_id", "--workers", "2",
         "--protocol", "ucx", "--json"],
        capture_output=True, text=True, timeout=150, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert ", ucx; dashboard" in proc.stderr
    assert json.loads(proc.stdout)["rows"] == 4000
    whole = pd.concat(read_files(out), ignore_index=True)
    assert checksum(whole, index=False) == checksum(pd.read_parquet(events), index=False)


SLOW_UNPACK = """
# Worker preload: output partition 1 takes a minute to unpack.
import os, time
import gpushuffle.engine.tasks as tasks

_unpack = getattr(tasks.unpack, "__wrapped__", tasks.unpack)  # imported more than once


def unpack(id, output_partition, barrier_run_id):
    if output_partition == 1:
        open(os.environ["GPUSHUFFLE_TEST_MARKER"], "w").close()
        time.sleep(60)
    return _unpack(id, output_partition, barrier_run_id)


unpack.__wrapped__ = _unpack
tasks.unpack = unpack
"""


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_masks(pid: int) -> dict[str, str]:
    """A process's blocked, ignored and caught signals (hex masks, /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(
                line.strip().split(":\t")
                for line in f
                if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
            )
    except OSError as e:  # not Linux, or the process is gone
        return {"unknown": str(e)}


@pytest.mark.parametrize(
    "how, status, word",
    [
        # Ctrl-C in a terminal: SIGINT to the whole process group, workers included.
        (lambda pid: os.killpg(pid, signal.SIGINT), 130, "interrupted"),
        # `timeout`, a cancelled CI job: SIGTERM to the process.
        (lambda pid: os.kill(pid, signal.SIGTERM), 143, "terminated"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_interrupted_while_writing_leaves_no_output(how, status, word, events, tmp_path):
    preload = tmp_path / "slow_unpack.py"
    preload.write_text(SLOW_UNPACK)
    marker = tmp_path / "unpacking"
    out = tmp_path / "out"
    env = {
        **os.environ,
        "GPUSHUFFLE_TEST_MARKER": str(marker),
        "DASK_DISTRIBUTED__WORKER__PRELOAD": json.dumps([str(preload)]),
        "PYTHONFAULTHANDLER": "1",
    }
    proc = subprocess.Popen(
        [GPUSHUFFLE, "shuffle", events, out, "--on", "user_id", "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        # As in a terminal: a command a shell without job control started in
        # the background (`cmd &` in a script, as CI may be) ignores SIGINT,
        # and its children inherit that, so Ctrl-C would never arrive.
        preexec_fn=_sigint_as_in_a_terminal,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "output partition 1 never started"
            time.sleep(0.05)
        time.sleep(0.5)  # other partitions' files are written meanwhile
        signals = _signal_masks(proc.pid)
        how(proc.pid)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Where it hangs: faulthandler prints every thread's stack on SIGABRT.
            proc.send_signal(signal.SIGABRT)
            stdout, stderr = proc.communicate(timeout=30)
            pytest.fail(
                f"still running 60 s after the signal; its signal masks then: {signals}; "
                f"this process's SIGINT handler: {signal.getsignal(signal.SIGINT)}\n"
                f"{stdout}\n{stderr}"
            )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, stderr
    assert stdout == ""
    # One line from gpushuffle; no tracebacks from the workers.
    assert stderr.splitlines()[-1] == f"Error: {word}; {out} left as it was"
    assert "Traceback" not in stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slow_unpack.py", "unpacking"]


def test_embedded_workers_drop_a_failed_heartbeat_only_while_they_shut_down(caplog):
    """The race behind a traceback seen on SIGTERM: a heartbeat in flight as the cluster closes.

    The embedded cluster's worker preload leaves that record out once its
    worker is closing; the same failure while the worker runs still shows.
    """
    import asyncio
    import logging

    from distributed import Scheduler, Worker

    from gpushuffle import _embedded_worker

    message = "Failed to communicate with scheduler during heartbeat."
    logger = logging.getLogger("distributed.worker")
    filters = list(logger.filters)
    sigint = signal.getsignal(signal.SIGINT)
    state_machine = logging.getLogger("distributed.worker.state_machine")
    state_machine_level = state_machine.level

    async def run() -> tuple[list[str], list[str]]:
        async with Scheduler(dashboard_address=":0") as s, Worker(s.address) as w:
            _embedded_worker.dask_setup(w)
            caplog.clear()
            logger.error(message)
            while_running = [r.getMessage() for r in caplog.records]
            await w.close()
            caplog.clear()
            logger.error(message)
            logger.error("another error while closing")
            while_closed = [r.getMessage() for r in caplog.records]
        return while_running, while_closed

    try:
        with caplog.at_level(logging.ERROR, logger="distributed.worker"):
            while_running, while_closed = asyncio.run(run())
    finally:
        logger.filters[:] = filters
        signal.signal(signal.SIGINT, sigint)
        state_machine.setLevel(state_machine_level)
    assert while_running == [message]
    assert while_closed == ["another error while closing"]


# -- errors: one line on stderr, exit status 2 ---------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def error_cases(events, tmp_path):
    (tmp_path / "notes.parquet").write_text("not parquet at all")
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken").mkdir()
    return tmp_path


ERRORS = {
    "input missing": (
        ["{tmp}/nowhere", "{tmp}/out", "--on", "user_id"],
        "Error: input not found: {tmp}/nowhere",
    ),
    "glob matches nothing": (
        ["{tmp}/nowhere/*.parquet", "{tmp}/out", "--on", "user_id"],
        r"Error: input not found: no file matches {tmp}/nowhere/\*\.parquet",
    ),
    "file not Parquet": (
        ["{tmp}/notes.parquet", "{tmp}/out", "--on", "user_id"],
        "Error: input is not Parquet: .*notes.parquet.*",
    ),
    "directory of CSV": (
        ["{tmp}/csv", "{tmp}/out", "--on", "user_id"],
        "Error: input is not Parquet: .*data.csv.*",
    ),
    "empty directory": (
        ["{tmp}/empty", "{tmp}/out", "--on", "user_id"],
        "Error: no Parquet files in {tmp}/empty",
    ),
    "key column absent": (
        ["{events}", "{tmp}/out", "--on", "user"],
        "Error: key column 'user' not in {events}; "
        "its columns: event_id, user_id, kind, amount, ts, coupon",
    ),
    "no key column": (
        ["{events}", "{tmp}/out", "--on", ","],
        r"Error: no key column given: pass --on COL\[,COL\.\.\.\]",
    ),
    "key columns absent": (
        ["{events}", "{tmp}/out", "--on", "user_id,day,hour"],
        "Error: key columns 'day', 'hour' not in {events}; its columns: event_id, .*",
    ),
    "output exists": (
        ["{events}", "{tmp}/taken", "--on", "user_id"],
        r"Error: output exists: {tmp}/taken \(pass --overwrite to replace it\)",
    ),
    "output holds the input": (
        ["{events}", "{events}", "--on", "user_id", "--overwrite"],
        "Error: output {events} holds the input; replacing it would delete the input",
    ),
    "output inside the input": (
        ["{events}", "{events}/shuffled", "--on", "user_id"],
        "Error: output {events}/shuffled is inside the input directory {events}; .*",
    ),
    "scheduler unreachable": (
        ["{events}", "{tmp}/out", "--on", "user_id", "--scheduler", "tcp://127.0.0.1:{port}"],
        "Error: cannot reach scheduler tcp://127.0.0.1:{port}: .*",
    ),
    "scheduler with cluster options": (
        ["{events}", "{tmp}/out", "--on", "user_id", "--scheduler", "tcp://x:1", "--workers", "2"],
        "Error: --workers, --protocol, --memory-limit and --rmm apply only without --scheduler",
    ),
    "bad memory limit": (
        ["{events}", "{tmp}/out", "--on", "user_id", "--memory-limit", "lots"],
        "Error: invalid --memory-limit 'lots': .*",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case, events, error_cases):
    args, message = ERRORS[case]
    fields = {"tmp": error_cases, "events": events, "port": free_port()}
    before = sorted(os.listdir(error_cases))
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        r = gpushuffle("shuffle", *(a.format(**fields) for a in args))
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    assert len(r.stderr.splitlines()) == 1, r.stderr
    pattern = message.format(**{k: re.escape(str(v)) for k, v in fields.items()})
    assert re.fullmatch(pattern, r.stderr.strip()), r.stderr
    assert sorted(os.listdir(error_cases)) == before  # nothing written, nothing left


def test_cluster_without_workers(events, tmp_path):
    from distributed import LocalCluster

    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as empty:
        r = gpushuffle(
            "shuffle", events, tmp_path / "out", "--on", "user_id",
            "--scheduler", empty.scheduler_address,
        )  # fmt: skip
    assert r.exit_code == 2
    assert r.stderr == f"Error: the cluster at {empty.scheduler_address} has no workers\n"
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_the_traceback(events, tmp_path):
    r = gpushuffle("shuffle", events, tmp_path / "out", "--on", "user", "--debug")
    assert r.exit_code == 2
    assert "Traceback (most recent call last)" in r.stderr
    assert r.stderr.splitlines()[-1].startswith("Error: key column 'user' not in")


def test_bad_option_values_are_usage_errors(events, tmp_path):
    r = gpushuffle("shuffle", events, tmp_path / "out", "--on", "user_id", "--npartitions", 0)
    assert r.exit_code == 2
    assert "Invalid value for '--npartitions'" in r.stderr


# -- cluster choice --------------------------------------------------------------


def test_cluster_plan():
    plan = cluster_plans.plan_cluster
    h200 = cluster_plans.GpuInfo("H200", 1)
    assert plan(dask_cuda=False, gpu=None, cudf_backend=False).kind == "LocalCluster"
    assert plan(dask_cuda=False, gpu=h200, cudf_backend=True).kind == "LocalCluster"
    assert plan(dask_cuda=True, gpu=None, cudf_backend=True).kind == "LocalCluster"
    # A usable GPU without a loadable cuDF backend: CPU workers, and the note says why.
    cpu = plan(dask_cuda=True, gpu=h200, cudf_backend=False)
    assert (cpu.kind, cpu.backend) == ("LocalCluster", "pandas")
    assert cpu.note is not None and "does not load" in cpu.note
    gpu = plan(dask_cuda=True, gpu=h200, cudf_backend=True)
    assert (gpu.kind, gpu.backend, gpu.gpus) == ("LocalCUDACluster", "cudf", 1)
    # Asked for: pandas always; cuDF or a clear error naming what is missing.
    assert plan(dask_cuda=True, gpu=h200, cudf_backend=True, backend="pandas").backend == "pandas"
    with pytest.raises(JobError, match="--backend cudf: no GPU on which cuDF can compute"):
        plan(dask_cuda=True, gpu=None, cudf_backend=True, backend="cudf")
    with pytest.raises(JobError, match="dask-cuda is not installed"):
        plan(dask_cuda=False, gpu=None, cudf_backend=False, backend="cudf")


def test_more_gpu_workers_than_gpus_is_a_usage_error():
    gpu = cluster_plans.plan_cluster(
        dask_cuda=True, gpu=cluster_plans.GpuInfo("H200", 1), cudf_backend=True
    )
    cluster_plans.check_gpu_workers(gpu, 1)
    cluster_plans.check_gpu_workers(gpu, None)
    with pytest.raises(JobError, match="one worker per GPU and 1 GPU is visible"):
        cluster_plans.check_gpu_workers(gpu, 2)
    cpu = cluster_plans.plan_cluster(dask_cuda=False, gpu=None, cudf_backend=False)
    cluster_plans.check_gpu_workers(cpu, 8)  # CPU workers: any number


def test_backend_cudf_without_a_gpu_exits_2(events, tmp_path):
    result = gpushuffle("shuffle", events, tmp_path / "out", "--on", "user_id", "--backend", "cudf")
    assert result.exit_code == 2, result.output
    assert "--backend cudf:" in result.output and "--backend pandas" in result.output
    assert not (tmp_path / "out").exists()


def test_existing_cluster_of_cpu_workers_gets_pandas(client):
    assert cluster_plans.cluster_backend(client, "auto") == "pandas"
    assert cluster_plans.cluster_backend(client, "cudf") == "cudf"


def test_gpu_probe(monkeypatch):
    calls = []

    def run(args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, returncode, stdout=stdout)

    monkeypatch.setattr(cluster_plans.subprocess, "run", run)
    monkeypatch.setattr(cluster_plans.importlib.util, "find_spec", lambda name: object())
    returncode, stdout = 0, "2\nNVIDIA H200\n"
    assert cluster_plans.usable_gpu() == cluster_plans.GpuInfo("NVIDIA H200", 2)
    assert "cudf.Series" in calls[-1][-1]  # the probe computes with cuDF
    returncode, stdout = 1, ""
    assert cluster_plans.usable_gpu() is None
    monkeypatch.setattr(cluster_plans.importlib.util, "find_spec", lambda name: None)
    calls.clear()
    assert cluster_plans.usable_gpu() is None
    assert calls == []  # no cuDF: no process started


def test_cuda_probe_fails_cleanly_without_a_gpu():
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("this machine has a GPU")
    assert cluster_plans.usable_gpu() is None


# -- bench --plot -------------------------------------------------------------------


def test_bench_plot_writes_a_png(tmp_path):
    png, results = tmp_path / "bench.png", tmp_path / "bench.json"
    r = gpushuffle(
        "bench", "--rows", 20_000, "--columns", 4, "--partitions", 4, "--workers", 2,
        "--methods", "gpushuffle,tasks", "--json", results, "--plot", png,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"wrote {png}" in r.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 1000 and height > 700
    # The JSON records keep their keys (no memory timelines in them).
    records = json.loads(results.read_text())
    assert {tuple(sorted(r)) for r in records} == {
        (
            "busy_seconds",
            "copied_bytes",
            "copies_per_byte",
            "error",
            "gib_per_s",
            "input_bytes",
            "left_behind_bytes",
            "machine",
            "memcpy_s_per_byte",
            "method",
            "partition_digest",
            "peak_breakdown",
            "peak_worker_rss_bytes",
            "repeat",
            "restarts",
            "rows_out",
            "rss_after_bytes",
            "rss_before_bytes",
            "settle_s",
            "spent_seconds",
            "spilled_bytes",
            "wall_s",
            "x_of_memcpy",
        )
    }
    # Every method put the same rows in each output partition.
    assert len({r["partition_digest"] for r in records}) == 1
    assert all(r["error"] is None and r["restarts"] == 0 for r in records)
    # What the shuffle held when the largest worker's RSS peaked.
    gpushuffle_runs = [r for r in records if r["method"] == "gpushuffle"]
    assert (
        gpushuffle_runs[0]["peak_breakdown"]["rss"] == gpushuffle_runs[0]["peak_worker_rss_bytes"]
    )
    assert {"store_host", "pool_split", "comm_out", "phase"} <= set(
        gpushuffle_runs[0]["peak_breakdown"]
    )
    # Bytes copied per stage, for gpushuffle only: every byte is split and
    # unpacked once (numeric data), and what was sent was received.
    for run in gpushuffle_runs:
        copied = run["copied_bytes"]
        # The index travels as int64 (RangeIndex partitions take a few bytes).
        range_index = pd.RangeIndex(5_000).memory_usage(deep=True)
        expected = run["input_bytes"] - 4 * range_index + 8 * 20_000
        # The bench persists its input: rows staying on their worker are not
        # copied by the split (only those sent are), and are gathered
        # straight from the input into the output.  pandas 2 has no
        # copy-on-write to borrow them with: the split copies every row.
        assert copied["unpack"] == expected
        assert copied["send"] == copied["receive"] > 0
        if BORROWS_FROM_INPUTS:
            assert 0 < copied["split"] < 0.75 * expected
            assert copied["split"] <= copied["send"] <= 1.05 * copied["split"]
        else:
            assert copied["split"] == expected
            assert 0 < copied["send"] < 0.75 * expected
        assert run["copies_per_byte"] == pytest.approx(sum(copied.values()) / run["input_bytes"])
    assert all(r["copied_bytes"] == {} and r["copies_per_byte"] is None
               for r in records if r["method"] == "tasks")  # fmt: skip
    split = "0.6" if BORROWS_FROM_INPUTS else "1.2"
    assert f"gpushuffle bytes copied per byte shuffled, by stage: split {split}" in r.stdout
    # Each stage's time beside a plain copy's, measured in the same run:
    # the split and the unpack copy and take time; none is faster than a
    # copy of its bytes (a bound a wrong clock or byte count would break).
    for run in gpushuffle_runs:
        assert 0 < run["memcpy_s_per_byte"] < 1e-8  # faster than 100 MB/s
        assert run["busy_seconds"]["split"] > 0 and run["busy_seconds"]["unpack"] > 0
        # send and receive are the comm's time (waiting for the peer,
        # distributed's reads): busy, but not set against a copy.
        assert {"split", "unpack"} <= set(run["x_of_memcpy"])
        assert not {"send", "receive"} & set(run["x_of_memcpy"])
        assert run["busy_seconds"]["send"] > 0
        # Overlapping operations count once under way, each time spent.
        assert run["busy_seconds"]["split"] <= run["spent_seconds"]["split"] + 1e-6
        assert all(x > 0.5 for x in run["x_of_memcpy"].values()), run["x_of_memcpy"]
        assert run["busy_seconds"]["split"] < run["wall_s"] * 2  # 2 workers, 1 thread each
    assert all(r["busy_seconds"] == {} == r["spent_seconds"] and r["memcpy_s_per_byte"] is None
               for r in records if r["method"] == "tasks")  # fmt: skip
    assert "x of memcpy" in r.stdout and "gpushuffle by stage" in r.stdout


def test_plot_from_results(tmp_path):
    from gpushuffle.bench import Result
    from gpushuffle.plot import median_run, plot_benchmark

    def result(method, repeat, wall, peak):
        timeline = {
            f"tcp://w{i}": [(t / 10, int((1 + i + np.sin(t)) * 2**28)) for t in range(30)]
            for i in range(2)
        }
        breakdowns = {
            worker: [
                {"store_host": 2**27 * t // 30, "comm_out": 2**24, "phase": 1 + (t >= 20)}
                for t in range(30)
            ]
            for worker in timeline
        }
        return Result(
            method, repeat, wall, 2**30, 10, peak, rss_timelines=timeline, breakdowns=breakdowns
        )

    results = [
        result("gpushuffle", 0, 2.0, 3 * 2**30),
        result("gpushuffle", 1, 1.0, 3 * 2**30),
        result("gpushuffle", 2, 1.5, 3 * 2**30),
        result("p2p", 0, 4.0, 2 * 2**30),
    ]
    assert median_run(results[:3]).repeat == 2
    context = {
        "rows": 10, "columns": 2, "partitions": 1, "workers": 2, "threads_per_worker": 1,
        "protocol": "tcp", "input_bytes": 2**30, "machine": "test machine",
        "versions": {"gpushuffle": "0"},
    }  # fmt: skip
    path = tmp_path / "plot.png"
    plot_benchmark(results, context, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from gpushuffle.plot import _barrier_time

    assert _barrier_time(results[0], "tcp://w0") == pytest.approx(2.0)

    # In Jupyter: the medians as a table, and the same picture inline.
    from gpushuffle.report import BenchmarkReport

    report = BenchmarkReport(tuple(results), context)
    table = report.table()
    assert table.loc["gpushuffle", "wall_s"] == 1.5 and table.loc["p2p", "x_gpushuffle"] == 2.67
    assert table.loc["gpushuffle", "peak_rss_GiB"] == 3.0
    html = report._repr_html_()
    assert "<table" in html and "data:image/png;base64,iVBORw0KGgo" in html
    assert "gpushuffle" in repr(report) and "p2p" in repr(report)


def test_bench_mixed_dtypes(tmp_path):
    from gpushuffle.bench import MIXED_KINDS, make_partition

    part = make_partition(1, 500, 1 + len(MIXED_KINDS), 50, "mixed")
    meta = make_partition(0, 0, 1 + len(MIXED_KINDS), 50, "mixed")
    pd.testing.assert_series_equal(part.dtypes, meta.dtypes)
    assert part.dtypes.astype(str).nunique() == len(MIXED_KINDS)  # the key is int64 too
    assert part["Int645"].isna().any() and part["boolean6"].isna().any()
    results = tmp_path / "bench.json"
    r = gpushuffle(
        "bench", "--rows", 20_000, "--columns", 9, "--partitions", 4, "--dtypes", "mixed",
        "--methods", "gpushuffle,p2p,tasks", "--json", results,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "9 mixed columns" in r.stdout
    assert {rec["rows_out"] for rec in json.loads(results.read_text())} == {20_000}


def test_bench_skew_on_limited_workers(tmp_path):
    """--skew puts that share of the rows on one key; --worker-memory gives
    workers a limit distributed enforces, inputs generated in the shuffle:
    every method's partitions are compared, restarts counted."""
    from gpushuffle.bench import make_partition

    part = make_partition(3, 10_000, 4, 10_000, skew=0.7)
    assert 0.65 < (part["key"] == 0).mean() < 0.75
    results = tmp_path / "bench.json"
    r = gpushuffle(
        "bench", "--rows", 200_000, "--columns", 4, "--partitions", 8, "--skew", 0.7,
        "--worker-memory", "1GiB", "--methods", "gpushuffle,tasks", "--json", results,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "70% of the rows on one key" in r.stdout and "threads of 1GiB" in r.stdout
    assert "gpushuffle: the same rows in each output partition as tasks" in r.stdout
    records = json.loads(results.read_text())
    assert {rec["rows_out"] for rec in records} == {200_000}
    assert all(rec["restarts"] == 0 and rec["error"] is None for rec in records)
    bad = gpushuffle("bench", "--skew", "1.5")
    assert bad.exit_code == 2 and "--skew" in bad.output, bad.output


def test_bench_sweeps_the_hot_share_at_a_fixed_worker_memory(tmp_path):
    """Several --skew shares: each in a fresh cluster, built or refused,
    restarts and peak against the limit; a reserve larger than the limit
    refuses every share, before anything is built."""
    results = tmp_path / "sweep.json"
    args = ["bench", "--rows", 100_000, "--columns", 4, "--partitions", 4,
            "--skew", "0.3,0.9", "--worker-memory", "1GiB", "--methods", "gpushuffle"]  # fmt: skip
    r = gpushuffle(*args, "--json", results)
    assert r.exit_code == 0, r.output
    assert "0 share(s) with more than one verdict, 0 restart(s)" in r.stdout, r.stdout
    record = json.loads(results.read_text())
    assert [(p["share"], p["verdict"], p["restarts"]) for p in record["points"]] == [
        (0.3, "built", 0),
        (0.9, "built", 0),
    ]
    # The hot key's partition holds at least 90% of the rows.
    assert record["points"][1]["hot_rows"] >= 0.9 * 100_000
    assert all(0 < p["peak_bytes"] < p["limit_bytes"] for p in record["points"])
    with dask.config.set({"gpushuffle.memory.worker-reserve": "2GiB"}):
        r = gpushuffle(*args, "--json", results)
    assert r.exit_code == 0, r.output
    points = json.loads(results.read_text())["points"]
    assert {(p["verdict"], p["restarts"]) for p in points} == {("refused", 0)}
    assert all(p["error"].startswith("output partition") for p in points)
    bad = gpushuffle("bench", "--skew", "0.5,0.6")
    assert bad.exit_code == 2 and "--worker-memory" in bad.output, bad.output
    bad = gpushuffle("bench", "--skew", "0.9:0.6:0.1")
    assert bad.exit_code == 2 and "--skew" in bad.output, bad.output


def test_shares_parse_as_a_value_a_list_or_a_range():
    from gpushuffle.hotkey import parse_shares

    assert parse_shares("0.7") == (0.7,)
    assert parse_shares("0.6,0.8") == (0.6, 0.8)
    assert parse_shares("0.6:0.95:0.05") == (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
    for bad in ("1.5", "x", "0.1:0.2:0", "0.9:0.6:0.1"):
        with pytest.raises(ValueError):
            parse_shares(bad)


def test_bench_plot_needs_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    r = gpushuffle("bench", "--rows", 10, "--plot", tmp_path / "x.png")
    assert r.exit_code == 2
    assert r.stderr == "Error: plotting needs matplotlib: pip install 'gpushuffle[plot]'\n"


def test_bench_plot_into_a_missing_directory_fails_before_running(tmp_path):
    r = gpushuffle("bench", "--plot", tmp_path / "nowhere" / "x.png")
    assert r.exit_code == 2
    assert r.stderr == f"Error: --plot {tmp_path}/nowhere/x.png: no directory {tmp_path}/nowhere\n"


def test_demo_checks_its_result_and_keeps_distributed_logs_out():
    proc = subprocess.run(
        [GPUSHUFFLE, "demo", "--rows", "100000", "--partitions", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "every row present once, each key in one partition: yes" in proc.stdout
    # distributed's scheduler plugin warns at every shuffle's start and end.
    assert "initialized by task" not in proc.stdout + proc.stderr


def test_bench_keeps_distributed_shuffle_logs_under_debug():
    def bench(*extra):
        proc = subprocess.run(
            [GPUSHUFFLE, "bench", "--rows", "2000", "--columns", "3", "--partitions", "2",
             "--methods", "gpushuffle", *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout + proc.stderr

    assert "initialized by task" not in bench()
    assert "initialized by task" in bench("--debug")  # the log is there to be hidden


def test_task_floor_benchmark_reports_per_task_costs():
    from benchmarks.task_floor import main

    r = CliRunner().invoke(main, ["--partitions", "8", "--rows", "800", "--repeat", "1"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("8 partitions, 2 workers x 1 thread")
    # Tasks the scheduler ran: len, one per partition, after an alias task
    # per persisted partition, then one concatenation; the shuffle runs no
    # alias task (8 transfers, a barrier, 8 unpacks, 8 len, a concatenation).
    assert "(17 tasks)" in lines[1], lines[1]
    assert lines[3].startswith("gpushuffle, len") and "(26 tasks)" in lines[3], lines[3]
    assert "ms per transfer or unpack task" in lines[-1]


def test_worker_restart_benchmark_times_each_replacement():
    from benchmarks.worker_restart import main

    r = CliRunner().invoke(main, ["--workers", "2", "--kills", "2"])
    assert r.exit_code == 0, r.output
    timed = [line for line in r.output.splitlines() if line.startswith("replacement registered")]
    assert len(timed) == 2, r.output
    # A new process imports Python, distributed and pandas before it registers.
    assert all(float(line.split("CPU ")[1].split(" s")[0]) > 0.1 for line in timed), timed
    assert "CPU s per replacement" in r.output.splitlines()[-1]


def test_worker_cpu_benchmark_reports_threads_and_collections():
    # Run as a user runs it, to see all it prints.
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.worker_cpu", "--rows", "4000", "--partitions", "20"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    # The benchmarks' clusters keep distributed's shuffle WARNINGs out.
    assert "initialized by task" not in proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("4,000 rows in 20 partitions, numeric, gpushuffle, 2 workers")
    cpu_lines = [line for line in lines if "CPU s:" in line]
    assert len(cpu_lines) == 2  # one per worker
    for line in cpu_lines:
        # The shuffle ran on both workers: CPU on their event loops and task threads.
        assert "MainThread" in line and "task threads" in line, line
    gc_lines = [line for line in lines if " gc: " in line]
    assert len(gc_lines) == 2 and all("gen0" in line for line in gc_lines), gc_lines
    assert lines[-1].startswith("  CPU per worker, median:")


def test_tight_memory_benchmark_records_each_run(tmp_path):
    from benchmarks.tight_memory import main

    out = tmp_path / "tight.json"
    main(["--memory-limit", "2GiB", "--rows", "16000", "--methods", "gpushuffle,tasks",
          "--json", str(out)])  # fmt: skip
    records = json.loads(out.read_text())
    assert [(r["method"], r["outcome"], r["rows_out"]) for r in records] == [
        ("gpushuffle", "ok", 16000),
        ("tasks", "ok", 16000),
    ]
    assert all(r["workers_replaced"] == 0 for r in records)


def test_bench_input_is_spread_evenly_over_the_workers():
    """Partition i on the (i mod n)-th worker, whatever the scheduler would
    choose, and the same rows as the frame generated lazily."""
    from distributed import Client, LocalCluster, wait

    from gpushuffle.bench import generated_frame, persisted_evenly

    with (
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        df = persisted_evenly(client, 1_000, 7, columns=4, dtypes="mixed")
        wait(df)
        workers = sorted(client.nthreads())
        placed = {key[1]: tuple(where) for key, where in client.who_has(df).items()}
        assert placed == {i: (workers[i % 3],) for i in range(7)}
        got = df.compute()
        assert len(got) == 1_000
        assert list(got.dtypes) == list(df._meta.dtypes)
        pd.testing.assert_frame_equal(got, generated_frame(1_000, 7, 4, "mixed").compute())


def test_bench_input_is_computed_again_after_every_worker_is_lost():
    """The placement is a preference for the first computation only: with
    every worker SIGKILLed at once, the new workers compute the inputs
    again (a restriction to the dead addresses kept them ``no-worker`` for
    good in distributed 2026.7.1, and a 2-worker soak hung)."""
    from distributed import Client, LocalCluster, wait

    from gpushuffle.bench import generated_frame, persisted_evenly

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        df = persisted_evenly(client, 1_000, 6, columns=3, dtypes="numeric")
        wait(df)
        for pid in client.run(os.getpid).values():
            os.kill(pid, signal.SIGKILL)
        got = client.compute(df).result(timeout=60)
        assert len(got) == 1_000
        pd.testing.assert_frame_equal(got, generated_frame(1_000, 6, 3, "numeric").compute())
