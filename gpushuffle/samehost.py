"""Shards between workers on one machine: the receiver reads the sender's memory.

Workers on one machine (a ``LocalCluster``, several workers per node) send
each other shards over TCP through the loopback device: the sender's kernel
copies every byte into socket buffers, the receiver's copies it out, and
both event loops spend their time in ``send`` and ``recv``.  With Linux's
cross-memory attach (``process_vm_readv(2)``, what UCX's ``cma`` transport
uses for host memory) the sender *lends* a shard's large buffers instead: the
message carries where they are in the sender's memory, and the receiver
copies them, once, straight into buffers of its own.  The sender keeps the
buffers alive and unchanged until the receiver has answered, which it does
anyway (a send returns once the receiver has stored the shards); a send that
ends any other way leaves them alive until the run closes.

The receiver checks that the message comes from a process it can read: the
same kernel (``/proc/sys/kernel/random/boot_id``) and, under the sender's
process id, a process started when the sender says it was (before and after
the read, so that a process id reused by another process is never read).
Where the kernel refuses (another user, a container's seccomp profile,
another PID namespace), the receiver answers so and the sender sends that
message, and every later one to that worker, as bytes.  Where Yama's
``ptrace_scope`` is above 0 (Ubuntu's default is 1: a process may read only
its descendants, and workers are siblings) nothing is lent at all.
``gpushuffle.comm.same-host-reads: false`` turns lending off.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

#: Frames smaller than this travel in the message: lending them would cost
#: more in bookkeeping than the copies it saves.
LEND_MIN_BYTES = 64 << 10

#: Lent frames start this far apart in the receiver's buffer (cache lines).
_ALIGN = 64

#: iovecs per process_vm_readv call (IOV_MAX on Linux).
_IOV_MAX = 1024


class LendRefused(Exception):
    """The receiver cannot read the sender's memory; send the bytes instead."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _process_vm_readv() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return function


_readv = _process_vm_readv()

_lock = threading.Lock()
_identity: dict[str, Any] | None = None
#: Peers (addresses) that could not read this process's memory, and why.
_refused: dict[str, str] = {}


def _start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks after boot), from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # Field 22; the command name (field 2) may hold spaces and parentheses.
    return int(stat.rsplit(b")", 1)[1].split()[19])


def identity() -> dict[str, Any] | None:
    """Who this process is, for a receiver to check; None where lending is impossible."""
    global _identity
    pid = os.getpid()
    if _identity is not None and _identity["pid"] == pid:
        return _identity
    if _readv is None or _ptrace_restricted():
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        me = {"boot": boot, "pid": pid, "start": _start_time(pid)}
    except (OSError, ValueError, IndexError):
        return None
    _identity = me
    return me


def _ptrace_restricted(path: str = "/proc/sys/kernel/yama/ptrace_scope") -> bool:
    """Whether Yama lets a process read only its descendants (or none): sibling
    workers could not read each other (Ubuntu's default is 1)."""
    try:
        with open(path) as f:
            return int(f.read().strip()) > 0
    except (OSError, ValueError):
        return False  # no Yama: the classic rule, same user


def may_lend_to(address: str) -> bool:
    """Whether shards for ``address`` are lent (it has not refused)."""
    return address not in _refused and identity() is not None


def refused(address: str, reason: str) -> bool:
    """Record that ``address`` cannot read this process; True the first time."""
    with _lock:
        first = address not in _refused
        _refused[address] = reason
    return first


def lend(
    frames: Sequence[Any], own: Iterable[int] = ()
) -> tuple[list[list[int]], list[Any], list[Any]]:
    """Split ``frames`` into lent ones and those sent in the message.

    Returns the lent frames' ``[position, address, nbytes, own]``, the frames
    the message carries, and the objects to keep alive until the receiver
    answers.  ``own``: positions of frames the receiver reads into memory of
    their own (:data:`~gpushuffle.backends.base.OWN_FRAMES`).
    """
    own = frozenset(own)
    lent: list[list[int]] = []
    carried: list[Any] = []
    kept: list[Any] = []
    for position, frame in enumerate(frames):
        view = _host_view(frame)
        if view is None or view.nbytes < LEND_MIN_BYTES:
            carried.append(frame)
            continue
        array = np.frombuffer(view, dtype=np.uint8)
        lent.append([position, int(array.ctypes.data), int(view.nbytes), int(position in own)])
        kept.append(frame)
    return lent, carried, kept


def _host_view(frame: Any) -> memoryview | None:
    if hasattr(frame, "__cuda_array_interface__"):
        return None
    try:
        view = memoryview(frame)
    except TypeError:
        return None
    if not view.c_contiguous:
        return None
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def read(
    lender: dict[str, Any],
    carried: Sequence[Any],
    allocate: Callable[[int], np.ndarray] | None = None,
) -> list[Any]:
    """The frames of a message whose large frames ``lender`` lent.

    ``lender`` is what :func:`identity` and :func:`lend` gave the sender:
    its identity and the lent frames' positions, addresses and sizes.  The
    lent frames are read into one buffer from ``allocate`` (bytes -> uint8
    array; ``numpy.empty`` by default), each at a multiple of 64 bytes, but
    those marked ``own``, which get a ``numpy.empty`` each.  Raises
    :class:`LendRefused` when they cannot be read from here.
    """
    me = identity()
    if me is None:
        raise LendRefused("this process cannot read other processes' memory")
    if lender["boot"] != me["boot"]:
        raise LendRefused("the sender runs under another kernel (another machine)")
    pid = int(lender["pid"])
    _check_alive(pid, lender["start"])
    lent = lender["frames"]
    starts, total = [], 0
    for _, _, nbytes, own in lent:
        starts.append(total)
        if not own:
            total += -(-nbytes // _ALIGN) * _ALIGN
    block = (allocate or _empty)(total + _ALIGN)
    block = block[-block.ctypes.data % _ALIGN :][:total]
    buffers = [
        _empty(nbytes) if own else block[start : start + nbytes]
        for start, (_, _, nbytes, own) in zip(starts, lent, strict=True)
    ]
    for first in range(0, len(lent), _IOV_MAX):
        batch = range(first, min(first + _IOV_MAX, len(lent)))
        local = (_Iovec * len(batch))()
        remote = (_Iovec * len(batch))()
        expected = 0
        for k, i in enumerate(batch):
            _, address, nbytes, _ = lent[i]
            local[k] = _Iovec(buffers[i].ctypes.data, nbytes)
            remote[k] = _Iovec(address, nbytes)
            expected += nbytes
        got = _readv(pid, local, len(batch), remote, len(batch), 0)
        if got != expected:
            error = ctypes.get_errno()
            reason = os.strerror(error) if got < 0 else f"read {got} of {expected} bytes"
            raise LendRefused(f"process_vm_readv from process {pid}: {reason}")
    # A process id reused during the read would show another start time.
    _check_alive(pid, lender["start"])
    frames: list[Any] = list(carried)
    for (position, *_), buffer in zip(lent, buffers, strict=True):
        frames.insert(position, buffer)
    return frames


def _empty(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _check_alive(pid: int, start: int) -> None:
    try:
        now = _start_time(pid)
    except (OSError, ValueError, IndexError):
        raise LendRefused(f"no process {pid} visible here (another PID namespace?)") from None
    if now != start:
        raise LendRefused(f"process {pid} is not the sender (another PID namespace?)")
