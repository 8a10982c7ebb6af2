"""Memory budgets for received shards: device and host tiers, per worker.

One :class:`WorkerMemory` per worker process is shared by every run on that
worker, so two concurrent shuffles together stay within the budget.  Each
run's :class:`~gpushuffle.engine.store.ShardStore` charges its bytes here and
moves data down a tier (device -> host -> disk) when a tier is over its
limit.  Statistics are kept per worker, cumulatively, for
:func:`gpushuffle.statistics`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

DEVICE = "device"
HOST = "host"
DISK = "disk"
TIERS = (DEVICE, HOST, DISK)


@dataclass
class TierUsage:
    """Bytes one tier holds now and at peak, against its limit (None: unbounded)."""

    limit: int | None
    bytes: int = 0
    peak: int = 0

    @property
    def over(self) -> int:
        """Bytes above the limit (0 when within it)."""
        return 0 if self.limit is None else max(0, self.bytes - self.limit)


@dataclass
class Movement:
    """Bytes moved between two tiers, and the seconds it took."""

    bytes: int = 0
    count: int = 0
    seconds: float = 0.0


@dataclass
class WorkerMemory:
    """The budgets of one worker, and what moved between its tiers."""

    device: TierUsage
    host: TierUsage
    disk: TierUsage
    disk_enabled: bool
    #: Whether the device budget was read; only runs of device backends ask,
    #: so CPU workers never touch a GPU (a CUDA context costs device memory).
    device_known: bool = False
    #: The device memory this worker may use (read with the device budget).
    device_share: int | None = None
    moves: dict[tuple[str, str], Movement] = field(default_factory=dict)
    runs_started: int = 0
    #: Groups of shards moved to disk because distributed paused the worker
    #: for its memory (``ShardStore.shed_host``), all runs.
    pause_sheds: int = 0
    #: Groups moved to disk as a run's first output was built, to make room
    #: for its largest output partition (:func:`gpushuffle.engine.budget.make_room`).
    output_sheds: int = 0
    #: Half-read received shards whose rest the store copied together to
    #: let them go (``ShardStore._compact_due_groups``), and the bytes of
    #: the pieces moved, all runs.
    compactions: int = 0
    compacted_bytes: int = 0
    #: Bytes of shards that arrived (or were split locally) and wait for the
    #: store to take them: not yet charged to any tier.
    waiting: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    #: The host limit is ``auto`` (:func:`auto_host_limit`), sized anew when a
    #: run starts on a worker where no other run holds host memory.
    auto_host: bool = False

    def start_run(self, host_sharers: int = 1) -> None:
        """A run starts: size an ``auto`` host limit from what the worker has
        free now and how many workers of the run share its machine
        (``host_sharers``, itself included).  While another run holds host
        memory the limit only comes down, so that a run with more workers on
        the machine keeps the machine's total."""
        with self._lock:
            if not self.auto_host:
                return
            limit = auto_host_limit(self.disk_enabled, host_sharers)
            if self.host.bytes == 0 or self.host.limit is None:
                self.host.limit = limit
            else:
                self.host.limit = min(self.host.limit, limit)

    def tier(self, name: str) -> TierUsage:
        return {DEVICE: self.device, HOST: self.host, DISK: self.disk}[name]

    def charge(self, name: str, nbytes: int) -> None:
        with self._lock:
            usage = self.tier(name)
            usage.bytes += nbytes
            usage.peak = max(usage.peak, usage.bytes)

    def release(self, name: str, nbytes: int) -> None:
        with self._lock:
            self.tier(name).bytes -= nbytes

    def wait(self, nbytes: int) -> None:
        """``nbytes`` more (or, negative, fewer) bytes wait for the store."""
        with self._lock:
            self.waiting += nbytes

    def shed(self, for_outputs: bool = False) -> None:
        """One group moved to disk because the worker was paused, or (``for_outputs``)
        to make room for an output partition."""
        with self._lock:
            if for_outputs:
                self.output_sheds += 1
            else:
                self.pause_sheds += 1

    def compacted(self, nbytes: int) -> None:
        """A half-read shard's rest, of ``nbytes``, copied together."""
        with self._lock:
            self.compactions += 1
            self.compacted_bytes += nbytes

    def moved(self, source: str, target: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            movement = self.moves.setdefault((source, target), Movement())
            movement.bytes += nbytes
            movement.count += 1
            movement.seconds += seconds

    def snapshot(self) -> dict[str, Any]:
        """A flat dict: one row of :func:`gpushuffle.statistics`."""
        with self._lock:
            row: dict[str, Any] = {}
            for name in TIERS:
                usage = self.tier(name)
                row[f"{name}_limit"] = usage.limit
                row[f"{name}_bytes"] = usage.bytes
                row[f"{name}_peak_bytes"] = usage.peak
            for source, target in ((DEVICE, HOST), (HOST, DISK), (DISK, HOST), (HOST, DEVICE)):
                movement = self.moves.get((source, target), Movement())
                row[f"{source}_to_{target}_bytes"] = movement.bytes
                row[f"{source}_to_{target}_seconds"] = movement.seconds
            row["spilled_bytes"] = row["device_to_host_bytes"] + row["host_to_disk_bytes"]
            row["runs"] = self.runs_started
            row["pause_sheds"] = self.pause_sheds
            row["output_sheds"] = self.output_sheds
            row["host_compactions"] = self.compactions
            row["host_compacted_bytes"] = self.compacted_bytes
            return row


_MEMORY: WorkerMemory | None = None
_MEMORY_LOCK = threading.Lock()


def worker_memory(device_sharers: int | None = None) -> WorkerMemory:
    """This process's budgets, read from ``gpushuffle.memory`` and ``gpushuffle.storage``.

    ``device_sharers`` (given by runs whose tables live on the device) is how
    many workers share this worker's GPU: the first such call reads the
    device budget, a fraction of the device's memory divided among them.
    """
    global _MEMORY
    with _MEMORY_LOCK:
        if _MEMORY is None:
            _MEMORY = _from_config()
        if device_sharers is not None and not _MEMORY.device_known:
            _MEMORY.device_share = _device_share(device_sharers)
            _MEMORY.device.limit = _device_limit(_MEMORY.device_share)
            _MEMORY.device_known = True
        return _MEMORY


def _device_share(sharers: int) -> int | None:
    """The device memory this worker may use: dask-cuda's device memory limit
    where the worker has one (else the device's memory), divided among the
    workers that share the GPU; None without a usable device."""
    from gpushuffle import config

    total = config.device_memory_total()
    if total is None:
        return None
    spill = config.device_spill_limit()
    base = min(total, spill) if spill else total
    return base // max(1, sharers)


def _device_limit(share: int | None) -> int | None:
    """``gpushuffle.memory.device-limit`` in bytes for this worker: a fraction
    of its device ``share``, or bytes as given."""
    from gpushuffle import config

    limit = config.get("memory.device-limit")
    if limit is None:
        return None
    if not (isinstance(limit, float) and 0 <= limit <= 1):
        return config.parse_budget(limit, None, "memory.device-limit")
    if share is None:
        return None  # no usable device: nothing is charged there
    return config.parse_budget(limit, share, "memory.device-limit")


def reset_worker_memory() -> None:
    """Forget budgets and statistics; the next use rereads the configuration."""
    global _MEMORY
    with _MEMORY_LOCK:
        _MEMORY = None


#: The most host memory an ``auto`` budget gives received shards, per worker:
#: with it a shuffle's peak stayed at or below ``p2p``'s in the benchmark
#: (``p2p`` peaked 0.5 to 1.1 GiB above its start there); the rest goes to disk.
AUTO_HOST_LIMIT_MAX = 256 << 20
#: ... and per machine, divided among the workers of a run that share it: at
#: 4 and 8 workers on one machine, 256 MiB each put the peak above ``p2p``'s
#: (1.11x and 1.02x at 12M rows), where 2 workers stayed below (0.90x).
AUTO_HOST_LIMIT_PER_MACHINE = 2 * AUTO_HOST_LIMIT_MAX


def auto_host_limit(disk_enabled: bool = True, sharers: int = 1) -> int:
    """The ``auto`` host budget: half of what this worker has free, at most
    256 MiB, and at most 512 MiB divided among the ``sharers`` (the run's
    workers on this machine).

    *Free* is what the process may still grow before distributed starts
    spilling the worker's own data (``distributed.worker.memory.spill``, or
    the pause or terminate threshold if spilling is off) times its memory
    limit, minus its RSS now.  Received shards beyond the budget go to disk;
    with disk off there is nowhere to go, so the caps do not apply (they
    would only turn a shuffle that fits into an error).
    """
    import dask.config
    import psutil

    from gpushuffle import config

    threshold = 1.0
    for key in ("spill", "pause", "terminate"):
        value = dask.config.get(f"distributed.worker.memory.{key}", default=False)
        if value:
            threshold = float(value)
            break
    rss = psutil.Process().memory_info().rss
    free = max(0, int(threshold * config.worker_memory_limit()) - rss)
    if not disk_enabled:
        return free // 2
    cap = min(AUTO_HOST_LIMIT_MAX, AUTO_HOST_LIMIT_PER_MACHINE // max(1, sharers))
    return min(cap, free // 2)


def _from_config() -> WorkerMemory:
    from gpushuffle import config

    host_total = config.worker_memory_limit()
    host_limit = config.get("memory.host-limit")
    auto = host_limit == "auto"
    disk_enabled = bool(config.get("storage.disk"))
    return WorkerMemory(
        # Read when a device backend's run first asks (worker_memory()).
        device=TierUsage(limit=None),
        host=TierUsage(
            limit=auto_host_limit(disk_enabled)
            if auto
            else config.parse_budget(host_limit, host_total, "memory.host-limit")
        ),
        disk=TierUsage(limit=None),
        disk_enabled=disk_enabled,
        auto_host=auto,
    )
