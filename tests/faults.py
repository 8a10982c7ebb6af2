"""Helpers for the fault tests: a cluster in the test, inputs, their truth, cleanup.

The fault tests run on :func:`cluster_test`: a scheduler and workers in the
test's process, talking over real TCP comms (shards are serialized and
sent), so a test can wait for exact task states and close a worker at that
moment.  Process crashes use a ``Nanny`` (a real worker process) next to
them.  Like ``distributed.utils_test.gen_cluster``, but without its global
clean-up, which terminates every child process of the test run (the
session cluster's workers among them).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import io
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
from conftest import is_clean, worker_leftovers
from dask.utils import key_split
from distributed import Client, Scheduler, Worker
from truth import checksum

TRANSFER = "gpushuffle-transfer"
UNPACK = "gpushuffle-unpack"


def make_part(i: int, rows: int) -> pd.DataFrame:
    """Input partition ``i``: the same rows wherever and however often it is computed."""
    rng = np.random.default_rng(i)
    nullable = pd.array(rng.integers(-9, 9, rows), dtype="Int64")
    nullable[rng.random(rows) < 0.1] = pd.NA
    return pd.DataFrame(
        {
            "key": rng.integers(0, 1000, rows),
            # Increasing across input partitions: within an output partition
            # rows must stay grouped by input partition, in input order.
            "row": np.arange(i * rows, (i + 1) * rows),
            "x": rng.random(rows),
            "s": pd.array([f"v{v}" for v in rng.integers(0, 50, rows)], dtype="string[pyarrow]"),
            "n": nullable,
        },
        index=pd.RangeIndex(i * rows, (i + 1) * rows),
    )


def frame(nin: int, rows: int) -> dd.DataFrame:
    """A dask frame computed on the workers (no data in the graph)."""
    return dd.from_map(make_part, range(nin), rows=rows, meta=make_part(0, 0))


@dataclass(frozen=True)
class Truth:
    rows: int
    checksum: int
    # (rows, checksum) of each output partition of dask's "tasks" shuffle.
    parts: tuple[tuple[int, int], ...]


@functools.cache
def truth(nin: int, rows: int, nout: int) -> Truth:
    """pandas and dask's ``tasks`` shuffle, computed locally, not on the cluster."""
    whole = pd.concat([make_part(i, rows) for i in range(nin)])
    tasks = frame(nin, rows).shuffle("key", npartitions=nout, shuffle_method="tasks")
    parts = dask.compute(*tasks.to_delayed(), scheduler="sync")
    return Truth(
        rows=len(whole),
        checksum=checksum(whole),
        parts=tuple((len(p), checksum(p)) for p in parts),
    )


def gpushuffled(nin: int, rows: int, nout: int) -> dd.DataFrame:
    return frame(nin, rows).shuffle("key", npartitions=nout, shuffle_method="gpushuffle")


#: Input partitions computed so far by a gated worker, per gate.
_GATED: dict[str, int] = {}


def _gated_part(i: int, rows: int, gate: str, worker: str) -> pd.DataFrame:
    from distributed import get_worker

    if get_worker().address == worker:
        _GATED[gate] = _GATED.get(gate, 0) + 1
        deadline = time.monotonic() + 60
        while _GATED[gate] > 2 and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
    return make_part(i, rows)


def gpushuffled_gated(nin: int, rows: int, nout: int, gate: str, worker: str) -> dd.DataFrame:
    """:func:`gpushuffled`, but ``worker`` (in this process) computes two
    input partitions and then waits, before its third, until the file
    ``gate`` exists: the other workers do the rest of the transfer, and one
    transfer is left until the gate opens, however fast they went."""
    gated = dd.from_map(
        _gated_part, range(nin), rows=rows, gate=gate, worker=worker, meta=make_part(0, 0)
    )
    return gated.shuffle("key", npartitions=nout, shuffle_method="gpushuffle")


def assert_correct(parts: list[pd.DataFrame], expected: Truth) -> None:
    """Every row present once, each in the partition the ``tasks`` shuffle puts it in."""
    assert len(parts) == len(expected.parts)
    for i, (part, (nrows, digest)) in enumerate(zip(parts, expected.parts, strict=True)):
        assert len(part) == nrows, f"output partition {i}: {len(part)} rows, truth {nrows}"
        assert checksum(part) == digest, f"output partition {i}: rows differ from the truth"
        assert part["row"].is_monotonic_increasing, f"output partition {i}: order lost"
    whole = pd.concat(parts)
    assert len(whole) == expected.rows
    assert checksum(whole) == expected.checksum


# -- a cluster in the test's process -----------------------------------------


