"""A pool of reusable host buffers.

Fresh host memory is expensive: a worker started by a Nanny returns freed
memory to the OS (``MALLOC_TRIM_THRESHOLD_``), so every large allocation is
faulted in again, page by page, and on a fragmented machine that costs far
more than the copy that fills it.  Splits and unpacks allocate their column
buffers here instead.  A buffer returns to the pool when the last array
viewing it is garbage collected, wherever that happens (after a shard was
sent, after an output partition was consumed), and is handed out again to
the next request of a similar size.

Free buffers are bounded (``gpushuffle.memory.host-pool.limit``) and given
back to the OS after ``gpushuffle.memory.host-pool.idle-release`` unused.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Smaller requests are left to the allocator: they are cheap and many.
MIN_POOLED_BYTES = 1 << 20
#: A free buffer serves requests down to 1 / SLACK of its size.
SLACK = 1.25
_ALIGN = 1 << 16

#: What a buffer is for; :meth:`HostBufferPool.usage` reports bytes in use by tag.
TAGS = ("split", "unpack", "read", "other")


@dataclass
class PoolStatistics:
    requests: int = 0
    reused: int = 0
    bytes_reused: int = 0
    bytes_fresh: int = 0
    bytes_released: int = 0
    bytes_free: int = 0
    bytes_free_peak: int = 0
    bytes_in_use: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class HostBufferPool:
    """Hands out 1-d numpy arrays backed by reusable blocks.

    Parameters
    ----------
    limit
        Most bytes of free blocks kept; 0 disables pooling.
    idle_release
        Seconds a free block may stay unused before it is released.
    """

    def __init__(self, limit: int, idle_release: float) -> None:
        self.limit = int(limit)
        self.idle_release = float(idle_release)
        self._lock = threading.Lock()
        # Free blocks sorted by size, with the time each was returned.
        self._sizes: list[int] = []
        self._blocks: list[tuple[np.ndarray, float]] = []
        # Finalizers may run in any thread, even inside a pool call of the
        # same thread (a garbage collection): they only append here.
        self._returned: deque[tuple[np.ndarray, str]] = deque()
        self._in_use = dict.fromkeys(TAGS, 0)
        self.statistics = PoolStatistics()
        self._trimmer: threading.Thread | None = None

    def empty(self, n: int, dtype: Any, tag: str = "other") -> np.ndarray:
        """An uninitialized array of ``n`` items of ``dtype``.

        ``tag`` says what the buffer is for (one of :data:`TAGS`), for
        :meth:`usage`.
        """
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        if self.limit <= 0 or nbytes < MIN_POOLED_BYTES or dtype.hasobject:
            return np.empty(n, dtype=dtype)
        stats = self.statistics
        with self._lock:
            self._absorb_returned()
            stats.requests += 1
            block = self._take(nbytes)
            if block is not None:
                stats.reused += 1
                stats.bytes_reused += block.nbytes
        if block is None:
            block = np.empty(-(-nbytes // _ALIGN) * _ALIGN, dtype=np.uint8)
            with self._lock:
                stats.bytes_fresh += block.nbytes
        with self._lock:
            self._in_use[tag] += block.nbytes
            stats.bytes_in_use += block.nbytes
        # Views of ``block`` itself would collapse their base onto it, so
        # lifetime is tracked on a ctypes owner that every view keeps alive.
        owner = (ctypes.c_char * block.nbytes).from_buffer(block)  # type: ignore[arg-type]
        weakref.finalize(owner, self._returned.append, (block, tag))
        self._ensure_trimmer()
        return np.frombuffer(owner, dtype=dtype, count=n)  # type: ignore[call-overload]

    def _take(self, nbytes: int) -> np.ndarray | None:
        i = bisect.bisect_left(self._sizes, nbytes)
        if i == len(self._sizes) or self._sizes[i] > nbytes * SLACK:
            return None
        del self._sizes[i]
        block, _ = self._blocks.pop(i)
        self.statistics.bytes_free -= block.nbytes
        return block

    def _absorb_returned(self) -> None:
        now = time.monotonic()
        stats = self.statistics
        while self._returned:
            block, tag = self._returned.popleft()
            self._in_use[tag] -= block.nbytes
            stats.bytes_in_use -= block.nbytes
            if stats.bytes_free + block.nbytes > self.limit:
                stats.bytes_released += block.nbytes
                continue
            i = bisect.bisect_left(self._sizes, block.nbytes)
            self._sizes.insert(i, block.nbytes)
            self._blocks.insert(i, (block, now))
            stats.bytes_free += block.nbytes
            stats.bytes_free_peak = max(stats.bytes_free_peak, stats.bytes_free)

    def release_idle(self, older_than: float | None = None) -> int:
        """Release free blocks unused for ``older_than`` seconds (all if 0)."""
        older_than = self.idle_release if older_than is None else older_than
        with self._lock:
            self._absorb_returned()
            cutoff = time.monotonic() - older_than
            keep = [
                (s, b)
                for s, b in zip(self._sizes, self._blocks, strict=True)
                if older_than > 0 and b[1] > cutoff
            ]
            released = self.statistics.bytes_free - sum(s for s, _ in keep)
            self._sizes = [s for s, _ in keep]
            self._blocks = [b for _, b in keep]
            self.statistics.bytes_free -= released
            self.statistics.bytes_released += released
        return released

    def usage(self) -> dict[str, int]:
        """Bytes of free blocks (``free``) and of blocks in use, by tag."""
        with self._lock:
            self._absorb_returned()
            return {"free": self.statistics.bytes_free, **self._in_use}

    def _ensure_trimmer(self) -> None:
        if self._trimmer is not None or self.idle_release <= 0:
            return
        with self._lock:
            if self._trimmer is not None:
                return
            self._trimmer = threading.Thread(
                target=self._trim_forever, daemon=True, name="gpushuffle-host-pool-trimmer"
            )
            self._trimmer.start()

    def _trim_forever(self) -> None:
        while True:
            time.sleep(max(self.idle_release / 4, 0.05))
            self.release_idle()


_POOL: HostBufferPool | None = None
_POOL_LOCK = threading.Lock()


def host_pool() -> HostBufferPool:
    """This process's pool, sized from ``gpushuffle.memory.host-pool``."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = _make_pool()
    return _POOL


def _make_pool() -> HostBufferPool:
    from dask.utils import parse_timedelta

    from gpushuffle import config

    total = config.worker_memory_limit()
    limit = config.parse_budget(
        config.get("memory.host-pool.limit"), total, "memory.host-pool.limit"
    )
    # Free buffers are memory too: never keep more than the store may hold.
    limit = min(
        limit, config.parse_budget(config.get("memory.host-limit"), total, "memory.host-limit")
    )
    idle = parse_timedelta(config.get("memory.host-pool.idle-release"), default="s")
    return HostBufferPool(limit=limit, idle_release=idle or 0)
