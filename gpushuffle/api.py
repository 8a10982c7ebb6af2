"""What users call: :func:`shuffle`, and ``shuffle_method="gpushuffle"``.

dask has no plug-in point for shuffle methods: dask-expr lowers every
abstract ``Shuffle`` through ``Shuffle._lower``, which knows only ``p2p``,
``disk``, ``simple`` and ``tasks`` and raises otherwise.  Importing
gpushuffle wraps that one method (:func:`install`): for the method name
``"gpushuffle"`` it returns :class:`GPUShuffle`, an expression that stays
visible to dask-expr's optimizer; every other name goes to dask's own code
unchanged.

Joins: dask-expr lowers ``merge`` through ``Merge._lower``, which knows
broadcast joins and hash joins only for its own method names.  :func:`install`
wraps that method too (:func:`_lower_merge_with_gpushuffle`): dask still
takes every decision (single-partition broadcast, broadcast join, index
alignment, skipping a side already partitioned on the key); a join that
shuffles both sides becomes :class:`GPUHashJoin`, and any other shuffle it
chose runs on gpushuffle.
"""

from __future__ import annotations

import functools
from typing import Any

from gpushuffle import config
from gpushuffle._distributed import (
    Alias,
    Assign,
    AssignPartitioningIndex,
    Blockwise,
    BlockwiseMerge,
    BroadcastJoin,
    FromGraph,
    Fused,
    HashJoinP2P,
    Merge,
    P2PBarrierTask,
    RearrangeByColumn,
    Shuffle,
    ShuffleId,
    SimpleShuffle,
    Task,
    TaskRef,
    _contains_index_name,
    _tokenize_deterministic,
    barrier_key,
    get_default_shuffle_method,
)
from gpushuffle.backends import backend_for
from gpushuffle.engine import links
from gpushuffle.engine.join import PARTITION_COLUMN, join_transfer, join_unpack
from gpushuffle.engine.partitioning import PartitioningIndex
from gpushuffle.engine.run import GPUShuffleSpec
from gpushuffle.engine.tasks import barrier as barrier_task
from gpushuffle.engine.tasks import transfer, unpack

METHOD = "gpushuffle"


class GPUShuffle(SimpleShuffle):
    """gpushuffle's lowering of an abstract ``Shuffle``: its transfer phase.

    The graph has distributed's P2P shape: one transfer task per input
    partition and one barrier task carrying the :class:`GPUShuffleSpec` (and
    so ``meta``, once).  The output partitions are :class:`GPUUnpack`'s, a
    blockwise expression on top of this one, so that where dask fuses, the
    blockwise steps after the shuffle run in the unpack tasks.  This
    expression's own keys ``(name, i)`` are never built: only
    :class:`GPUUnpack` depends on it, through the barrier's key.
    """

    @property
    def _funcname(self) -> str:
        return "gpushuffle"

    @functools.cached_property
    def _meta(self) -> Any:
        meta = self.frame._meta.drop(columns=self.partitioning_index)
        if self.ignore_index:
            meta = meta.reset_index(drop=True)
        return meta

    @property
    def token(self) -> str:
        return self._name.split("-")[-1]

    def _layer(self) -> dict:
        frame_meta = self.frame._meta
        backend_for(frame_meta)  # unsupported frame types fail here, not on workers
        links.configured_mode()  # and so does a bad setting
        if self.npartitions_out < 1:
            raise ValueError(f"npartitions must be at least 1, got {self.npartitions_out}")
        token = self.token
        shuffle_id = ShuffleId(token)
        parts_out = list(self._partitions)

        dsk: dict = {}
        transfers = []
        fuse_input = _own_partitioning(self.frame)
        aliases = _persisted_aliases(self.frame)
        for i in range(self.frame.npartitions):
            input_key = (self.frame._name, i)
            t = Task((f"gpushuffle-transfer-{token}", i), transfer, TaskRef(input_key), token, i)
            # The partitioning index computed inside the transfer task: one
            # task less per input partition, and no intermediate frame kept
            # in worker memory (and measured by sizeof) until the transfer
            # runs.  (The scheduler then never creates the index's own tasks:
            # no requested key depends on them.)
            node = Task.fuse(self.frame._task(input_key, i), t, key=t.key) if fuse_input else t
            node = _read_persisted(node, aliases)
            dsk[node.key] = node
            transfers.append(TaskRef(node.key))

        barrier = P2PBarrierTask(
            barrier_key(shuffle_id),
            barrier_task,
            token,
            *transfers,
            spec=GPUShuffleSpec(
                id=shuffle_id,
                disk=False,
                npartitions=self.npartitions_out,
                column=self.partitioning_index,
                meta=frame_meta,
                parts_out=tuple(parts_out) if self._filtered else self.npartitions_out,
                ignore_index=bool(self.ignore_index),
                borrow_inputs=_persisted_input(self.frame),
                partial_recovery=bool((self.options or {}).get(_RECOVERY_OPTION, False)),
            ),
        )
        dsk[barrier.key] = barrier
        return dsk

    def output_task(self, key: Any, part_out: int) -> Any:
        """The task that assembles output ``part_out`` on its worker."""
        return Task(key, unpack, self.token, part_out, TaskRef(barrier_key(ShuffleId(self.token))))


