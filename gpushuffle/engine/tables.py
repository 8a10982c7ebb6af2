"""The table-backend interface: what the engine needs from a kind of frame.

The engine never touches rows itself.  It asks a backend to reorder an input
partition so that the rows bound for each destination are contiguous, to cut
views out of that table, to carry a table over the wire and to rebuild output
partitions from ``meta``.  Nothing here assumes host memory: a backend's table
may live on a GPU, and its wire frames may be device buffers.  Backends
(``gpushuffle.backends``) implement this interface and register themselves
(:mod:`gpushuffle.engine.registry`); the engine knows them only through it.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, NoReturn

import numpy as np

from gpushuffle.engine.outputs import OutputSize

#: Besides the pieces, what building one output allocates for a moment
#: (index arrays, dtype casts, pandas' and pyarrow's temporaries).  On 1 GiB
#: workers a 0.65 GiB numeric partition peaked 34 MiB over the output with
#: pieces of 29 MiB.
ASSEMBLY_SLACK = 32 << 20

#: Key of a backend's serialized header: positions of frames that a receiver
#: reading them from another process's memory should put in memory of
#: their own rather than in a buffer shared with other frames
#: (:mod:`gpushuffle.samehost`), so that what is built on them alone can
#: outlive the rest of the shard.
OWN_FRAMES = "own-frames"


def refuse_pickle(table: Any) -> NoReturn:
    """``__reduce__`` of backend tables: they travel only through their backend."""
    raise TypeError(
        f"gpushuffle: a {type(table).__name__} reached plain pickle. Tables must be "
        "sent and spilled through their backend's serialize() (a Shard in a list "
        "given to gpushuffle.transport.wire_payload), never pickled: device tables would "
        "carry raw device addresses."
    )


class TableBackend(abc.ABC):
    """Split, carry and reassemble one kind of frame (pandas, cuDF, ...).

    A *table* is the backend's own container for a run of rows with the
    partition column removed: columns in ``meta``'s order, plus the index
    unless the shuffle ignores it.
    """

    #: Registry name; also written into wire headers.
    name: ClassVar[str]
    #: Where this backend's tables live: "host" or "device".  Received
    #: shards are charged to that tier of the store.
    tier: ClassVar[str] = "host"
    #: Whether :meth:`split_groups` takes ``borrow`` (rows left in their input).
    borrows: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def handles(cls, meta: Any) -> bool:
        """Whether this backend can shuffle frames shaped like ``meta``."""

    @abc.abstractmethod
    def validate(self, frame: Any, meta: Any, column: str, input_partition: int) -> None:
        """Raise a clear error if ``frame`` cannot be shuffled against ``meta``."""

    @abc.abstractmethod
    def split(
        self,
        frame: Any,
        column: str,
        rank: np.ndarray,
        nranks: int,
        keep_index: bool,
    ) -> tuple[Any, np.ndarray]:
        """Group the rows of ``frame`` by destination in one pass.

        Parameters
        ----------
        frame
            One input partition, including the partition-id ``column``.
        column
            Name of the integer column holding each row's output partition.
        rank
            ``rank[p]`` is the position of output partition ``p`` in the order
            the engine wants them laid out (grouped by destination worker).
            ``rank[p] == nranks`` marks partitions nobody asked for (``head()``
            computes only some outputs): their rows are dropped.
        nranks
            Number of wanted output partitions.
        keep_index
            Whether the index travels with the rows.

        Returns
        -------
        table, offsets
            ``table`` holds the kept rows, without ``column``, ordered by rank
            and, within a rank, in their input order (a stable reordering).
            ``offsets`` is a host ``int64`` array of ``nranks + 1`` row offsets:
            rows of rank ``r`` are ``table[offsets[r]:offsets[r + 1]]``.
        """

    def split_groups(
        self,
        frame: Any,
        column: str,
        rank: np.ndarray,
        nranks: int,
        keep_index: bool,
        groups: Sequence[tuple[int, int]],
        borrow: int | None = None,
        local: int | None = None,
    ) -> tuple[list[Any], np.ndarray]:
        """:meth:`split`, with each group of ranks in buffers of its own.

        ``groups`` are ``(first, last)`` rank ranges (one per destination
        worker); the result holds one table per group, the rows of ranks
        ``first`` to ``last - 1``, and :meth:`split`'s ``offsets``.  A table
        that shares no buffer with the others can be freed on its own: the
        shard sent to another worker releases its memory once sent, while
        the one kept locally lives on in the store.  This default slices one
        :meth:`split` table (views that keep all of it alive); backends
        override it where they can do better.

        ``borrow`` (given only to backends whose :attr:`borrows` is true) names
        the group that stays on this worker: the backend may
        return it as rows borrowed from ``frame`` instead of a copy, when
        the worker holds ``frame`` anyway (see :meth:`unshared_bytes`).
        ``local`` names that group whether or not it may be borrowed: the
        groups sent to other workers may share buffers (the pandas backend
        scatters them into one pooled block), the local one never does
        (without ``local``, every group is taken to be sent).
        """
        table, offsets = self.split(frame, column, rank, nranks, keep_index)
        tables = [self.slice(table, int(offsets[a]), int(offsets[b])) for a, b in groups]
        return tables, offsets

    @abc.abstractmethod
    def slice(self, table: Any, start: int, stop: int) -> Any:
        """Rows ``start:stop`` of ``table`` as a view, without copying."""

    @abc.abstractmethod
    def assemble(self, tables: Iterable[Any], nrows: int, meta: Any, keep_index: bool) -> Any:
        """Build one output frame from ``tables``, in the order given.

        ``tables`` may be a lazy iterator that brings each table up from a
        lower tier only when asked and releases it when asked for the next:
        an implementation should copy each table into the output and let go
        of it, so that an unpack holds the output plus about one table.
        ``nrows`` is the total row count.  The result has ``meta``'s columns,
        names and dtypes: columns whose dtype differs from ``meta``'s are cast
        without losing values.
        """

    def concat(self, tables: Sequence[Any], meta: Any, keep_index: bool) -> Any:
        """:meth:`assemble` for tables already in memory."""
        return self.assemble(tables, sum(self.nrows(t) for t in tables), meta, keep_index)

    def detached(self, table: Any) -> Any:
        """``table`` in buffers that hold nothing but its rows: what the engine
        holds back for a while (a small shard waiting for others to the same
        peer) must not keep other destinations' rows alive.  Identity here;
        backends whose split shares buffers between destinations copy."""
        return table

    def compacted(self, tables: Sequence[Any]) -> list[Any] | None:
        """``tables``, pieces of one received shard (views of its buffers), in
        memory of their own, together: what a store holds once half of the
        shard's rows were read, so that it can let go of the shard.  None:
        the backend keeps them as they are (the default)."""
        return None

    def to_host(self, table: Any) -> Any:
        """A copy of a device table in host memory (identity for host backends)."""
        return table

    def to_device(self, table: Any) -> Any:
        """Inverse of :meth:`to_host`."""
        return table

    @abc.abstractmethod
    def empty(self, meta: Any) -> Any:
        """An output partition that received no rows: ``meta`` itself."""

    @abc.abstractmethod
    def nbytes(self, table: Any) -> int:
        """Bytes the table's buffers occupy."""

    def concat_nbytes(self, table: Any) -> int:
        """Of :meth:`nbytes`, the bytes :meth:`assemble` concatenates once
        every piece is in, rather than copying them into the output in place:
        for a moment it holds them twice.  All of them unless the backend
        says otherwise."""
        return self.nbytes(table)

    #: Pieces of at least this many rows add :meth:`kept_nbytes` of their
    #: bytes to the output once, as they are added, instead of joining them
    #: at the end; 0: never.
    keep_rows: int = 0

    def kept_nbytes(self, table: Any) -> int:
        """Of :meth:`concat_nbytes`, the bytes a piece of at least
        :attr:`keep_rows` rows adds to the output once, as it is added."""
        return 0

    def assembly_overhead(self, size: OutputSize) -> int:
        """Memory building an output of ``size`` holds beyond the output
        itself, at its peak (engine/outputs.py budgets for it): the piece
        being copied, the concatenated columns' second copy, and
        :data:`ASSEMBLY_SLACK` for the interpreter's and library temporaries."""
        return size.largest_piece + size.concat_bytes + ASSEMBLY_SLACK

    def unshared_bytes(self, table: Any) -> int | None:
        """For a table of rows borrowed from an input partition: the bytes of
        that input which nothing but the table keeps alive now (0 while the
        worker holds the input).  ``None`` for a table that owns its buffers.
        """
        return None

    def materialize(self, table: Any) -> Any:
        """A table that owns its buffers: borrowed rows copied out of their input."""
        return table

    @abc.abstractmethod
    def nrows(self, table: Any) -> int:
        """Number of rows in the table."""

    @abc.abstractmethod
    def serialize(
        self, table: Any, *, device_frames: bool = False, memo: Any = None
    ) -> tuple[dict[str, Any], list[Any]]:
        """A header (msgpack-able) and frames for the wire or for disk.

        With ``device_frames`` (distributed's ``cuda`` serializer family, used
        by UCX) frames may be device buffers exposing
        ``__cuda_array_interface__``, which UCX sends device to device;
        otherwise every frame must be host memory.  With ``memo`` (from
        :meth:`new_memo`), for frames that only this process reads back (a
        spill file), the frames may refer to what the memo holds, and the
        header may hold the memo itself: it stays in memory.
        """

    def new_memo(self) -> Any:
        """What :meth:`serialize` may keep what many tables share in, once,
        for frames this process reads back (a store's spill files); None:
        nothing."""
        return None

    @abc.abstractmethod
    def deserialize(self, header: dict[str, Any], frames: Sequence[Any]) -> Any:
        """Inverse of :meth:`serialize`."""

    def merge(
        self,
        left: Any,
        right: Any,
        *,
        how: str,
        left_on: Any,
        right_on: Any,
        left_index: bool,
        right_index: bool,
        suffixes: tuple[str, str],
        indicator: bool,
        meta: Any,
    ) -> Any:
        """Join two assembled output partitions: one output partition of a join.

        Called by the hash join's unpack task with both sides' rows for one
        output partition (rows with equal keys are in the same partition on
        both sides).  ``how`` is one of dask's p2p join types (``inner``,
        ``left``, ``right``, ``outer``, ``leftsemi``); the other arguments
        are ``DataFrame.merge``'s; ``meta`` is dask's meta of the join, and
        the result must have its columns and dtypes.  The default is dask's
        own ``merge_chunk`` (the function ``p2p``'s and ``tasks``' joins call
        on each partition), which dispatches to the frame type's ``merge``.
        """
        from gpushuffle._distributed import merge_chunk

        return merge_chunk(
            left,
            right,
            how=how,
            left_on=left_on,
            right_on=right_on,
            left_index=left_index,
            right_index=right_index,
            suffixes=suffixes,
            indicator=indicator,
            result_meta=meta,
        )
