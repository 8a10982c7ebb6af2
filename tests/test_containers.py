"""Workers in containers on one node: PID namespaces of their own.

Each worker runs as ``dask worker --no-nanny`` under ``unshare --pid --fork
--mount-proc``, as a container runtime starts it: process 1 of a PID
namespace of its own, on the same kernel and host address as its peers,
with one scratch directory they all share (a mounted host directory).  With
address-space randomization off (``setarch -R``, as under some runtimes and
debuggers) the workers are laid out alike in memory, so a receiver that
read "process 1" at a sender's addresses would read itself and return wrong
rows with no error (issue 32).  Every shuffle is checked against ``tasks``
partition by partition, and the workers' wire counters say which path the
shards took.  Workers that share one PID namespace (a pod with
``shareProcessNamespace``) still read each other's shards.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from conftest import assert_nothing_left_behind
from distributed import Client, LocalCluster
from test_shuffle import check
from test_transport import _wire, wire_delta

from gpushuffle import samehost


def _unshare_works() -> str | None:
    """Why separate PID namespaces cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "PID namespaces are Linux's"
    if os.geteuid() != 0:
        return "needs root to make PID namespaces (unshare --pid); CI runs as root"
    if shutil.which("unshare") is None or shutil.which("setarch") is None:
        return "needs unshare and setarch (util-linux)"
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30
    )
    if probe.returncode != 0:
        return f"unshare --pid refused here: {probe.stderr.decode().strip()}"
    return None


_why_not = _unshare_works()
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(_why_not is not None, reason=str(_why_not)),
    pytest.mark.skipif(samehost.identity() is None, reason="no process_vm_readv here"),
]

NIN, NOUT, ROWS = 8, 6, 800_000  # an input's rows for a peer: columns of ~530 KB, lent


@contextlib.contextmanager
def workers_in_namespaces(n: int, shared: bool, aslr: bool, scratch: str):
    """A scheduler here and ``n`` worker processes, each in a PID namespace of
    its own (``shared``: all in one), all with ``scratch`` as local directory."""
    worker = [
        sys.executable,
        "-m",
        "distributed.cli.dask_worker",
        "--no-nanny",
        "--nthreads",
        "1",
        "--no-dashboard",
        "--local-directory",
        scratch,
    ]
    if not aslr:
        worker = ["setarch", platform.machine(), "-R", *worker]
    # --kill-child: the namespace goes with its unshare process.
    unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]
    with (
        LocalCluster(
            n_workers=0, processes=False, protocol="tcp", dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        address = cluster.scheduler_address
        if shared:
            script = " & ".join([" ".join([*worker, address])] * n) + " & wait"
            commands = [[*unshare, "sh", "-c", script]]
        else:
            # Started together, as pods of one deployment are.
            commands = [[*unshare, *worker, address] for _ in range(n)]
        # Functions of these tests reach the workers by reference.
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
        processes = [subprocess.Popen(c, env=env, stderr=subprocess.DEVNULL) for c in commands]
        try:
            client.wait_for_workers(n, timeout=90)
            yield client
        finally:
            client.retire_workers(list(client.nthreads()), close_workers=True)
            for p in processes:
                p.terminate()
            for p in processes:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _namespace(dask_worker=None) -> tuple[int, str]:
    return os.getpid(), os.readlink("/proc/self/ns/pid")


def _frame() -> pd.DataFrame:
    rng = np.random.default_rng(32)
    return pd.DataFrame(
        {
            "key": rng.integers(0, 100_000, ROWS),
            "row": np.arange(ROWS),
            "x": rng.random(ROWS),
            "y": rng.integers(0, 2**40, ROWS),
        }
    )


def _shuffle(client: Client) -> dict[str, dict[str, int]]:
    """A shuffle checked against tasks; what each worker's wire counters gained."""
    before = client.run(_wire)
    pdf = _frame()
    df = dd.from_pandas(pdf, npartitions=NIN, sort=False).persist()
    check(
        df.shuffle("key", npartitions=NOUT, shuffle_method="gpushuffle"),
        df.shuffle("key", npartitions=NOUT, shuffle_method="tasks"),
        pdf,
    )
    return wire_delta(client, before)


@pytest.mark.parametrize("aslr", [True, False], ids=["aslr", "no-aslr"])
def test_workers_in_separate_pid_namespaces_send_bytes_and_get_the_tasks_result(tmp_path, aslr):
    with workers_in_namespaces(2, shared=False, aslr=aslr, scratch=str(tmp_path)) as client:
        seen = client.run(_namespace)
        # What makes it hard: both are process 1, in namespaces of their own.
        assert {pid for pid, _ in seen.values()} == {1}, seen
        assert len({ns for _, ns in seen.values()}) == 2, seen
        for attempt in range(2):
            delta = _shuffle(client)
            total = {k: sum(d[k] for d in delta.values()) for k in next(iter(delta.values()))}
            assert total["wire_bytes_read_from_peers"] == 0, delta
            assert total["wire_bytes_sent"] > 0, delta
            if attempt == 0:
                # Each worker lent, was refused by its peer, and sent bytes.
                for worker, d in delta.items():
                    assert d["wire_lends_refused"] >= 1 and d["wire_reads_refused"] >= 1, (
                        worker,
                        d,
                    )
            else:
                # The refusal is remembered: nothing is lent any more.
                assert total["wire_bytes_lent"] == total["wire_reads_refused"] == 0, delta
        assert_nothing_left_behind(client)
    # The shared scratch directory holds nothing of gpushuffle's.
    left = [p for p in tmp_path.rglob("*") if p.name.startswith("gpushuffle")]
    assert not left, left


def test_workers_sharing_a_pid_namespace_still_read_each_others_shards(tmp_path):
    with workers_in_namespaces(2, shared=True, aslr=True, scratch=str(tmp_path)) as client:
        seen = client.run(_namespace)
        assert len({ns for _, ns in seen.values()}) == 1, seen
        delta = _shuffle(client)
        for worker, d in delta.items():
            assert d["wire_bytes_read_from_peers"] > 0, (worker, d)
            assert d["wire_reads_refused"] == d["wire_lends_refused"] == 0, (worker, d)
        assert_nothing_left_behind(client)


def test_workers_sharing_a_scratch_directory_spill_to_paths_of_their_own(tmp_path):
    """Containers given one host directory as local directory: each worker
    makes a directory of its own in it (distributed's WorkSpace: mkdtemp),
    and gpushuffle's spill files go below that, so no path is shared."""
    with workers_in_namespaces(2, shared=False, aslr=False, scratch=str(tmp_path)) as client:
        dirs = client.run(lambda dask_worker: dask_worker.local_directory)
        assert len(set(dirs.values())) == 2, dirs
        assert all(d.startswith(str(tmp_path)) for d in dirs.values()), dirs
        client.run(_set_host_limit, "1MiB")  # received shards go to disk
        _shuffle(client)
        spilled = client.run(_spilled)
        assert all(spilled.values()), spilled
        assert_nothing_left_behind(client)
    left = [p for p in tmp_path.rglob("*") if p.name.startswith("gpushuffle")]
    assert not left, left


def _set_host_limit(limit: str, dask_worker=None) -> None:
    import dask

    from gpushuffle.engine.memory import reset_worker_memory

    dask.config.set({"gpushuffle.memory.host-limit": limit})
    reset_worker_memory()


def _spilled(dask_worker=None) -> int:
    from gpushuffle.engine.memory import worker_memory

    return worker_memory().snapshot()["host_to_disk_bytes"]