class _Outputs(Blockwise):
    """The output partitions of a shuffle or join expression (its one
    operand), one task each, built by the operand's ``output_task``.

    Blockwise, so that dask's blockwise fusion runs the steps that follow
    (``map_partitions``, a filter, a groupby's first aggregation, a write) in
    the same task: with many small partitions a task less per output
    partition, and no output kept in worker memory between the two.  dask
    fuses on ``persist``, ``to_delayed`` and ``optimize``; the ``compute`` of
    dask 2026.7.1 does no blockwise fusion, for any expression.  The
    operand is not a broadcast operand, so dask's ``Partitions`` reaches it
    (it is ``PartitionsFiltered``) and only the outputs asked for are
    computed.  Keys count the outputs computed (0, 1, ...), as dask-expr
    expects of a filtered expression.
    """

    _prefix: str

    @functools.cached_property
    def _name(self) -> str:
        return f"{self._prefix}-{self.deterministic_token}"

    @functools.cached_property
    def _meta(self) -> Any:
        return self.operands[0]._meta

    def _divisions(self) -> tuple:
        return self.operands[0].divisions

    def _broadcast_dep(self, dep: Any) -> bool:
        return False

    def _task(self, name: Any, index: int) -> Any:
        source = self.operands[0]
        return source.output_task(name, source._partitions[index])


class GPUUnpack(_Outputs):
    """The output partitions of a :class:`GPUShuffle`, one unpack task each."""

    _parameters = ["shuffle"]
    _prefix = "gpushuffle-unpack"


def _own_partitioning(frame: Any) -> bool:
    """Whether ``frame`` is the partitioning-index expression dask's lowering
    made for this shuffle alone (possibly fused with the blockwise steps
    before it), so that its tasks can run inside the transfer tasks.

    dask fuses a blockwise expression into its consumer only when that is
    its single dependent, and ``AssignPartitioningIndex`` is created by the
    shuffle's lowering: nothing else computes it, so nothing is computed
    twice.
    """
    if isinstance(frame, Fused):
        frame = frame.exprs[0]
    return isinstance(frame, AssignPartitioningIndex)


def _persisted_aliases(frame: Any) -> dict[Any, Any]:
    """The alias keys of the persisted frames in ``frame``'s expression, with
    the persisted keys they name.

    dask names a persisted collection's partitions anew (``FromGraph``) and
    maps each name to the persisted key with an ``Alias`` task.  Nothing
    fuses those: each is a task the scheduler runs, on every computation, as
    many as the transfer tasks that read them (with 1,000 small partitions, a
    fifth of a shuffle's tasks).
    """
    aliases: dict[Any, Any] = {}
    for expr in frame.walk():
        if isinstance(expr, FromGraph):
            for alias, key in zip(expr.__dask_keys__(), expr.operand("keys"), strict=True):
                if alias != key:
                    aliases[alias] = key
    return aliases


def _read_persisted(node: Any, aliases: dict[Any, Any]) -> Any:
    """``node`` with the aliases it reads (:func:`_persisted_aliases`) run in
    it: it depends on the persisted keys themselves."""
    reads = [Alias(key, aliases[key]) for key in node.dependencies if key in aliases]
    return Task.fuse(*reads, node, key=node.key) if reads else node


