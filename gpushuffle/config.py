"""gpushuffle's configuration, the Dask way.

Defaults live in ``gpushuffle.yaml`` beside this file and are merged into
``dask.config`` on import, so they can be changed with ``dask.config.set``,
a YAML file in ``~/.config/dask/`` or ``DASK_GPUSHUFFLE__...`` environment
variables.  Workers read them where they run.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes

_DEFAULTS_FILE = os.path.join(os.path.dirname(__file__), "gpushuffle.yaml")

with open(_DEFAULTS_FILE) as f:
    defaults: dict[str, Any] = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def get(key: str) -> Any:
    """``dask.config.get("gpushuffle." + key)``."""
    return dask.config.get(f"gpushuffle.{key}")


def parse_budget(value: Any, total: int | None, key: str = "") -> int:
    """Bytes from ``"2 GiB"``, ``2_000_000`` or a fraction of ``total`` (``0.25``)."""
    where = f"gpushuffle.{key}" if key else "a memory budget"
    if isinstance(value, str):
        try:
            return int(parse_bytes(value))
        except ValueError:
            raise ValueError(
                f"{where}: cannot read {value!r} as bytes; use e.g. '2 GiB' or a fraction like 0.25"
            ) from None
    if isinstance(value, float) and 0 <= value <= 1:
        if total is None:
            raise ValueError(f"{where}: a fraction ({value}) needs a known total; give bytes")
        return int(value * total)
    if isinstance(value, int | float) and value >= 0 and not isinstance(value, bool):
        return int(value)
    raise ValueError(f"{where}: {value!r} is not a memory budget; use bytes ('2 GiB') or 0.25")


def worker_memory_limit() -> int:
    """The current worker's memory limit (the task's worker, else the one
    worker of this process), else the machine's memory."""
    import psutil

    limit = getattr(getattr(current_worker(), "memory_manager", None), "memory_limit", None)
    if limit:
        return int(limit)
    return int(psutil.virtual_memory().total)


def current_worker() -> Any | None:
    """The worker running this task, else the only worker of this process
    (on its event loop, where ``get_worker()`` has none), else None.

    Before 2026-12-07 memory limits read outside a task fell back to the
    machine's memory: the host pool, made on the event loop when a shard
    arrived before the worker's first task of the shuffle, kept up to 10% of
    the machine (2.4 GiB here, capped at 512 MiB) in free blocks on 1 GiB
    workers, and pooled a hot output's columns.
    """
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        pass
    from gpushuffle._distributed import only_worker_in_process

    return only_worker_in_process()


def device_memory_total() -> int | None:
    """Total memory of this process's CUDA device, or None without a usable one.

    Read through NVML (``distributed.diagnostics.nvml``), which opens no CUDA
    context; RMM is asked only where NVML cannot answer.
    """
    try:
        from distributed.diagnostics import nvml

        if nvml.device_get_count():
            total = nvml.one_time()["memory-total"]
            if total:
                return int(total)
    except Exception:
        pass
    try:
        import rmm

        _, total = rmm.mr.available_device_memory()
        return int(total)
    except Exception:
        return None


def device_spill_limit() -> int | None:
    """dask-cuda's device memory limit of the current worker, if it has one.

    dask-cuda moves task results off the device beyond this limit
    (``device_memory_limit``, 0.8 of the device by default): gpushuffle's
    device budget is a share of it rather than of the whole device.
    """
    worker = current_worker()
    if worker is None:
        return None
    return _device_buffer_limit(worker.data)


def _device_buffer_limit(data: Any) -> int | None:
    """The device limit of a worker's ``data``: dask-cuda 26.10's
    ``DeviceHostFile`` keeps it as the threshold of its ``device_buffer``, a
    ``zict.Buffer`` (``Buffer(device_func, device_host_func,
    device_memory_limit, ...)`` in dask_cuda/device_host_file.py), whose
    ``n`` it is; without a limit ``device_buffer`` is a plain dict."""
    buffer = getattr(data, "device_buffer", None)
    limit = getattr(buffer, "n", None)
    return int(limit) if isinstance(limit, int | float) and limit > 0 else None
