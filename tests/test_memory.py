"""Shuffles larger than the store's budget, on real clusters."""

from __future__ import annotations

import contextlib
import os
import time

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from conftest import assert_nothing_left_behind
from distributed import Client, LocalCluster, wait
from pandas_versions import borrows
from test_shuffle import check
from truth import checksum

import gpushuffle

pytestmark = pytest.mark.timeout(240)


@contextlib.contextmanager
def cluster_with(settings: dict, n_workers: int = 2):
    with (
        dask.config.set(settings),
        LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            dashboard_address=":0",
            worker_dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


def big_frame(n: int = 400_000) -> pd.DataFrame:
    rng = np.random.default_rng(5)
    return pd.DataFrame(
        {
            "key": rng.integers(0, 10_000, n),
            "row": np.arange(n),
            "x": rng.random(n),
            "y": rng.integers(0, 2**40, n),
        }
    )


def _rss(dask_worker=None) -> int:
    import ctypes
    import gc

    import psutil

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def _spill_files(dask_worker) -> list[str]:
    return [
        os.path.join(root, f)
        for root, _, files in os.walk(dask_worker.local_directory)
        for f in files
        if "gpushuffle" in root
    ]


@pytest.mark.parametrize("reorder", ["gather", "scatter"])
def test_each_destination_is_split_into_buffers_of_its_own(reorder):
    """The shard sent to another worker frees its memory once dropped, even
    while the local shard (kept in the store) lives on; scattered (400k
    rows, half of them local) or gathered alike."""
    from gpushuffle.backends.pandas import PandasBackend
    from gpushuffle.engine.pool import HostBufferPool

    n = 400_000
    rng = np.random.default_rng(3)
    df = pd.DataFrame({"a": rng.integers(0, 9, n), "b": rng.random(n)})
    df["_partitions"] = rng.integers(0, 4, n).astype(np.int16)
    pool = HostBufferPool(limit=1 << 30, idle_release=0)
    backend = PandasBackend()
    import gpushuffle.engine.pool as pool_module

    saved, pool_module._POOL = pool_module._POOL, pool
    try:
        with dask.config.set({"gpushuffle.split.reorder": reorder}):
            (local, remote), offsets = backend.split_groups(
                df, "_partitions", np.arange(4, dtype=np.int16), 4, True, [(0, 2), (2, 4)], local=0
            )
    finally:
        pool_module._POOL = saved
    assert len(local) == offsets[2] and len(remote) == n - offsets[2]
    expected = df[df["_partitions"] >= 2].sort_values("_partitions", kind="stable")
    np.testing.assert_array_equal(remote.columns[1], expected["b"].to_numpy())
    np.testing.assert_array_equal(remote.index, expected.index)
    in_use = pool.usage()["split"]
    assert in_use >= 24 * n  # a, b and the index, all rows
    del remote
    # The remote block is back in the pool; the local one is still in use.
    usage = pool.usage()
    assert usage["split"] == pytest.approx(in_use * offsets[2] / n, rel=0.05)
    assert usage["free"] == in_use - usage["split"]


def _thp_eligible(address: int) -> int | None:
    """The kernel's THPeligible for the mapping holding ``address`` (None: not shown)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            field, *rest = line.split()
            if "-" in field and not field.endswith(":"):
                low, high = (int(x, 16) for x in field.split("-"))
                inside = low <= address < high
            elif inside and field == "THPeligible:":
                return int(rest[0])
    return None


def test_pool_advises_huge_pages_only_when_told_to():
    from gpushuffle.engine.pool import HostBufferPool

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[madvise]" not in mode:
        pytest.skip(f"transparent huge pages are {mode.strip()!r}, not 'madvise'")
    eligible = {}
    for huge in (True, False):
        pool = HostBufferPool(limit=64 << 20, idle_release=0, huge_pages=huge)
        block = pool.empty(16 << 20, np.uint8)
        eligible[huge] = _thp_eligible(block.ctypes.data)
        assert pool.statistics.huge_pages == int(huge)
    assert eligible == {True: 1, False: 0}


def _fake_sys(root, order=9, huge=2 << 20, balloon_features="0110010100000001"):
    """A /sys tree with page reporting and a virtio balloon (a stand-in for other machines)."""
    (root / "module/page_reporting/parameters").mkdir(parents=True)
    (root / "module/page_reporting/parameters/page_reporting_order").write_text(f"{order}\n")
    (root / "kernel/mm/transparent_hugepage").mkdir(parents=True)
    (root / "kernel/mm/transparent_hugepage/hpage_pmd_size").write_text(f"{huge}\n")
    for name, device, features in [
        ("virtio0", "0x0002", "1" * 32),  # a block device: its bit 5 means something else
        ("virtio1", "0x0005", balloon_features),
    ]:
        if features is None:
            continue
        (root / "bus/virtio/devices" / name).mkdir(parents=True)
        (root / "bus/virtio/devices" / name / "device").write_text(device + "\n")
        (root / "bus/virtio/devices" / name / "features").write_text(features + "\n")
    return str(root)


def test_free_page_reporting_is_recognised_from_sysfs(tmp_path):
    from gpushuffle.engine.pool import free_pages_reported

    assert free_pages_reported(_fake_sys(tmp_path / "reporting"))
    # Reports only blocks larger than a huge page: huge pages stay cheap.
    assert not free_pages_reported(_fake_sys(tmp_path / "order-10", order=10))
    # A balloon without free page reporting (bit 5 clear), or no balloon.
    assert not free_pages_reported(_fake_sys(tmp_path / "no-bit", balloon_features="0110000"))
    assert not free_pages_reported(_fake_sys(tmp_path / "no-balloon", balloon_features=None))
    # A kernel without page reporting.
    assert not free_pages_reported(str(tmp_path / "empty"))


def test_huge_pages_setting_takes_booleans_and_auto(monkeypatch):
    from gpushuffle.engine import pool as pool_module

    assert pool_module.huge_pages_setting(True) is True
    assert pool_module.huge_pages_setting("False") is False
    for reported in (True, False):
        monkeypatch.setattr(pool_module, "free_pages_reported", lambda r=reported: r)
        assert pool_module.huge_pages_setting("auto") is (not reported)
    with pytest.raises(ValueError, match=r"host-pool\.huge-pages must be true, false or 'auto'"):
        pool_module.huge_pages_setting("sometimes")
    with dask.config.set({"gpushuffle.memory.host-pool.huge-pages": False}):
        assert pool_module._make_pool().huge_pages is False


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def test_pool_keeps_blocks_while_shuffles_run_and_unmaps_them_after_the_grace_period():
    from gpushuffle.engine.pool import HostBufferPool

    pool = HostBufferPool(limit=1 << 30, idle_release=1.0)
    pool.hold()  # a shuffle runs
    block = pool.empty(64 << 20, np.uint8)
    block[:] = 1  # faulted in: 64 MiB more RSS
    odd = pool.empty(8 << 20, np.uint8)  # a size nothing asks for again
    del block, odd
    time.sleep(0.05)
    assert pool.usage()["free"] >= 72 << 20
    again = pool.empty(60 << 20, np.uint8)  # the next split or unpack reuses it
    assert pool.statistics.reused == 1
    time.sleep(0.6)  # the shuffle still transfers: free blocks wait for its unpack
    assert pool.usage()["free"] >= 8 << 20
    assert pool.count_unpack()
    time.sleep(0.6)  # unused for an eighth of idle_release while it unpacks: unmapped
    assert pool.usage()["free"] == 0
    del again
    pool.unhold(unpacked=True)  # the shuffle ended: its blocks stay for the grace period ...
    time.sleep(0.1)
    pool.hold()  # ... and a shuffle that follows closely still reuses them
    again = pool.empty(60 << 20, np.uint8)
    assert pool.statistics.reused == 2
    del again
    before = _rss_now()
    pool.unhold()
    deadline = time.monotonic() + 5
    while pool.usage()["free"]:  # ... until nothing ran for idle_release
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Unmapped: the memory left the process, whatever malloc's settings.
    assert _rss_now() < before - (48 << 20)
    assert pool.statistics.idle_releases >= 1


def test_auto_host_budget_is_half_of_what_the_worker_has_free_at_most_256_mib(monkeypatch):
    import psutil

    from gpushuffle import config
    from gpushuffle.engine.memory import TierUsage, WorkerMemory, auto_host_limit

    monkeypatch.setattr(config, "worker_memory_limit", lambda: 100 << 30)
    assert auto_host_limit() == 256 << 20
    # Without disk, received shards have nowhere else to go: no cap.
    assert auto_host_limit(disk_enabled=False) > 10 << 30
    # Free: what the worker may grow before distributed spills its data
    # (distributed.worker.memory.spill, 0.7, of its limit), minus its RSS.
    rss = psutil.Process().memory_info().rss
    monkeypatch.setattr(config, "worker_memory_limit", lambda: int((rss + (100 << 20)) / 0.7))
    assert auto_host_limit() == pytest.approx(50 << 20, abs=8 << 20)
    monkeypatch.setattr(config, "worker_memory_limit", lambda: rss)  # nothing free
    assert auto_host_limit() == 0

    memory = WorkerMemory(
        device=TierUsage(None), host=TierUsage(1), disk=TierUsage(None), disk_enabled=True
    )
    memory.auto_host = True
    monkeypatch.setattr(config, "worker_memory_limit", lambda: 100 << 30)
    memory.start_run()  # sized when a run starts on an idle worker ...
    assert memory.host.limit == 256 << 20
    memory.host.limit = 1
    memory.charge("host", 10)
    memory.start_run()  # ... not while another run holds memory
    assert memory.host.limit == 1


def test_auto_host_budget_divides_the_machine_among_the_workers_on_it(monkeypatch):
    from gpushuffle import config
    from gpushuffle.engine.budget import workers_on_host
    from gpushuffle.engine.memory import TierUsage, WorkerMemory, auto_host_limit

    monkeypatch.setattr(config, "worker_memory_limit", lambda: 100 << 30)
    # 512 MiB a machine, at most 256 MiB a worker: 2 workers as before.
    assert [auto_host_limit(sharers=n) for n in (1, 2, 4, 8)] == [
        256 << 20,
        256 << 20,
        128 << 20,
        64 << 20,
    ]
    assert auto_host_limit(disk_enabled=False, sharers=8) > 10 << 30  # nowhere else to go
    workers = ["tcp://10.0.0.1:1", "tcp://10.0.0.1:2", "tcp://10.0.0.2:1", "tls://10.0.0.1:3"]
    assert workers_on_host("tcp://10.0.0.1:1", workers) == 3
    assert workers_on_host("tcp://10.0.0.2:1", workers) == 1
    assert workers_on_host("tcp://10.0.0.3:1", workers) == 1  # itself, not in the list
    memory = WorkerMemory(
        device=TierUsage(None), host=TierUsage(1), disk=TierUsage(None), disk_enabled=True
    )
    memory.auto_host = True
    memory.start_run(host_sharers=4)
    assert memory.host.limit == 128 << 20
    # Another run holds memory: a run with more workers on the machine still
    # brings the limit down (the machine's total holds), one with fewer not up.
    memory.charge("host", 10)
    memory.start_run(host_sharers=8)
    assert memory.host.limit == 64 << 20
    memory.start_run(host_sharers=2)
    assert memory.host.limit == 64 << 20


def _pool_limit() -> int:
    from gpushuffle.engine.pool import host_pool

    return host_pool().limit


def test_four_workers_on_one_machine_share_its_host_budget():
    """Each of 4 workers gets a quarter of the machine's auto budget, its pool
    at most twice that, and the shuffle is right."""
    pdf = big_frame(200_000)
    with cluster_with({}, n_workers=4) as client:
        ddf = dd.from_pandas(pdf, npartitions=8)
        out = gpushuffle.shuffle(ddf, on="key", npartitions=8).compute()
        stats = gpushuffle.statistics(client)
        pools = client.run(_pool_limit)
    assert len(out) == len(pdf)
    assert checksum(out) == checksum(pdf)
    assert (stats["host_limit"] == 128 << 20).all(), stats["host_limit"].tolist()
    assert all(limit <= 256 << 20 for limit in pools.values()), pools


def test_budget_smaller_than_data_spills_and_stays_correct():
    pdf = big_frame()  # 12.8 MB, about 6.4 MB received per worker
    with cluster_with({"gpushuffle.memory.host-limit": "1 MiB"}) as client:
        df = dd.from_pandas(pdf, npartitions=8, sort=False)
        parts = check(
            df.shuffle("key", npartitions=6, shuffle_method="gpushuffle"),
            df.shuffle("key", npartitions=6, shuffle_method="tasks"),
            pdf,
        )
        for part in parts:
            assert part["row"].is_monotonic_increasing
        stats = gpushuffle.statistics(client)
        assert (stats["host_to_disk_bytes"] > 0).all()
        assert (stats["disk_to_host_bytes"] == stats["host_to_disk_bytes"]).all()
        assert (stats["spilled_bytes"] > 0).all()
        # At most the budget plus the one shard that tipped it over.
        largest_shard = pdf.memory_usage(index=True).sum() / 8
        assert (stats["host_peak_bytes"] <= (1 << 20) + largest_shard).all(), stats
        assert (stats["host_bytes"] == 0).all() and (stats["disk_bytes"] == 0).all()
        assert_nothing_left_behind(client)
        assert not any(client.run(_spill_files).values())


def _set_budget(host_limit, dask_worker=None) -> None:
    from gpushuffle.engine.memory import reset_worker_memory

    dask.config.set({"gpushuffle.memory.host-limit": host_limit})
    reset_worker_memory()


def test_peak_rss_is_bounded_by_the_budget():
    """The same shuffle on the same workers grows RSS far less with a small budget.

    A store that ignored its budget would grow as much as an unbounded one.
    """
    n = 3_000_000  # 72 MB of data, 36 MB received per worker
    rng = np.random.default_rng(1)
    pdf = pd.DataFrame({"key": rng.integers(0, 10**6, n), "a": rng.random(n), "b": rng.random(n)})
    from gpushuffle.bench import _collect, _start_sampler, _stop_sampler

    # Rows borrowed from the persisted input take no memory whatever
    # the budget: copy them, so that the store holds every row.
    with cluster_with(
        {"gpushuffle.memory.host-pool.limit": 0, "gpushuffle.memory.borrow-inputs": False}
    ) as client:
        df = dd.from_pandas(pdf, npartitions=16, sort=False).persist()
        wait(df)

        def growth(budget) -> int:
            client.run(_set_budget, budget)
            results = []
            for _ in range(2):  # the smaller of two runs: the machine is noisy
                # Each run from the same start: what malloc kept of the last
                # one (its thresholds stay raised for idle-release) would
                # serve this one and hide its growth.
                client.run(_collect, True)
                before = max(client.run(_rss).values())
                client.run(_start_sampler, 0.005)
                lengths = df.shuffle("key", shuffle_method="gpushuffle").map_partitions(len)
                assert lengths.compute().sum() == n
                peak = max(s["peak"] for s in client.run(_stop_sampler).values())
                results.append(peak - before)
            return min(results)

        unbounded = growth("1 GiB")
        bounded = growth("8 MiB")
        assert gpushuffle.statistics(client)["spilled_bytes"].sum() > 0
        # Measured here: 72 to 80 MB unbounded, 35 to 39 MB with 8 MiB.
        assert bounded < 0.75 * unbounded, (bounded, unbounded)


def test_disk_off_and_budget_too_small_fails_clearly():
    pdf = big_frame(200_000)
    with cluster_with(
        {"gpushuffle.memory.host-limit": "256 KiB", "gpushuffle.storage.disk": False}
    ) as client:
        df = dd.from_pandas(pdf, npartitions=6, sort=False)
        start = time.monotonic()
        with pytest.raises(gpushuffle.ShuffleMemoryError, match=r"gpushuffle\.memory\.host-limit"):
            df.shuffle("key", shuffle_method="gpushuffle").compute()
        assert time.monotonic() - start < 60
        assert_nothing_left_behind(client)


def _fill_the_disk(dask_worker) -> None:
    import errno

    import gpushuffle.engine.store as store

    def full(fd, frames):
        raise OSError(errno.ENOSPC, "No space left on device")

    store.__dict__.setdefault("_FREE_DISK_WRITE", store._write_all)
    store._write_all = full


def _free_the_disk(dask_worker) -> None:
    import gpushuffle.engine.store as store

    store._write_all = store.__dict__.pop("_FREE_DISK_WRITE")


def test_disk_full_is_a_clear_error_and_leaves_nothing():
    pdf = big_frame(200_000)
    with cluster_with({"gpushuffle.memory.host-limit": "256 KiB"}) as client:
        client.run(_fill_the_disk)
        df = dd.from_pandas(pdf, npartitions=6, sort=False)
        with pytest.raises(OSError, match=r"No space left .*gpushuffle"):
            df.shuffle("key", shuffle_method="gpushuffle").compute()
        assert_nothing_left_behind(client)
        assert not any(client.run(_spill_files).values())
        client.run(_free_the_disk)


def test_cancelled_shuffle_leaves_no_spill_files():
    pdf = big_frame(600_000)
    with cluster_with({"gpushuffle.memory.host-limit": "512 KiB"}) as client:
        df = dd.from_pandas(pdf, npartitions=12, sort=False)
        future = client.compute(df.shuffle("key", shuffle_method="gpushuffle"))
        deadline = time.monotonic() + 30
        while not any(client.run(_spill_files).values()) and not future.done():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        future.cancel()
        assert_nothing_left_behind(client)
        deadline = time.monotonic() + 10
        while any(client.run(_spill_files).values()):
            assert time.monotonic() < deadline, client.run(_spill_files)
            time.sleep(0.1)


def test_free_blocks_serve_the_unpack_and_the_unused_ones_go_once_every_shuffle_unpacks():
    """Split buffers a transfer gave back wait for the unpack, whose outputs
    take them up (spread over several when none holds a whole output);
    once every shuffle holding the pool unpacks, those nobody takes go."""
    from gpushuffle.engine.pool import HostBufferPool

    pool = HostBufferPool(limit=1 << 30, idle_release=1.6)
    pool.hold()
    pool.hold()  # a second shuffle, still transferring
    splits = [pool.empty(size << 20, np.uint8, tag="split") for size in (8, 8, 8, 3)]
    for split in splits:
        split[:] = 1
    del splits, split
    assert pool.usage()["free"] >= 27 << 20
    assert not pool.count_unpack()  # the other one transfers: kept, however long
    time.sleep(0.4)
    assert pool.usage()["free"] >= 27 << 20
    assert pool.count_unpack()  # every shuffle unpacks
    # An output of 16 MiB of columns: two split blocks hold it, no fresh pages.
    fresh = pool.statistics.bytes_fresh
    output = pool.empty_buffers([5 << 20, 3 << 20, 4 << 20, 4 << 20], tag="unpack")
    assert [b.nbytes for b in output] == [5 << 20, 3 << 20, 4 << 20, 4 << 20]
    assert pool.statistics.bytes_fresh == fresh
    assert pool.statistics.reused == 2 and pool.usage()["unpack"] >= 16 << 20
    assert {b.ctypes.data for b in output[:2]} != {b.ctypes.data for b in output[2:]}
    for b in output:
        b[:] = 7  # separate memory: each buffer keeps its own bytes
    assert all((b == 7).all() for b in output)
    assert pool.usage()["free"] >= 11 << 20  # the third split block and the 3 MiB one ...
    time.sleep(0.5)  # ... unused for an eighth of idle_release while every shuffle unpacks
    assert pool.usage()["free"] == 0
    del output, b
    assert pool.usage()["free"] >= 16 << 20  # the outputs' blocks, for the next shuffle
    pool.unhold(unpacked=True)
    pool.unhold(unpacked=True)
    assert pool._activity.active == pool._activity.unpacking == 0


def test_buffers_share_a_block_that_holds_them_all_and_spread_over_free_ones_otherwise():
    from gpushuffle.engine.pool import HostBufferPool

    pool = HostBufferPool(limit=1 << 30, idle_release=0)
    pool.empty(2 << 20, np.uint8)  # dropped at once: a free 2 MiB block
    three = pool.empty_buffers([1 << 20, 1 << 20, 1 << 20])
    # The first two fill the free block, the third gets a fresh one.
    assert pool.statistics.reused == 1
    assert pool.statistics.bytes_fresh == (2 << 20) + (1 << 20)
    assert three[1].ctypes.data - three[0].ctypes.data == 1 << 20
    del three
    pool.empty(4 << 20, np.uint8)  # a free block that holds them all
    reused = pool.statistics.reused
    three = pool.empty_buffers([1 << 20, 1 << 20, 1 << 20])
    assert pool.statistics.reused == reused + 1
    starts = [b.ctypes.data for b in three]
    assert starts[1] - starts[0] == starts[2] - starts[1] == 1 << 20  # one block
    small = pool.empty_buffers([1000, 2000])  # under MIN_POOLED_BYTES: the allocator's
    assert [b.nbytes for b in small] == [1000, 2000]


@pytest.mark.parametrize("idle_release", [0.0, 0.05])
def test_malloc_settings_come_back_and_heaps_are_trimmed(monkeypatch, idle_release):
    """Even when no pooled buffer was used (small shards, or host-pool.limit 0),
    and also without a grace period (idle-release 0)."""
    from gpushuffle.engine import pool as pool_module

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    trims = []
    monkeypatch.setattr(pool_module, "trim_allocators", lambda arrow=True: trims.append(1))
    pool = pool_module.HostBufferPool(limit=0, idle_release=idle_release, malloc_reuse=True)
    pool.malloc._mallopt = lambda option, value: 1
    pool.hold()
    assert pool.malloc.reusing
    pool.empty(100, np.uint8)  # not pooled
    pool.unhold()
    if idle_release:
        time.sleep(idle_release * 2)
        pool.release_idle()
    assert not pool.malloc.reusing
    assert trims, "restored without trimming what the heaps kept"
    assert pool.statistics.malloc_reusing == 0


def test_a_paused_worker_gets_back_free_blocks_and_malloc_heaps(monkeypatch):
    """distributed pauses a worker whose memory passes worker.memory.pause and
    runs no task until it drops: what the pool keeps for speed (free blocks,
    malloc's raised thresholds) goes then, even while a shuffle runs."""
    from distributed.core import Status

    from gpushuffle.engine import pool as pool_module

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")

    class Worker:  # what the pool reads of a distributed Worker: its status
        status = Status.running

    worker = Worker()
    pool = pool_module.HostBufferPool(limit=64 << 20, idle_release=60, malloc_reuse=True)
    pool.malloc._mallopt = lambda option, value: 1
    pool.watch_worker(worker)
    pool.hold()  # a shuffle runs
    pool.empty(4 << 20, np.uint8)  # returned to the pool at once: a free block
    pool.release_idle()
    assert pool.usage()["free"] >= 4 << 20 and pool.malloc.reusing  # kept for the shuffle
    worker.status = Status.paused
    pool.release_idle()
    assert pool.usage()["free"] == 0 and not pool.malloc.reusing
    assert pool.statistics.pause_releases == 1
    worker.status = Status.running
    pool.unhold()


def test_malloc_reuse_only_lifts_a_nanny_trim_threshold(monkeypatch):
    from gpushuffle.engine.pool import MallocReuse

    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    untouched = MallocReuse(enabled=True)
    assert not untouched.reuse() and not untouched.reusing  # glibc's adaptive defaults stay
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    assert not MallocReuse(enabled=False).reuse()  # gpushuffle.memory.host-pool.malloc-reuse
    calls = []
    nanny = MallocReuse(enabled=True)
    nanny._mallopt = lambda option, value: calls.append((option, value)) or 1
    assert nanny.reuse() and nanny.reusing and not nanny.reuse()
    nanny.restore()
    assert not nanny.reusing
    # M_MMAP_THRESHOLD (-3) and M_TRIM_THRESHOLD (-1): raised, then the Nanny's back.
    assert calls == [(-3, 32 << 20), (-1, 64 << 20), (-1, 65536), (-3, 128 << 10)]


_ARENA_SCRIPT = """
import concurrent.futures, ctypes, sys, psutil
from gpushuffle.engine.pool import HostBufferPool

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
pool = HostBufferPool(limit=0, idle_release=0, malloc_reuse=True)
executor = concurrent.futures.ThreadPoolExecutor(1)
if sys.argv[1] == "watched":
    pool.malloc.watch(executor)
pool.hold()

def allocate_and_free():
    # 30 MiB from the top of the thread's own arena (under the raised mmap
    # threshold), written, and freed back into that top.
    p = libc.malloc(30 << 20)
    libc.memset(p, 1, 30 << 20)
    libc.free(p)

executor.submit(allocate_and_free).result()
before = psutil.Process().memory_info().rss
pool.unhold()  # no grace period: malloc's settings come back now, and it is trimmed
print((before - psutil.Process().memory_info().rss) >> 20)
"""


def test_restoring_malloc_trims_the_arenas_of_idle_task_threads():
    """What a task thread freed while the trim threshold was raised sits at
    the top of its own malloc arena, which malloc_trim does not shrink (the
    last CI run kept 65 MiB of it on a worker five seconds after a shuffle).
    """
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}
    returned = {
        how: int(
            subprocess.run(
                [sys.executable, "-c", _ARENA_SCRIPT, how],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for how in ("watched", "unwatched")
    }
    assert returned["watched"] >= 25, returned
    assert returned["unwatched"] < 5, returned  # malloc_trim alone: what the pokes are for


def test_footprint_returns_after_the_shuffle():
    """Distributed issue 8015: memory must come back once outputs are released."""
    n = 2_000_000
    rng = np.random.default_rng(2)
    pdf = pd.DataFrame({"key": rng.integers(0, 10**6, n), "a": rng.random(n), "b": rng.random(n)})
    with cluster_with({"gpushuffle.memory.host-pool.idle-release": "500ms"}) as client:
        df = dd.from_pandas(pdf, npartitions=10, sort=False).persist()
        wait(df)
        before = client.run(_rss)
        for _ in range(3):
            out = df.shuffle("key", shuffle_method="gpushuffle").persist()
            wait(out)
            assert len(out) == n
            del out
        assert_nothing_left_behind(client)
        time.sleep(1.5)  # pooled buffers idle past idle-release go back to the OS
        after = client.run(_rss)
        for worker, rss in after.items():
            assert rss <= before[worker] * 1.10, (worker, before[worker], rss)


def _raw_rss(dask_worker=None) -> int:
    """RSS as a user sees it: no garbage collection or malloc_trim first."""
    import psutil

    return psutil.Process().memory_info().rss


def test_five_seconds_after_a_shuffle_every_worker_is_back_within_64_mib():
    """Issue 12, at default settings on a real cluster (Nanny-started workers):
    what a shuffle allocated (pooled blocks, received messages, spill files)
    leaves the workers within seconds, while a shuffle right after reuses it.
    """
    n = 8_000_000  # 256 MB
    rng = np.random.default_rng(7)
    pdf = pd.DataFrame(
        {
            "key": rng.integers(0, 10**6, n),
            "a": rng.random(n),
            "b": rng.random(n),
            "c": np.arange(n),
        }
    )
    with cluster_with({}) as client:
        df = dd.from_pandas(pdf, npartitions=16, sort=False).persist()
        wait(df)
        shuffled = df.shuffle("key", shuffle_method="gpushuffle").map_partitions(len)
        # A small shuffle first, for imports and other first-time state.
        small = dd.from_pandas(pdf.iloc[:1000], npartitions=2, sort=False)
        assert len(small.shuffle("key", shuffle_method="gpushuffle")) == 1000
        del pdf
        time.sleep(5)
        before = client.run(_raw_rss)
        assert shuffled.compute().sum() == n
        assert shuffled.compute().sum() == n  # right after: the pool is reused
        stats = gpushuffle.statistics(client)
        assert (stats["host_pool_reused"] > 0).all()
        assert (stats["host_limit"] <= 256 << 20).all()  # the "auto" default
        # The Nanny's MALLOC_TRIM_THRESHOLD_ was lifted while shuffles ran ...
        assert (stats["host_pool_malloc_reuses"] > 0).all()
        assert_nothing_left_behind(client)
        time.sleep(5)
        after = client.run(_raw_rss)
        for worker, rss in after.items():
            grown = rss - before[worker]
            assert grown < 64 << 20, (worker, before[worker] >> 20, rss >> 20)
        # ... and is back now that none runs.
        assert (gpushuffle.statistics(client)["host_pool_malloc_reusing"] == 0).all()


def test_shards_cut_into_small_messages_keep_every_row_in_order():
    pdf = big_frame(300_000)
    settings = {
        "gpushuffle.comm.message-bytes-limit": "32 KiB",
        "gpushuffle.memory.host-limit": "1 MiB",
    }
    with cluster_with(settings, n_workers=3) as client:
        df = dd.from_pandas(pdf, npartitions=5, sort=False)
        parts = check(
            df.shuffle("key", npartitions=7, shuffle_method="gpushuffle"),
            df.shuffle("key", npartitions=7, shuffle_method="tasks"),
            pdf,
        )
        for part in parts:
            assert part["row"].is_monotonic_increasing
        assert_nothing_left_behind(client)


def _split_bytes(client) -> int:
    return int(gpushuffle.statistics(client)["copied_split_bytes"].sum())


def _set_borrow(value, dask_worker=None) -> None:
    dask.config.set({"gpushuffle.memory.borrow-inputs": value})


def _column_sums(part: pd.DataFrame) -> pd.DataFrame:
    return part.sum().to_frame().T


def _outputs_in_use() -> int:
    from gpushuffle.engine.pool import host_pool

    return host_pool().in_use("unpack")


def test_a_persisted_shuffle_lets_go_of_received_shards_as_its_outputs_grow():
    """Outputs kept (the shuffled frame persisted): once half of a received
    shard was read, the store copies its rest together and lets the shard's
    receive buffer go (engine/store.py), so it shrinks as the outputs grow;
    measured, 12M rows on 2 workers peaked 0.18 GiB lower.  On real workers
    over TCP, every row lands as with the tasks method, and as reduced."""
    from gpushuffle.bench import persisted_evenly

    with cluster_with({}) as client:
        # Four inputs on each worker (8 MB of rows to its peer from each).
        df = persisted_evenly(client, rows=2_400_000, partitions=8, columns=7)
        pdf = df.compute()

        def totals() -> pd.DataFrame:
            return gpushuffle.statistics(client)[["host_compactions", "wire_bytes_sent"]]

        before = totals()
        ours = df.shuffle("key", npartitions=24, shuffle_method="gpushuffle").persist()
        wait(ours)
        kept = totals() - before
        assert (kept["host_compactions"] > 0).all(), kept
        check(ours, df.shuffle("key", npartitions=24, shuffle_method="tasks"), pdf)
        del ours
        # Released asynchronously: the outputs of the next shuffle alone count.
        deadline = time.monotonic() + 30
        while any(client.run(_outputs_in_use).values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = totals()
        shuffled = df.shuffle("key", npartitions=24, shuffle_method="gpushuffle")
        # A map_partitions keeps the shuffle (dask drops one under a plain sum).
        sums = shuffled.map_partitions(_column_sums).compute().sum()
        reduced = totals() - before
        pd.testing.assert_series_equal(sums, pdf.sum(), rtol=1e-9)
        # Every column went (dask pushes a projection into the shuffle: a
        # reduction of one column would move too little to copy anything).
        assert (reduced["wire_bytes_sent"] >= 0.9 * kept["wire_bytes_sent"]).all()
        # Whether it copies depends on the scheduler's order: the newest dask
        # ran every unpack before the reductions (outputs held: copies, 6 on a
        # worker), 2026.7.1 reduces each as it is built (none).  That outputs
        # consumed as built copy nothing is tests/test_store.py's to check.
        del df
        assert_nothing_left_behind(client)


@borrows
def test_rows_kept_on_their_worker_stay_in_a_persisted_input():
    """With a persisted input, the rows a worker keeps are not copied (only
    those sent are); an input computed on the way is copied whole; every
    result equals the tasks method's, and nothing is left behind."""
    pdf = big_frame(200_000)
    with cluster_with({"gpushuffle.memory.host-limit": "1 MiB"}) as client:
        persisted = dd.from_pandas(pdf, npartitions=8, sort=False).persist()
        wait(persisted)
        computed = dd.from_pandas(pdf, npartitions=8, sort=False)
        split = {}
        for name, df, borrow in [
            ("copied", persisted, False),
            ("borrowed", persisted, True),
            ("computed", computed, True),
        ]:
            client.run(_set_borrow, borrow)
            before = _split_bytes(client)
            check(
                df.shuffle("key", npartitions=6, shuffle_method="gpushuffle"),
                df.shuffle("key", npartitions=6, shuffle_method="tasks"),
                pdf,
            )
            split[name] = _split_bytes(client) - before
        # Two workers: about half the rows stay on their worker.
        assert 0.3 * split["copied"] < split["borrowed"] < 0.7 * split["copied"], split
        assert split["computed"] == split["copied"], split
        assert_nothing_left_behind(client)


@borrows
@pytest.mark.parametrize("operation", ["set_index", "sort_values"])
def test_set_index_and_sort_values_of_a_persisted_input_borrow_its_rows(operation):
    """The partition ids set_index and sort_values assign to a persisted
    input leave its other columns shared with it: rows a worker keeps are
    borrowed (about half the split's copies), and every row comes out once,
    in order."""
    pdf = big_frame(200_000)
    with cluster_with({"gpushuffle.memory.host-limit": "1 MiB"}) as client:
        persisted = dd.from_pandas(pdf, npartitions=8, sort=False).persist()
        wait(persisted)
        split = {}
        for borrow in (False, True):
            client.run(_set_borrow, borrow)
            before = _split_bytes(client)
            with dask.config.set({"dataframe.shuffle.method": "gpushuffle"}):
                if operation == "set_index":
                    result = persisted.set_index("key")
                else:
                    result = persisted.sort_values("key")
                # Persisted first: compute() alone would let dask sort one
                # concatenated partition, without a shuffle.
                got = result.persist().compute()
            split[borrow] = _split_bytes(client) - before
            assert len(got) == len(pdf)
            keys = got.index if operation == "set_index" else got["key"]
            assert keys.is_monotonic_increasing
            expected = pdf.set_index("key") if operation == "set_index" else pdf
            assert checksum(got, index=operation == "set_index") == checksum(
                expected, index=operation == "set_index"
            )
        client.run(_set_borrow, True)
        assert 0.3 * split[False] < split[True] < 0.7 * split[False], split
        assert_nothing_left_behind(client)


@borrows
def test_join_of_persisted_sides_borrows_and_matches_pandas():
    rng = np.random.default_rng(8)
    left = pd.DataFrame(
        {
            "k": rng.integers(0, 5_000, 60_000),
            "a": rng.random(60_000),
            "s": pd.array([f"l{i % 977}" for i in range(60_000)], dtype="str"),
        }
    )
    right = pd.DataFrame(
        {
            "k": np.arange(5_000),
            "b": rng.integers(0, 10**6, 5_000),
            "t": [f"r{i}" for i in range(5_000)],
        }
    )
    with cluster_with({"gpushuffle.memory.host-limit": "256 KiB"}) as client:
        lhs = dd.from_pandas(left, npartitions=6, sort=False).persist()
        rhs = dd.from_pandas(right, npartitions=4, sort=False).persist()
        wait([lhs, rhs])
        for how in ("inner", "left", "outer"):
            before = _split_bytes(client)
            ours = lhs.merge(rhs, on="k", how=how, shuffle_method="gpushuffle", broadcast=False)
            assert any("gpushuffle-join" in str(k) for k in ours.dask)
            result = ours.compute()
            truth = left.merge(right, on="k", how=how)
            assert len(result) == len(truth)
            assert checksum(result, index=False) == checksum(
                truth[list(result.columns)], index=False
            )
            copied = _split_bytes(client) - before
            sent_or_kept = (
                left.memory_usage(deep=False).sum() + right.memory_usage(deep=False).sum()
            )
            assert copied < 0.8 * sent_or_kept, (copied, sent_or_kept)
        assert_nothing_left_behind(client)


@pytest.mark.parametrize(
    "visible, nvml_count, expected",
    [
        ("0", 8, 2),  # both workers pinned to GPU 0 of eight: they share it
        ("0,1", 8, 1),  # dask-cuda's layout: each worker sees every GPU, rotated
        (None, 2, 1),  # nothing set: NVML's count of the host's GPUs
        (None, 1, 2),
        ("", 8, 2),  # no GPU visible: count every local worker
    ],
)
def test_workers_sharing_a_gpu_count_only_the_gpus_this_process_may_use(
    monkeypatch, visible, nvml_count, expected
):
    """The device budget is split among the workers that share a GPU; NVML
    counts every GPU of the host, so two workers pinned to one GPU of eight
    would each budget as if they had it alone (docs/gpu-calls.md, S3)."""
    from distributed.diagnostics import nvml

    from gpushuffle.engine.budget import workers_sharing_the_gpu

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(nvml, "device_get_count", lambda: nvml_count)
    workers = ["tcp://10.0.0.1:1000", "tcp://10.0.0.1:1001", "tcp://10.0.0.2:1000"]
    assert workers_sharing_the_gpu("tcp://10.0.0.1:1000", workers) == expected


def _rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    pytest.skip("no RssAnon in /proc/self/status")


def _arrow_strings(nbytes: int) -> list:
    """Arrow string arrays of about ``nbytes`` in all, in pyarrow's default pool."""
    import pyarrow as pa

    piece = pa.array(["x" * 30] * 100_000)  # 3.4 MB with its offsets
    return [pa.concat_arrays([piece] * 10) for _ in range(-(-nbytes // 34_000_000))]


def _mimalloc_or_skip() -> None:
    import pyarrow as pa

    if pa.default_memory_pool().backend_name != "mimalloc":
        pytest.skip("pyarrow's pool is not mimalloc here: it may not keep freed memory")


def _freed_strings_kept_or_skip() -> tuple[int, int]:
    """RssAnon with 256 MiB of Arrow strings allocated, and once they are
    freed; skips where pyarrow's allocator gave them back by itself."""
    _mimalloc_or_skip()
    arrays = _arrow_strings(256 << 20)
    allocated = _rss_anon()
    del arrays
    kept = _rss_anon()
    if kept < allocated - (64 << 20):
        pytest.skip("pyarrow's allocator gave it back by itself here: nothing to test")
    return allocated, kept


def test_trimming_gives_back_what_pyarrow_kept_of_freed_memory():
    """mimalloc (pyarrow's allocator) keeps every freed page until asked: a
    worker that shuffled strings measured 300-380 MiB "held" after making
    room for its outputs, 190-250 MiB with it given back."""
    from gpushuffle.engine.pool import trim_allocators

    allocated, kept = _freed_strings_kept_or_skip()
    trim_allocators()
    assert _rss_anon() < kept - (160 << 20), (allocated >> 20, kept >> 20, _rss_anon() >> 20)


def test_a_paused_worker_gives_back_what_pyarrow_freed_since_the_last_trim():
    """A hot output distributed spills while its worker is over its spill
    fraction frees its strings into pyarrow's pool after the pool trimmed:
    the next look gives them back, though a task thread freed them (pyarrow
    releases every thread's unused memory)."""
    import threading

    from distributed.core import Status

    from gpushuffle.engine import pool as pool_module

    _mimalloc_or_skip()

    class Worker:  # what the pool reads of a distributed Worker: its status
        status = Status.paused

    worker = Worker()
    # idle_release 0: no trimmer thread, the test's calls are the only looks.
    pool = pool_module.HostBufferPool(limit=64 << 20, idle_release=0)
    pool.watch_worker(worker)
    pool.hold()  # a shuffle runs
    allocated, freed, finish = threading.Event(), threading.Event(), threading.Event()

    def task_thread() -> None:  # allocates and frees, and stays alive meanwhile
        arrays = _arrow_strings(256 << 20)
        allocated.set()
        freed.wait()
        del arrays
        allocated.clear()
        finish.wait()

    thread = threading.Thread(target=task_thread)
    thread.start()
    try:
        assert allocated.wait(60)
        start = pool.statistics.pause_releases
        pool.release_idle()  # paused, the strings in use: nothing pyarrow freed
        assert pool.statistics.pause_releases == start
        freed.set()
        while allocated.is_set():
            time.sleep(0.01)
        kept = _rss_anon()
        pool.release_idle()
        assert pool.statistics.pause_releases == start + 1, "what pyarrow freed stayed with it"
        assert _rss_anon() < kept - (160 << 20), (kept >> 20, _rss_anon() >> 20)
        pool.release_idle()  # nothing freed since: no trim on every look
        assert pool.statistics.pause_releases == start + 1
    finally:
        freed.set()
        finish.set()
        thread.join()
        worker.status = Status.running
        pool.unhold()


def test_strings_distributed_spills_go_back_when_they_are_dropped():
    """A worker over its target fraction pickles a large Arrow column (what
    distributed does to spill an output) and drops it: what pyarrow kept of
    it is back with the OS at once, before distributed reads the output back
    into fresh memory beside it, often in the same step of its event loop
    (a 1 GiB worker peaked at 93% of its limit, 74-80% without that).
    (pyarrow 26's mimalloc gave back what the main thread freed only when
    asked on the main thread: asked from another thread, nothing of 321 MiB.)"""
    import pickle
    import types

    import pyarrow as pa
    from distributed.core import Status

    from gpushuffle.engine import pool as pool_module
    from gpushuffle.engine.pool import trim_allocators

    _freed_strings_kept_or_skip()  # what is tested below happens here
    trim_allocators()

    # What the pool reads of a distributed Worker; the limit is so low that
    # any process is over its target fraction.
    manager = types.SimpleNamespace(
        memory_limit=1 << 20, memory_target_fraction=0.6, memory_spill_fraction=0.7
    )

    class Worker:  # held in a WeakSet by the pool
        status = Status.running
        memory_manager = manager

    pool = pool_module.HostBufferPool(limit=64 << 20, idle_release=0)  # no trimmer thread
    previous, pool_module._POOL = pool_module._POOL, pool
    worker = Worker()
    try:
        pool.watch_worker(worker)
        column = pd.arrays.ArrowExtensionArray(pa.chunked_array(_arrow_strings(256 << 20)))
        kept_column = pd.arrays.ArrowExtensionArray(pa.chunked_array(_arrow_strings(64 << 20)))
        frames: list = []
        pickle.dumps((column, kept_column), protocol=5, buffer_callback=frames.append)
        del frames
        before = _rss_anon()
        del column
        assert _rss_anon() < before - (160 << 20), (before >> 20, _rss_anon() >> 20)
        assert pool.statistics.arrow_spill_releases == 1
        assert kept_column.to_numpy()[-1] == "x" * 30  # what was not dropped is whole
        manager.memory_limit = 1 << 40  # no longer short of memory: kept for reuse
        before = _rss_anon()
        del kept_column
        assert _rss_anon() > before - (32 << 20)
        assert pool.statistics.arrow_spill_releases == 1
    finally:
        pool._arrow_watch_until = 0.0
        pool_module._POOL = previous


async def _pickle_and_drop_strings(nbytes: int, dask_worker=None) -> dict:
    """On a worker's event loop (its process's main thread), as distributed
    spills an output: pickle an Arrow string column, drop it, and read RSS
    in the same step, before anything else runs on the loop."""
    import pickle

    import pyarrow as pa

    from gpushuffle.engine.pool import host_pool

    if pa.default_memory_pool().backend_name != "mimalloc":
        return {"skip": pa.default_memory_pool().backend_name}
    pool = host_pool()
    pool.watch_worker(dask_worker)
    column = pd.arrays.ArrowExtensionArray(pa.chunked_array(_arrow_strings(nbytes)))
    frames: list = []
    pickle.dumps(column, protocol=5, buffer_callback=frames.append)
    del frames
    before = _rss_anon()
    del column
    return {
        "before": before,
        "after": _rss_anon(),
        "releases": pool.statistics.arrow_spill_releases,
        "limit": dask_worker.memory_manager.memory_limit,
        "rss": __import__("psutil").Process().memory_info().rss,
    }


def test_a_worker_gives_back_strings_it_spills_in_the_same_step_of_its_loop():
    """On a real (Nanny) worker over its target fraction: the column's
    memory is back with the OS right after it is dropped, in the same step
    of the event loop, where distributed reads a spilled output back."""
    # A worker of 600 MiB: 300 MiB of strings put it over 60%.
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, memory_limit="600MiB", dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        (seen,) = client.run(_pickle_and_drop_strings, 300 << 20).values()
    if "skip" in seen:
        pytest.skip(f"pyarrow's pool is {seen['skip']} here, not mimalloc")
    assert seen["releases"] == 1, seen
    assert seen["after"] < seen["before"] - (200 << 20), seen


def _limits_on_the_event_loop(dask_worker=None) -> tuple[int, int]:
    from gpushuffle import config
    from gpushuffle.engine.pool import _make_pool

    return config.worker_memory_limit(), _make_pool().configured_limit


def test_memory_limits_read_on_a_workers_event_loop_are_the_workers():
    """``client.run`` runs on the worker's event loop, as a shard received
    before the worker's first task of a shuffle does, where distributed's
    ``get_worker()`` finds no worker: the limits there were the machine's (the
    host pool kept up to 512 MiB of free blocks on 1 GiB workers, and pooled
    a hot output's columns, held again while distributed read it back)."""
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, memory_limit="1GiB", dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        ((limit, pool_limit),) = client.run(_limits_on_the_event_loop).values()
    assert limit == 1 << 30
    assert pool_limit == int(0.1 * (1 << 30))  # gpushuffle.memory.host-pool.limit: 0.1