def partial_recovery() -> bool:
    """Whether ``gpushuffle.recovery`` asks for partial recovery (see
    :mod:`gpushuffle.engine.recovery`); a clear error for anything else."""
    value = str(config.get("recovery")).lower()
    if value not in ("partial", "restart"):
        raise ValueError(
            f"gpushuffle.recovery must be 'partial' or 'restart', got {value!r}: "
            "set it with dask.config.set({'gpushuffle.recovery': 'partial'})"
        )
    return value == "partial"


def _persisted_input(frame: Any) -> bool:
    """Whether the transfer tasks get persisted data, or columns added to it.

    Persisted partitions stay in worker memory for as long as the client
    holds them, which a running computation's graph does: rows kept on
    their own worker can stay in them.  Anything computed on the way (a
    filter, a projection) gives frames of their own, which are copied.
    Columns assigned to persisted data (the partition ids that ``set_index``
    and ``sort_values`` add) leave its other columns shared with it (pandas'
    copy-on-write): the store charges what only the assigned ones keep.
    """
    if isinstance(frame, Fused):  # the assignment fused with what computes its values
        frame = frame.exprs[0]
    while isinstance(frame, AssignPartitioningIndex | Assign):
        frame = frame.frame
    return isinstance(frame, FromGraph)


def takes_gpushuffle(method: str, meta: Any) -> bool:
    """Whether a shuffle with this method name and ``meta`` lowers to gpushuffle.

    ``"gpushuffle"`` always does; ``"p2p"`` does for cuDF-backed frames when
    ``gpushuffle.p2p-on-cudf`` is true, so RAPIDS code that asks for p2p gets
    the device path without edits.
    """
    if method == METHOD:
        return True
    return (
        method == "p2p"
        and bool(config.get("p2p-on-cudf"))
        and type(meta).__module__.split(".")[0] == "cudf"
    )


def _lower_with_gpushuffle(self: Shuffle, _dask_lower: Any) -> Any:
    method = self.method or get_default_shuffle_method()
    if not takes_gpushuffle(method, self.frame._meta):
        return _dask_lower(self)
    frame = self.frame
    if type(frame) is AssignPartitioningIndex:
        # The same ids, with less of pandas' overhead (engine.partitioning).
        frame = PartitioningIndex(*frame.operands)
    # Like p2p, no Repartition first when reducing the partition count: the
    # shuffle itself maps any number of inputs to any number of outputs.
    return GPUUnpack(
        GPUShuffle(
            frame,
            self.partitioning_index,
            self.npartitions_out,
            _drops_index(self),
            _with_client_settings(self.options),
            self.original_partitioning_index,
        )
    )


#: The key in a ``GPUShuffle``'s options under which the client's
#: ``gpushuffle.recovery`` travels (see :func:`_with_client_settings`).
_RECOVERY_OPTION = "gpushuffle.partial-recovery"


def _with_client_settings(options: Any) -> dict[str, Any]:
    """``options`` and the settings read where the collection is lowered.

    distributed's client lowers an expression, but its scheduler builds the
    graph (``__dask_graph__``, so ``_layer``) from it: a setting read there
    is the scheduler's, not what ``dask.config.set`` said around
    ``compute()`` on the client.  What the graph's spec needs from the
    client's configuration is read here and travels in the expression.
    """
    return {**(options or {}), _RECOVERY_OPTION: partial_recovery()}


def _drops_index(shuffle: Shuffle) -> bool:
    """Whether output partitions get a fresh index: ``ignore_index`` was asked
    for and the collection's meta agrees.

    dask's meta of a shuffle resets the index only for its ``tasks`` method;
    for the others (p2p, gpushuffle) it keeps the input's, and ``p2p`` keeps
    the index in the data too.  Outputs whose index contradicted their meta
    (a named datetime index in meta, a fresh RangeIndex in the data) would
    break what dask builds on that meta (``reset_index`` would add another
    column), so the index is kept unless a fresh one looks exactly like
    meta's, which saves sending it.
    """
    if not shuffle.ignore_index:
        return False
    meta = shuffle._meta.drop(columns=shuffle.partitioning_index, errors="ignore")
    fresh = meta.reset_index(drop=True).index
    index = meta.index
    return bool(
        type(index) is type(fresh)
        and index.dtype == fresh.dtype
        and list(index.names) == list(fresh.names)
    )


