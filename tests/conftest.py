from __future__ import annotations

import os

import pytest
from distributed import Client, LocalCluster

import gpushuffle  # noqa: F401  (registers the shuffle method)


@pytest.fixture(scope="session")
def cluster():
    # Real worker processes over TCP: shards for the other worker are
    # serialized and sent, shards for the same worker are not.
    with LocalCluster(
        n_workers=2,
        threads_per_worker=2,
        processes=True,
        dashboard_address=":0",
        worker_dashboard_address=":0",
    ) as cluster:
        yield cluster


#: Processes that keep a core busy beside each test that uses ``busy_cores``
#: (GPUSHUFFLE_TEST_BUSY_CORES, default 2: both of CI's cores).
BUSY_CORES = int(os.environ.get("GPUSHUFFLE_TEST_BUSY_CORES", "2"))
#: A busy loop ends by itself after this long, whatever becomes of the test.
_BUSY_LIMIT_S = 900


@pytest.fixture
def busy_cores():
    """Keep the machine's cores busy while the test runs, as a crowded CI
    runner does: tests near a memory or time limit must pass there too (a
    hot-key test that passed alone failed 3 runs of 4 with both cores busy)."""
    import subprocess
    import sys

    loop = (
        f"import time\nend = time.monotonic() + {_BUSY_LIMIT_S}\nwhile time.monotonic() < end: pass"
    )
    procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(BUSY_CORES)]
    try:
        yield len(procs)
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


_LOAD_REPORT: list[str] = []


@pytest.fixture
def load_report():
    """Lines for the "gpushuffle load timings" section at the end of the run."""
    return _LOAD_REPORT.append


def pytest_terminal_summary(terminalreporter):
    if _LOAD_REPORT:
        terminalreporter.section("gpushuffle load timings")
        for line in _LOAD_REPORT:
            terminalreporter.write_line(line)


@pytest.fixture
def client(cluster):
    with Client(cluster) as client:
        yield client
        # Every test leaves the workers as it found them.
        assert_nothing_left_behind(client)


def worker_leftovers(dask_worker) -> dict:
    """What shuffles left on a worker: runs, spill directories, store bytes."""
    from gpushuffle.engine.memory import TIERS, worker_memory

    plugin = dask_worker.plugins["shuffle"]
    runs = plugin.shuffle_runs
    files = [
        name
        for name in os.listdir(dask_worker.local_directory)
        if name.startswith(("gpushuffle", "shuffle"))
    ]
    memory = worker_memory()
    return {
        "active": list(runs._active_runs),
        "runs": len(runs._runs),
        "files": files,
        # Bytes the stores of closed runs still charge to the worker's budget
        # (shared by every shuffle there): must be none.
        "store_bytes": {tier: memory.tier(tier).bytes for tier in TIERS},
    }


def _scheduler_leftovers(dask_scheduler) -> dict:
    plugin = dask_scheduler.plugins["shuffle"]
    return {"active": list(plugin.active_shuffles), "runs": 0, "files": [], "store_bytes": {}}


def is_clean(state: dict) -> bool:
    return (
        not state["active"]
        and not state["runs"]
        and not state["files"]
        and not any(state["store_bytes"].values())
    )


def assert_nothing_left_behind(client: Client) -> None:
    import time

    deadline = time.monotonic() + 10
    while True:
        state = client.run(worker_leftovers)
        state["scheduler"] = client.run_on_scheduler(_scheduler_leftovers)
        if all(is_clean(s) for s in state.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"shuffle state left on workers: {state}")
        time.sleep(0.1)


def pytest_configure(config):
    # The GPU machine's kit may lack pytest-timeout: its marker must not
    # fail collection under --strict-markers (the limits then come from the
    # run's own timeout).
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's limit")


def pytest_collection_modifyitems(config, items):
    """Run ``gpu`` tests only where cuDF computes on a GPU.

    cudf, cupy and rmm import on machines without a GPU and fail only at the
    first allocation, so an import check is not enough: a child process
    runs a cuDF reduction (see gpushuffle.cluster.usable_gpu).
    """
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    from gpushuffle.cluster import usable_gpu

    device = usable_gpu()
    if device:
        return
    missing = [m for m in ("cudf", "dask_cudf", "cupy") if not _any_module(m)]
    reason = (
        f"no usable CUDA device: {', '.join(missing)} not installed"
        if missing
        else "no usable CUDA device: cuDF could not compute on a GPU (probed in a child process)"
    )
    if os.environ.get("GPUSHUFFLE_REQUIRE_GPU"):
        # The GPU runs (ci/gpu_run.sh, ci/test_gpu.sh): skipped GPU tests
        # would be a green run that tested nothing.
        pytest.exit(f"GPUSHUFFLE_REQUIRE_GPU is set, but {reason}", returncode=3)
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


def _any_module(*names: str) -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) for name in names)
