"""A run's memory decisions: how much of its machine a worker may use, the
budget its output partitions are judged by, and making room for them.

:mod:`gpushuffle.engine.memory` keeps the tiers' accounting (what each tier
holds against its limit); this module decides with it.  The run
(:mod:`gpushuffle.engine.run`) asks once, as its first output is built
(:func:`output_budget`), and passes the verdict to
:func:`~gpushuffle.engine.outputs.check_outputs_fit`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from distributed.comm import get_address_host
from distributed.utils import sync

from gpushuffle import config
from gpushuffle.engine.memory import DEVICE, worker_memory
from gpushuffle.engine.outputs import FitBudget, OutputSize, build_need, fits
from gpushuffle.engine.pool import host_pool, release_arrow_unused, trim_allocators

logger = logging.getLogger(__name__)

#: Outputs up to this share of the worker's memory limit (with what building
#: them holds beyond them) are built without first making room for them
#: where the worker's RSS leaves room (:func:`host_fit_budget`).
SMALL_OUTPUT = 0.25


# -- who shares the machine ----------------------------------------------------


def workers_on_host(address: str, workers: Iterable[str]) -> int:
    """How many of a run's ``workers`` run on ``address``'s host, itself included."""
    host = get_address_host(address)
    return len({w for w in workers if get_address_host(w) == host} | {address})


def workers_sharing_the_gpu(address: str, workers: Iterable[str]) -> int:
    """How many workers of a run likely share this worker's GPU.

    Workers on the same host as ``address``, spread over the GPUs this
    process may use: dask-cuda runs one worker per GPU (1), two workers on a
    one-GPU machine, or pinned to one GPU of many, share it (2).
    """
    local = workers_on_host(address, workers)
    return max(1, -(-local // max(1, visible_gpus())))


def visible_gpus() -> int:
    """The GPUs this process may use, as dask-cuda counts them
    (``dask_cuda.utils.get_n_gpus``, 26.10): the entries of
    ``CUDA_VISIBLE_DEVICES`` where it is set, else NVML's count of the host's
    GPUs (no CUDA context is opened).  NVML alone counts every GPU of the host
    and so undercounts workers pinned to one of several.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        from distributed.diagnostics import nvml

        return int(nvml.device_get_count())
    except Exception:
        return 0


# -- the budget an output partition is judged by ---------------------------------


def fit_budget(limit: int, base: int, fail_at: float) -> FitBudget:
    return FitBudget(
        limit=limit,
        base=max(0, base),
        fail_at=fail_at,
        warn_at=float(config.get("memory.output-warn")),
        memory="this worker's memory limit",
    )


def output_budget(
    tier: str,
    largest: OutputSize,
    overhead: Callable[[OutputSize], int],
    make_room: Callable[[], None],
    worker: Any,
    describe: str = "gpushuffle",
) -> FitBudget:
    """The budget the run's largest output partition is judged by, on its tier.

    On the device, the store's own accounting (what every run on the worker
    holds there, this partition's pieces included) against the worker's share
    of device memory; on the host, :func:`host_fit_budget`.
    """
    fail_at = float(config.get("memory.output-fail"))
    if tier != DEVICE:
        return host_fit_budget(largest, fail_at, overhead, make_room, worker, describe)
    memory = worker_memory()
    return dataclasses.replace(
        fit_budget(memory.device_share or 0, memory.device.bytes, fail_at),
        memory="this worker's share of device memory",
        base_note="the device memory its shuffles' stores hold",
    )