class GPUHashJoin(HashJoinP2P):
    """gpushuffle's hash join: both sides shuffled, merged in one task per output.

    The graph has the shape of dask's ``HashJoinP2P``: per side, one
    transfer task per input partition (dask's partition id computed there,
    then gpushuffle's transfer) and one barrier carrying that side's
    :class:`GPUShuffleSpec`; per output partition ``j``, one
    ``gpushuffle-join`` task that assembles ``j`` from both runs and merges
    them with the backend (:func:`gpushuffle.engine.join.join_unpack`).
    Parameters, ``_meta`` and divisions are ``HashJoinP2P``'s, so the result
    is the same collection dask's p2p join gives.
    """

    # Read where the join is lowered (the client): see _with_client_settings.
    _parameters = [*HashJoinP2P._parameters, "partial_recovery"]
    _defaults = {**HashJoinP2P._defaults, "partial_recovery": False}

    @property
    def _funcname(self) -> str:
        return "gpushuffle-hashjoin"

    def _inputs(self, side: str) -> tuple[Any, Any, bool]:
        """One side's frame, shuffle key and whether it joins on its index."""
        if side == "left":
            return self.left, self.shuffle_left_on, bool(self.left_index)
        return self.right, self.shuffle_right_on, bool(self.right_index)

    @functools.cached_property
    def tokens(self) -> dict[str, str]:
        """The ids of the two sides' shuffle runs, by side."""
        # self._name is part of the token: two joins never share a run.
        tokens = {}
        for side in ("left", "right"):
            frame, on, index_merge = self._inputs(side)
            tokens[side] = _tokenize_deterministic(self._name, frame._name, on, index_merge, side)
        return tokens

    def _side(self, dsk: dict, side: str, parts_out: list[int]) -> None:
        """Transfer tasks and barrier of one side."""
        frame, on, index_merge = self._inputs(side)
        token = self.tokens[side]
        backend_for(frame._meta)  # unsupported frame types fail here, not on workers
        transfers = []
        aliases = _persisted_aliases(frame)
        for i in range(frame.npartitions):
            t = Task(
                (f"gpushuffle-transfer-{token}", i),
                join_transfer,
                TaskRef((frame._name, i)),
                on,
                self._npartitions,
                token,
                i,
                index_merge,
            )
            t = _read_persisted(t, aliases)
            dsk[t.key] = t
            transfers.append(t.ref())
        meta = frame._meta.assign(**{PARTITION_COLUMN: 0})
        links.configured_mode()  # a bad setting fails here, not on workers
        barrier = P2PBarrierTask(
            barrier_key(ShuffleId(token)),
            barrier_task,
            token,
            *transfers,
            spec=GPUShuffleSpec(
                id=ShuffleId(token),
                disk=False,
                # All of the join's partitions (self.npartitions counts only
                # those computed when some are filtered out).
                npartitions=self._npartitions,
                column=PARTITION_COLUMN,
                meta=meta,
                parts_out=tuple(parts_out) if self._filtered else self._npartitions,
                # pandas gives a join on columns a fresh RangeIndex: then the
                # sides' indexes need not travel.
                ignore_index=not self._keeps_index,
                borrow_inputs=_persisted_input(frame),
                partial_recovery=bool(self.partial_recovery),
            ),
        )
        dsk[barrier.key] = barrier

    @functools.cached_property
    def _keeps_index(self) -> bool:
        return bool(
            self.left_index
            or self.right_index
            or _contains_index_name(self.left._meta, self.left_on)
            or _contains_index_name(self.right._meta, self.right_on)
        )

    def _layer(self) -> dict:
        dsk: dict = {}
        parts_out = list(self._partitions)
        self._side(dsk, "left", parts_out)
        self._side(dsk, "right", parts_out)
        return dsk

    def output_task(self, key: Any, part_out: int) -> Any:
        """The task that assembles output ``part_out`` from both runs and merges it."""
        left, right = self.tokens["left"], self.tokens["right"]
        return Task(
            key,
            join_unpack,
            left,
            right,
            part_out,
            TaskRef(barrier_key(ShuffleId(left))),
            TaskRef(barrier_key(ShuffleId(right))),
            self.how,
            self.left_on,
            self.right_on,
            self._meta,
            self.suffixes,
            self.left_index,
            self.right_index,
            self.indicator,
        )


