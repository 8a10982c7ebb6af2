"""Reading gpushuffle's task graph on the scheduler: which output partition a task builds."""

from __future__ import annotations

from typing import Any

from gpushuffle._distributed import Task, execute_subgraph
from gpushuffle.engine.join import join_unpack
from gpushuffle.engine.tasks import unpack


def output_partition_of(node: Any) -> int | None:
    """The output partition a task of gpushuffle's graph computes, read from
    its run spec on the scheduler (an unpack or join task, alone or fused
    with the steps after it); None for any other task."""
    if not isinstance(node, Task):
        return None
    if node.func is execute_subgraph:
        # dask fused the unpack with the blockwise steps after it.
        inner = {output_partition_of(t) for t in node.args[0].values()} - {None}
        return inner.pop() if len(inner) == 1 else None
    position = 1 if node.func is unpack else 2 if node.func is join_unpack else None
    if position is None or len(node.args) <= position:
        return None
    partition = node.args[position]
    return partition if isinstance(partition, int) else None