def cluster_test(
    n_workers: int = 2, config: dict | None = None, timeout: float = 60
) -> Callable[[Callable[..., Awaitable[None]]], Callable[..., None]]:
    """Run ``async def test(c, s, *workers, **params)`` on a fresh in-process cluster.

    One thread per worker; the scheduler and workers validate their state
    machines on every transition.  ``config`` applies to the whole test (to
    ``Nanny`` workers too: a Nanny hands its configuration to its worker).
    The test fails after ``timeout`` seconds instead of hanging.
    """

    def decorator(func: Callable[..., Awaitable[None]]) -> Callable[..., None]:
        @functools.wraps(func)
        def test(*args: Any, **kwargs: Any) -> None:
            async def main() -> None:
                settings = {
                    "distributed.scheduler.validate": True,
                    "distributed.worker.validate": True,
                    **(config or {}),
                }
                with dask.config.set(settings):
                    async with Scheduler(host="127.0.0.1", port=0, dashboard=False) as s:
                        workers = [Worker(s.address, nthreads=1, name=i) for i in range(n_workers)]
                        try:
                            await asyncio.gather(*workers)
                            async with Client(s.address, asynchronous=True) as c:
                                await _within(timeout, func(c, s, *workers, *args, **kwargs))
                        finally:
                            await asyncio.gather(*(w.close() for w in workers))

            asyncio.run(main())

        # pytest supplies only what follows the cluster's arguments (parameters).
        parameters = list(inspect.signature(func).parameters.values())[2 + n_workers :]
        test.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        del test.__wrapped__  # type: ignore[attr-defined]
        return test

    return decorator


async def _within(timeout: float, coroutine: Awaitable[None]) -> None:
    task = asyncio.ensure_future(coroutine)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        stack = io.StringIO()
        task.print_stack(file=stack)  # where the test hangs
        task.cancel()
        raise AssertionError(f"test still running after {timeout} s:\n{stack.getvalue()}")
    task.result()


# -- waiting on the scheduler's task states -------------------------------


def count_tasks(scheduler: Any, prefix: str, state: str, worker: str | None = None) -> int:
    n = 0
    for ts in scheduler.tasks.values():
        if key_split(ts.key) != prefix or ts.state != state:
            continue
        if worker is not None:
            on = {ws.address for ws in ts.who_has or ()}
            if ts.processing_on is not None:
                on.add(ts.processing_on.address)
            if worker not in on:
                continue
        n += 1
    return n


async def wait_for(predicate: Any, timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        await asyncio.sleep(0.001)


async def wait_for_tasks(
    scheduler: Any, prefix: str, state: str, count: int = 1, worker: str | None = None
) -> None:
    await wait_for(
        lambda: count_tasks(scheduler, prefix, state, worker) >= count,
        what=f"{count} {prefix} task(s) in state {state} on {worker or 'any worker'}",
    )


async def wait_for_shuffle(scheduler: Any) -> str:
    """The id of the shuffle that becomes active next."""
    plugin = scheduler.plugins["shuffle"]
    await wait_for(lambda: plugin.active_shuffles, what="an active shuffle")
    (shuffle_id,) = plugin.active_shuffles
    return shuffle_id


def run_ids(scheduler: Any, shuffle_id: str) -> list[int]:
    """Every run the scheduler started for ``shuffle_id`` (more than one: restarted)."""
    return sorted(state.run_id for state in scheduler.plugins["shuffle"]._shuffles[shuffle_id])


# -- what must be gone afterwards -------------------------------------------


def spill_files(directory: str) -> list[str]:
    """gpushuffle's files under a worker's local directory (spill dirs and their files)."""
    found = []
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            if "gpushuffle" in os.path.relpath(path, directory):
                found.append(path)
    return found


async def assert_workers_clean(client: Any, timeout: float = 10) -> None:
    """No run, no store bytes, no spill file on any worker the cluster still has."""
    deadline = time.monotonic() + timeout
    while True:
        states = await client.run(worker_leftovers)
        if all(is_clean(s) for s in states.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"shuffle state left on workers: {states}")
        await asyncio.sleep(0.05)


def assert_closed_worker_clean(worker: Any) -> None:
    """A worker that was closed holds no run and left no spill file behind."""
    assert "shuffle" not in worker.plugins
    assert worker.status.name == "closed"
    assert not spill_files(worker.local_directory)


async def assert_scheduler_clean(scheduler: Any, timeout: float = 10) -> None:
    """Once the client is gone, the scheduler forgot every shuffle."""
    plugin = scheduler.plugins["shuffle"]

    def forgotten() -> bool:
        return not (
            plugin.active_shuffles
            or plugin._shuffles
            or plugin._archived_by_stimulus
            or plugin.heartbeats
        )

    await wait_for(forgotten, timeout, "the scheduler to forget every shuffle")


async def spill_files_on(client: Any, address: str) -> list[str]:
    def files(dask_worker: Any) -> list[str]:
        return spill_files(dask_worker.local_directory)

    return (await client.run(files, workers=[address]))[address]


async def local_directory_of(client: Any, address: str) -> str:
    def directory(dask_worker: Any) -> str:
        return dask_worker.local_directory

    return (await client.run(directory, workers=[address]))[address]
