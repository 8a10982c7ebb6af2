"""GPU check of the store's device tier, runnable where cupy works but cuDF is absent.

Drives gpushuffle's real ShardStore with a backend whose tables are cupy
arrays (a stand-in for cuDF's device buffers): shards are charged to the
device tier, moved device -> host (into pageable host memory, as the cuDF
backend's ``ChunkedPack.pack_to_host`` does) and host -> disk when over
budget, and brought back up on read, in input order; as with cuDF, a table
read back from disk is deserialized straight onto the device.  Prints the
throughput of those moves next to the raw copy bandwidths measured in the
same run (device to device, device to pageable and to pinned host memory,
and back).

    python -m benchmarks.device_check [--mib 512]

Writes a JSON summary to $OUT/device_check.json when OUT is set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

import cupy
import numpy as np
import pandas as pd
from cupyx import empty_pinned

from gpushuffle.backends import register_backend
from gpushuffle.backends.base import TableBackend
from gpushuffle.engine.memory import TierUsage, WorkerMemory
from gpushuffle.engine.store import ShardStore
from gpushuffle.transport import Shard


class CupyTable:
    def __init__(self, device: Any = None, host: np.ndarray | None = None) -> None:
        self.device, self.host = device, host

    def __len__(self) -> int:
        return len(self.device if self.device is not None else self.host)


class CupyBackend(TableBackend):
    """Device tables as cupy int64 arrays; host copies in pageable memory."""

    name = "cupy-device-check"
    tier = "device"

    @classmethod
    def handles(cls, meta: Any) -> bool:
        return False

    def validate(self, frame: Any, meta: Any, column: str, input_partition: int) -> None:
        pass

    def split(self, frame, column, rank, nranks, keep_index):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def slice(self, table: CupyTable, start: int, stop: int) -> CupyTable:
        return CupyTable(device=table.device[start:stop])

    def assemble(self, tables: Iterable[Any], nrows: int, meta: Any, keep_index: bool) -> Any:
        out = cupy.empty(nrows, dtype=cupy.int64)
        position = 0
        for table in tables:
            out[position : position + len(table)] = table.device
            position += len(table)
        return out

    def empty(self, meta: Any) -> Any:
        return cupy.empty(0, dtype=cupy.int64)

    def nbytes(self, table: CupyTable) -> int:
        return int((table.device if table.device is not None else table.host).nbytes)

    def nrows(self, table: CupyTable) -> int:
        return len(table)

    def to_host(self, table: CupyTable) -> CupyTable:
        return CupyTable(host=table.device.get())

    def to_device(self, table: CupyTable) -> CupyTable:
        return CupyTable(device=cupy.asarray(table.host))

    def serialize(self, table: CupyTable, *, device_frames: bool = False) -> tuple[dict, list]:
        return {}, [memoryview(np.ascontiguousarray(table.host)).cast("B")]

    def deserialize(self, header: dict[str, Any], frames: Sequence[Any]) -> CupyTable:
        # Like the cuDF backend: frames come back as a device table.
        return CupyTable(device=cupy.asarray(np.frombuffer(frames[0], dtype=np.int64)))


def bandwidth(nbytes: int) -> dict[str, float]:
    device = cupy.arange(nbytes // 8, dtype=cupy.int64)
    other = cupy.empty_like(device)
    host = empty_pinned(device.shape, dtype=np.int64)
    pageable = np.empty(device.shape, dtype=np.int64)
    result = {}
    for name, run in {
        "device_to_device": lambda: other.__setitem__(slice(None), device),
        "device_to_host_pinned": lambda: device.get(out=host),
        "host_pinned_to_device": lambda: other.set(host),
        "device_to_host_pageable": lambda: device.get(out=pageable),
        "host_pageable_to_device": lambda: other.set(pageable),
    }.items():
        run()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(5):
            run()
        cupy.cuda.Device().synchronize()
        result[name] = 5 * nbytes / (time.perf_counter() - start) / 1e9
    return result


async def _offload(func: Any, *args: Any) -> Any:
    return func(*args)


def store_check(total: int, nshards: int, directory: str) -> dict[str, Any]:
    register_backend(CupyBackend)
    backend = CupyBackend()
    per_shard = total // nshards
    rows = per_shard // 8
    npartitions = 8
    memory = WorkerMemory(
        device=TierUsage(limit=total // 4),
        host=TierUsage(limit=total // 4),
        disk=TierUsage(limit=None),
        disk_enabled=True,
    )
    store = ShardStore(backend, memory, directory, _offload, wait_timeout=0, describe="check")

    async def fill() -> None:
        per = rows // npartitions
        for i in range(nshards):
            values = cupy.arange(per * npartitions, dtype=cupy.int64) + i * rows
            shard = Shard(
                backend.name,
                i,
                np.arange(npartitions),
                np.arange(npartitions + 1) * per,
                CupyTable(device=values),
                int(values.nbytes),
            )
            await store.put(shard)

    start = time.perf_counter()
    asyncio.run(fill())
    cupy.cuda.Device().synchronize()
    fill_s = time.perf_counter() - start
    start = time.perf_counter()
    correct = True
    for p in range(npartitions):
        nrows, tables = store.read(p)
        out = backend.assemble(tables, nrows, None, False)
        per = rows // npartitions
        expected = cupy.concatenate(
            [cupy.arange(p * per, (p + 1) * per) + i * rows for i in range(nshards)]
        )
        correct &= bool((out == expected).all())
    cupy.cuda.Device().synchronize()
    read_s = time.perf_counter() - start
    store.close()
    stats = memory.snapshot()
    moved = {k: v for k, v in stats.items() if k.endswith("_bytes") and "_to_" in k}
    rates = {
        f"{k[:-6]}_gbps": moved[k] / stats[f"{k[:-6]}_seconds"] / 1e9
        for k in moved
        if moved[k] and stats[f"{k[:-6]}_seconds"]
    }
    return {"correct": correct, "fill_s": fill_s, "read_s": read_s, **moved, **rates}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512, help="data through the store")
    args = parser.parse_args()
    total = args.mib << 20
    props = cupy.cuda.runtime.getDeviceProperties(0)
    report = {
        "device": props["name"].decode(),
        "bandwidth_gbps": bandwidth(256 << 20),
        "store": store_check(total, 16, tempfile.mkdtemp(prefix="gpushuffle-device-check-")),
        "pandas": pd.__version__,
    }
    print(json.dumps(report, indent=2))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "device_check.json"), "w") as f:
            json.dump(report, f, indent=2)
    if not report["store"]["correct"]:
        raise SystemExit("device check: rows came back wrong")


if __name__ == "__main__":
    main()