def host_fit_budget(
    largest: OutputSize,
    fail_at: float,
    overhead: Callable[[OutputSize], int],
    make_room: Callable[[], None],
    worker: Any,
    describe: str = "gpushuffle",
) -> FitBudget:
    """The host budget: the worker's base is ``memory.worker-reserve``,
    or what it holds once room is made where that is more.

    A reading of RSS in a live worker is not a base to judge by: the
    same 0.61 GiB partition on 1 GiB workers was built in one run and
    refused in the next, and even after making room (the store on disk,
    collected, malloc trimmed, the pool's free blocks gone) the workers'
    own memory read 180 to 241 MiB from run to run.  The reserve makes
    the verdict a rule on sizes; the measurement only refuses more, where
    a worker holds more than its reserve (other libraries, a leak), and
    the error says so.  Outputs of at most :data:`SMALL_OUTPUT` of the
    limit move nothing where even the worker's RSS leaves room.
    """
    limit = config.worker_memory_limit()
    reserve = config.parse_budget(
        config.get("memory.worker-reserve"), limit, "memory.worker-reserve"
    )
    budget = fit_budget(limit, reserve, fail_at)
    if not fits(largest, budget, overhead):
        return budget  # refused on sizes alone: nothing to move or measure
    small = largest.nbytes + overhead(largest) <= SMALL_OUTPUT * limit
    if small and fits(largest, fit_budget(limit, max(reserve, rss()), fail_at), overhead):
        return budget
    make_room()
    managed = managed_in_memory(worker)
    held = rss() - managed
    logger.debug(
        "%s: after making room the worker holds %d MiB besides distributed's %d MiB "
        "of data in memory (reserve %d MiB); pool %s",
        describe,
        held >> 20,
        managed >> 20,
        reserve >> 20,
        {k: v >> 20 for k, v in host_pool().usage().items()},
    )
    if held > reserve:
        budget = dataclasses.replace(
            budget,
            base=held,
            base_note="measured after making room: more than gpushuffle.memory.worker-reserve",
        )
    if fits(largest, budget, overhead):
        # distributed's data stays in memory until the worker passes its
        # spill fraction; the build would get there at once.
        room = int(fail_at * limit) - build_need(largest, budget, overhead)
        evict_managed(worker, keep=max(0, room))
    return budget


# -- making room -----------------------------------------------------------------


def make_room(store: Any, loop: Any, describe: str) -> None:
    """Move the store's host tier to disk, collect, trim malloc and unmap
    the pool's free blocks: what is left is what the worker needs.

    Every shard is in now, and the pieces of partitions not being built
    share received buffers with the one that is: a hot partition of half
    the limit, on top of the worker's own memory and a full host budget,
    came within a few percent of the Nanny's restart (seen in CI on 1 GiB
    workers).  Built from disk, the output holds one piece at a time.
    """
    if store.statistics.host_bytes:
        in_memory = store.statistics.host_bytes
        try:
            moved = sync(loop, store.shed_host, True)
        except OSError as e:
            # A full or failing disk: the outputs are built from memory, as
            # they would have been; a put that needs the disk reports it.
            logger.warning(
                "%s: moving received shards to disk for the outputs failed: %r", describe, e
            )
            moved = 0
        if moved:
            logger.info(
                "%s: moved %d MiB of received shards to disk before building the outputs",
                describe,
                (in_memory - store.statistics.host_bytes) >> 20,
            )
    gc.collect()
    # What the allocators keep of freed memory goes back too, pyarrow's
    # included, on the event loop's thread as well: mimalloc gives back
    # every thread's only when asked on the main thread, where a Nanny's
    # worker runs its loop.  Counting what it kept made the verdict on a
    # partition of strings near the line differ from run to run (what it
    # kept varied by 80 MiB); its cost was a read-back by distributed on top
    # of it, which no longer happens (pool.HostBufferPool.watch_arrow_frees).
    host_pool().release_idle(0, arrow=True)
    trim_allocators(arrow=True)
    try:
        sync(loop, _release_arrow_on_the_loop)
    except Exception as e:  # a closing worker: what was measured stands
        logger.debug("%s: releasing pyarrow's memory on the event loop failed: %r", describe, e)


async def _release_arrow_on_the_loop() -> None:
    release_arrow_unused()


def rss() -> int:
    """This process's resident memory, as the Nanny reads it."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def managed_in_memory(worker: Any) -> int:
    """What distributed counts of the worker's data in memory (sizeof)."""
    fast = getattr(worker.data, "fast", None)
    weight = getattr(fast, "total_weight", None)
    return int(weight) if weight is not None else 0


def evict_managed(worker: Any, keep: int) -> int:
    """Have distributed spill the worker's data (least recently used first)
    until at most ``keep`` bytes of it are in memory; return what is left.

    What distributed's memory monitor would do once the build passed the
    spill fraction, done before it: the monitor acts every 100 ms, a build
    allocates faster.  Workers without a spill buffer keep their data.
    """
    evict = getattr(worker.data, "evict", None)
    left = managed_in_memory(worker)
    while evict is not None and left > keep:
        if evict() < 0:  # nothing more it can spill
            break
        left = managed_in_memory(worker)
    return left