class GPUJoin(_Outputs):
    """The output partitions of a :class:`GPUHashJoin`, one merge task each.
    (dask's HashJoinP2P keys them by partition number, and ``.partitions[2]``
    of a p2p join fails.)"""

    _parameters = ["join"]
    _prefix = "gpushuffle-join"


def _lower_merge_with_gpushuffle(self: Merge, _dask_lower: Any) -> Any:
    """Lower a ``Merge`` whose shuffles gpushuffle takes; others go to dask unchanged.

    dask takes the decisions: its ``Merge._lower`` runs with the method name
    ``"tasks"``, for which its rules are those of ``p2p`` (single-partition
    broadcast; broadcast join by the ``broadcast=`` argument or the
    partition-count bias; merges aligned on known divisions; no shuffle for
    a side already partitioned on the key).  Of what it returns, a blockwise
    merge of two sides it shuffled becomes :class:`GPUHashJoin`; any other
    shuffle it added (one side only, or the small side of a non-inner
    broadcast join) gets gpushuffle's method.
    """
    method = self.shuffle_method or get_default_shuffle_method()
    if not takes_gpushuffle(method, self.left._meta):
        return _dask_lower(self)
    lowered = _dask_lower(self.substitute_parameters({"shuffle_method": "tasks"}))
    if not isinstance(lowered, (BlockwiseMerge, BroadcastJoin)):
        return lowered
    left, right = lowered.left, lowered.right
    added_left = isinstance(left, RearrangeByColumn) and left._name != self.left._name
    added_right = isinstance(right, RearrangeByColumn) and right._name != self.right._name
    if isinstance(lowered, BlockwiseMerge) and added_left and added_right:
        return GPUJoin(
            GPUHashJoin(
                self.left,
                self.right,
                how=self.how,
                left_on=self.left_on,
                right_on=self.right_on,
                left_index=self.left_index,
                right_index=self.right_index,
                suffixes=self.suffixes,
                indicator=self.indicator,
                shuffle_left_on=left.partitioning_index,
                shuffle_right_on=right.partitioning_index,
                _npartitions=left.npartitions_out,
                partial_recovery=partial_recovery(),
            )
        )
    if added_left:
        left = left.substitute_parameters({"method": method})
    if added_right:
        right = right.substitute_parameters({"method": method})
    if added_left or added_right:
        return type(lowered)(left, right, *lowered.operands[2:])
    return lowered


def install() -> None:
    """Teach dask-expr the shuffle method name ``"gpushuffle"`` (idempotent).

    Wraps ``Shuffle._lower`` (shuffles, groupby ``split_out``, ``set_index``,
    ``sort_values``, ``drop_duplicates``) and ``Merge._lower`` (joins).
    """
    _wrap_lower(Shuffle, _lower_with_gpushuffle)
    _wrap_lower(Merge, _lower_merge_with_gpushuffle)


def _wrap_lower(cls: Any, lower_with_gpushuffle: Any) -> None:
    """Replace ``cls._lower`` by ``lower_with_gpushuffle(self, dask's _lower)``, once."""
    current = cls._lower
    if getattr(current, "_gpushuffle", False):
        return

    @functools.wraps(current)
    def _lower(self: Any) -> Any:
        return lower_with_gpushuffle(self, current)

    _lower._gpushuffle = True  # type: ignore[attr-defined]
    cls._lower = _lower


def shuffle(
    df: Any,
    on: str | list[str],
    npartitions: int | None = None,
    *,
    ignore_index: bool = False,
) -> Any:
    """Shuffle ``df`` so rows with equal ``on`` share an output partition.

    Rows land in the partition that dask's ``partitioning_index`` assigns, as
    with ``shuffle_method="tasks"`` or ``"p2p"``, so frames shuffled by either
    stay co-partitioned; within an output partition rows are grouped by
    input partition, in input order.

    Parameters
    ----------
    df
        A dask DataFrame (pandas- or cuDF-backed).
    on
        Column name(s) to hash, or the index name.
    npartitions
        Number of output partitions; defaults to ``df.npartitions``.
    ignore_index
        Drop the index instead of carrying it (less data to move).

    Returns
    -------
    dask.dataframe.DataFrame
    """
    if npartitions is not None and int(npartitions) < 1:
        raise ValueError(f"npartitions must be at least 1, got {npartitions}")
    return df.shuffle(on, npartitions=npartitions, ignore_index=ignore_index, shuffle_method=METHOD)


