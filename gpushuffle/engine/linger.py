"""Small shards held back per peer until a message's worth is ready for it.

distributed's comm buffer sends whatever it holds at once, so with many
small input partitions every transfer would cost a message (an RPC on both
sides) for a few rows.  A run (:mod:`gpushuffle.engine.run`) keeps a
:class:`HeldBack` and sends a peer's shards when they add up to
``per_peer`` bytes, the peers with the most when all of them together pass
``limit``, and everything once every input is in.  This module keeps the
account; the run does the sending.
"""

from __future__ import annotations

from gpushuffle.transport import Shard

#: Remote shards under ``message-bytes-limit / LINGER_FRACTION`` (1 MiB by
#: default) are held back until that much is ready for their worker.
LINGER_FRACTION = 16
#: ... but no more than ``LINGER_MESSAGES`` messages' worth (64 MiB by
#: default) in all: a worker with 1,000 peers would otherwise hold up to
#: 1,000 x 1 MiB of them.  Past that, the peers with the most go first.
LINGER_MESSAGES = 4


class HeldBack:
    """Shards waiting per peer, with how much each peer and all of them hold."""

    def __init__(self, message_bytes: int, on_device: bool) -> None:
        # Host shards only: a pandas split gives each destination buffers of
        # its own (or the shard waits as a copy, TableBackend.detached, where
        # a scatter shared them), while a cuDF shard is a view of the whole
        # reordered input partition, which a waiting shard would keep on the
        # device.
        self.per_peer = 0 if on_device else max(1, message_bytes // LINGER_FRACTION)
        self.limit = int(LINGER_MESSAGES * message_bytes)
        self._shards: dict[str, list[Shard]] = {}
        self._bytes: dict[str, int] = {}
        self.total = 0
        #: Most bytes held at once (all peers together), how often the limit
        #: sent peers' shards early, and how many shards waited as copies.
        self.peak = 0
        self.sheds = 0
        self.detached = 0

    def waits(self, address: str, shard: Shard) -> bool:
        """Whether ``shard`` waits: it is small, or shards for its peer
        already wait (it must not overtake them)."""
        return shard.nbytes < self.per_peer or bool(self._shards.get(address))

    def add(self, address: str, shard: Shard) -> None:
        self._shards.setdefault(address, []).append(shard)
        self._bytes[address] = self._bytes.get(address, 0) + shard.nbytes
        self.total += shard.nbytes
        self.peak = max(self.peak, self.total)

    def ready(self, address: str) -> bool:
        """Whether ``address``'s shards add up to a message's worth."""
        return self._bytes.get(address, 0) >= self.per_peer

    def excess(self) -> int:
        """Bytes to send now, from the peers with the most, to bring the
        total back to half the limit (0 while within the limit)."""
        return self.total - self.limit // 2 if self.total > self.limit else 0

    def take(self, address: str) -> list[Shard]:
        """``address``'s shards, in the order they came; none are held after."""
        self.total -= self._bytes.pop(address, 0)
        return self._shards.pop(address, [])

    def held(self, address: str) -> int:
        return self._bytes.get(address, 0)

    def most_first(self) -> list[str]:
        """Peers by bytes held, most first."""
        return sorted(self._bytes, key=self._bytes.__getitem__)[::-1]

    def peers(self) -> list[str]:
        return list(self._shards)

    def sizes(self) -> dict[str, int]:
        return dict(self._bytes)

    def clear(self) -> None:
        self._shards.clear()
        self._bytes.clear()
        self.total = 0
