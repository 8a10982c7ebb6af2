"""What shuffles hold on a worker, by where it is: for the benchmark's timeline."""

from __future__ import annotations

from typing import Any

from gpushuffle.engine import memory as memory_module
from gpushuffle.engine import pool as pool_module


def memory_breakdown(worker: Any = None) -> dict[str, int]:
    """What shuffles hold on this process now, in bytes, by where it is.

    For the benchmark's timeline (sampled every 20 ms beside RSS), so it reads
    counters only, and creates neither budgets nor the pool:

    ``store_device``, ``store_host``, ``store_disk``
        received (and local) shards in the store, per tier, all runs;
    ``waiting``
        shards that arrived and wait for room in the store;
    ``pool_free``
        free blocks the host pool keeps for reuse;
    ``pool_split``, ``pool_unpack``, ``pool_read``, ``pool_other``
        pool blocks in use: split buffers (the local part of which is also
        counted in ``store_host``), output partitions being built or not yet
        released, pieces read back from disk;
    ``comm_out``
        shards in distributed's comm buffers, waiting to be sent (any
        P2P run, ``p2p``'s included);
    ``p2p_buffer``
        received shards in ``p2p``'s own disk buffers, not yet on disk;
    ``phase``
        0 no run, 1 transferring, 2 some run passed its barrier.
    """
    row = dict.fromkeys(
        (
            "store_device",
            "store_host",
            "store_disk",
            "waiting",
            "pool_free",
            "pool_split",
            "pool_unpack",
            "pool_read",
            "pool_other",
            "comm_out",
            "p2p_buffer",
            "phase",
        ),
        0,
    )
    memory = memory_module._MEMORY
    if memory is not None:
        row["store_device"] = memory.device.bytes
        row["store_host"] = memory.host.bytes
        row["store_disk"] = memory.disk.bytes
        row["waiting"] = memory.waiting
    host_pool = pool_module._POOL
    if host_pool is not None:
        for key, value in host_pool.usage().items():
            row[f"pool_{key}"] = value
    plugin = getattr(worker, "plugins", {}).get("shuffle") if worker is not None else None
    # distributed keeps a worker's runs in a private dict; list() copies it
    # under the GIL, so the event loop may change it meanwhile.
    runs = list(getattr(getattr(plugin, "shuffle_runs", None), "_active_runs", {}).values())
    for run in runs:
        row["comm_out"] += int(getattr(getattr(run, "_comm_buffer", None), "bytes_memory", 0))
        disk_buffer = getattr(run, "_disk_buffer", None)
        if type(disk_buffer).__name__ == "DiskShardsBuffer":
            row["p2p_buffer"] += int(getattr(disk_buffer, "bytes_memory", 0))
        row["phase"] = max(row["phase"], 2 if getattr(run, "transferred", False) else 1)
    return row