def _worker_statistics() -> dict[str, Any]:
    from gpushuffle import transport
    from gpushuffle.engine import copies, recovery
    from gpushuffle.engine.memory import worker_memory
    from gpushuffle.engine.pool import host_pool

    row = worker_memory().snapshot()
    for key, value in host_pool().statistics.as_dict().items():
        row[f"host_pool_{key}"] = value
    row.update(transport.statistics.as_dict())
    row.update(copies.statistics.as_dict())
    row.update(copies.busy.as_dict())
    row.update(copies.spent.as_dict())
    row.update(recovery.statistics.as_dict())
    return row


def _peer_traffic() -> dict[str, dict[str, float]]:
    from gpushuffle import transport

    return transport.peer_traffic.as_dict()


def peer_statistics(client: Any) -> Any:
    """What each worker sent to each peer, one row per (worker, peer): a
    pandas DataFrame, cumulative since the worker started.

    Columns: ``messages``, ``bytes``, ``seconds`` (from each send's start to
    the peer's answer, retries included: the peer stores what it received
    before it answers), ``failed`` (sends that ended without an answer) and
    ``mib_per_s`` (``bytes / seconds``).  A peer behind a slow link, or slow
    to store, has the low rates in its column: sort by ``mib_per_s``.
    """
    import pandas as pd

    rows = [
        {"worker": worker, "peer": peer, **values}
        for worker, peers in client.run(_peer_traffic).items()
        for peer, values in peers.items()
    ]
    columns = ["worker", "peer", "messages", "bytes", "seconds", "failed"]
    frame = pd.DataFrame(rows, columns=columns).set_index(["worker", "peer"])
    frame["mib_per_s"] = frame["bytes"] / 2**20 / frame["seconds"].where(frame["seconds"] > 0)
    return frame.sort_index()


def statistics(client: Any) -> Any:
    """Memory statistics of every worker, one row each (a pandas DataFrame).

    Columns, cumulative since the worker started unless noted: for each tier
    (``device``, ``host``, ``disk``) its ``_limit``, the ``_bytes`` received
    shards hold there now and the ``_peak_bytes``; bytes and seconds moved
    between tiers each way (``host_to_disk_bytes``, ``disk_to_host_seconds``,
    ...); ``spilled_bytes`` (device -> host plus host -> disk); ``runs``;
    ``pause_sheds`` (groups of shards moved to disk while distributed had the
    worker paused for its memory); ``output_sheds`` (groups moved to disk
    before a run's outputs were built, where the largest output partition
    and what the worker held would pass distributed's ``spill`` fraction of
    its memory limit); ``host_compactions`` and ``host_compacted_bytes``
    (received shards whose rest was copied together once half of it was
    read, so that the store shrinks as kept outputs grow); the
    host buffer pool's counters (``host_pool_...``); and what crossed the
    wire (``wire_shards_sent``, ``wire_shards_serialized``,
    ``wire_shards_deserialized``, their ``_bytes``, and ``wire_device_frames``,
    frames handed to UCX as device buffers); and the bytes each stage of
    gpushuffle's path copied (``copied_split_bytes``, ``copied_send_bytes``,
    ..., :mod:`gpushuffle.engine.copies`), the nanoseconds each stage was
    under way (``busy_split_ns``, ...) and spent in it, summed over its
    operations (``spent_split_ns``, ...); and what partial recovery did after
    workers were lost (``recovery_runs`` that adopted what a failed run left,
    ``recovery_bytes_kept`` and ``recovery_bytes_dropped`` by them,
    ``recovery_partitions_taken`` from lost workers, ``recovery_bytes_resent``,
    ``recovery_inputs_split`` and ``recovery_inputs_skipped``: a worker's
    own, gone with it if it is lost).  A worker that cannot answer (leaving)
    has no row.
    """
    import pandas as pd

    # A worker leaving as it is asked (killed, its Nanny restarting it) has
    # no row: its counters went with it.
    rows = {}
    for worker, row in client.run(_worker_statistics, on_error="return").items():
        if isinstance(row, BaseException) and not isinstance(row, OSError):
            raise row
        if not isinstance(row, OSError):  # CommClosedError is one
            rows[worker] = row
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("worker")
