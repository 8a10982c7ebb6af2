"""gpushuffle in Dask's dashboard: the Shuffling panel draws its store.

distributed's Shuffling panel (``/shuffle``) draws, per worker of a running
shuffle, two buffers from the heartbeats its scheduler plugin keeps: ``comm``
(shards waiting to be sent) and ``disk``.  gpushuffle's runs report their
store as ``disk``: what it holds in memory against its memory budget, all it
holds, and what it wrote to and read back from its spill files.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from typing import Any
from unittest import mock

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster

from gpushuffle.engine.memory import reset_worker_memory
from gpushuffle.engine.run import GPUShuffleRun

pytestmark = pytest.mark.timeout(180)


class HeldUnpack(GPUShuffleRun):
    """Holds every unpack until the test lets it through (heartbeats go on)."""

    release = threading.Event()

    def _get_output_partition(self, partition_id: int, key: Any, **kwargs: Any) -> Any:
        self.release.wait(60)
        return super()._get_output_partition(partition_id, key, **kwargs)


@mock.patch("gpushuffle.engine.run.GPUShuffleRun", HeldUnpack)
def test_the_shuffling_panel_shows_the_store_against_its_budget():
    from distributed.dashboard.components.scheduler import Shuffling

    reset_worker_memory()
    HeldUnpack.release.clear()
    rng = np.random.default_rng(36)
    n = 400_000
    pdf = pd.DataFrame({"key": rng.integers(0, 10_000, n), "x": rng.random(n)})
    # Budgets are per process (shared by these in-process workers): 1 MiB,
    # so that shards spill.
    with (
        dask.config.set({"gpushuffle.memory.host-limit": "1 MiB"}),
        LocalCluster(
            n_workers=2, processes=False, threads_per_worker=1, dashboard_address="127.0.0.1:0"
        ) as cluster,
        Client(cluster) as client,
    ):
        df = dd.from_pandas(pdf, npartitions=8, sort=False)
        futures = client.compute(df.shuffle("key", npartitions=6, shuffle_method="gpushuffle"))
        plugin = cluster.scheduler.extensions["shuffle"]
        deadline = time.monotonic() + 30
        while not any(
            len(workers) == 2 and all("store" in d for d in workers.values())
            for workers in plugin.heartbeats.values()
        ):
            assert time.monotonic() < deadline, dict(plugin.heartbeats)
            time.sleep(0.1)
        # Transfers are done (unpacks are held): a heartbeat with the final
        # figures comes within a second.
        time.sleep(1.5)
        try:
            port = cluster.scheduler.http_server.port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/shuffle", timeout=10) as page:
                assert page.status == 200 and b"bokeh" in page.read().lower()
            panel = Shuffling(cluster.scheduler)
            panel.update()
            data = panel.source.data
            assert len(data["worker"]) == 2, data
            assert all(limit == 1 << 20 for limit in data["disk_memory_limit"]), data
            assert all(total > 0 for total in data["disk_total"]), data
            assert sum(data["disk_written"]) > 0, data  # shards went to the spill files
            assert all(buckets > 0 for buckets in data["disk_buckets"]), data
            assert all(
                memory <= total
                for memory, total in zip(data["disk_memory"], data["disk_total"], strict=True)
            )
        finally:
            HeldUnpack.release.set()
        out = futures.result()
        assert len(out) == n
    reset_worker_memory()


@pytest.mark.recovery
def test_the_recovery_page_shows_the_lost_worker_and_what_moved():
    """``/gpushuffle`` on the scheduler's dashboard, after a worker of three
    is closed mid-transfer under partial recovery: the recovery (the worker
    lost, its third of the output partitions moved) and the survivors'
    counters from their heartbeats.  (These workers share this process, so
    each reports the process's counters: the check is that they grew.)"""
    from bokeh.document import Document
    from distributed import Scheduler, Worker
    from faults import (
        TRANSFER,
        assert_correct,
        gpushuffled,
        truth,
        wait_for,
        wait_for_shuffle,
        wait_for_tasks,
    )
    from test_faults import NIN, NOUT, ROWS
    from tornado.httpclient import AsyncHTTPClient

    from gpushuffle import dashboard
    from gpushuffle.engine import recovery

    async def main() -> None:
        settings = {
            "gpushuffle.recovery": "partial",
            # Shards go at once (none held back to wait for others): these
            # arrive before the loss and are kept.
            "gpushuffle.comm.message-bytes-limit": "256 KiB",
        }
        with dask.config.set(settings):
            async with Scheduler(
                host="127.0.0.1", port=0, dashboard=True, dashboard_address="127.0.0.1:0"
            ) as s:
                workers = [Worker(s.address, nthreads=1) for _ in range(3)]
                await asyncio.gather(*workers)
                try:
                    async with Client(s.address, asynchronous=True) as c:
                        await check(c, s, workers[1])
                finally:
                    await asyncio.gather(*(w.close() for w in workers))

    async def check(c: Any, s: Any, lost: Any) -> None:
        expected = truth(NIN, ROWS, NOUT)
        before = recovery.statistics.as_dict()
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        shuffle_id = await wait_for_shuffle(s)
        await wait_for_tasks(s, TRANSFER, "memory", NIN // 2)
        await lost.close()
        assert_correct(await c.gather(futures), expected)
        rows = dashboard.recovery_rows()
        assert shuffle_id in rows["shuffle"], rows
        i = rows["shuffle"].index(shuffle_id)
        assert rows["lost"][i] == lost.address and rows["moved"][i] == NOUT // 3, rows
        assert rows["survivors"][i] == 2, rows
        url = f"http://127.0.0.1:{s.http_server.port}{dashboard.ROUTE}"
        page = await AsyncHTTPClient().fetch(url)
        assert page.code == 200 and b"bokeh" in page.body.lower()
        runs = before["recovery_runs"]

        def counted() -> bool:
            rows = dashboard.worker_rows(s)["runs"]
            return bool(rows) and min(rows) > runs

        await wait_for(counted, 10, "heartbeats with the recovery counted")
        table = dashboard.worker_rows(s)
        assert sorted(table["worker"]) == sorted(set(s.workers)) and len(table["worker"]) == 2
        assert min(table["bytes_kept"]) > before["recovery_bytes_kept"], table
        assert min(table["partitions_taken"]) >= before["recovery_partitions_taken"] + NOUT // 3
        doc = Document()
        dashboard.recovery_doc(s, {}, doc)
        assert doc.roots

    asyncio.run(main())
