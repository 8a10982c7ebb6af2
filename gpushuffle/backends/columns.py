"""Output columns allocated once, pieces copied in: a bounded unpack.

Concatenating every piece of an output partition at once holds the pieces
and the output together, about twice the output.  :func:`assemble_columns`
instead allocates each fixed-width output column once, at its final length,
copies each piece into it as the piece arrives and lets the piece go before
the next one is brought up.  Extra memory during an unpack is then the
output plus one piece, plus copies of the pieces of variable-width columns
(strings, lists, structs), which cannot be filled in place and are
concatenated at the end.

It works on any column type through a :class:`ColumnOps`; the cuDF backend
implements one with pylibcudf (``copy_range_in_place`` into columns from
``make_fixed_width_column``), the CI's stand-in device backend one with
numpy, which lets the bound be measured without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, Protocol, TypeVar

C = TypeVar("C")


class ColumnOps(Protocol[C]):
    """What :func:`assemble_columns` needs from a kind of column."""

    def size(self, column: C) -> int:
        """Rows in ``column``."""

    def null_count(self, column: C) -> int:
        """Nulls in ``column``."""

    def fits(self, column: C, out: C) -> bool:
        """Whether ``column`` can be copied into ``out`` in place (same fixed-width type)."""

    def fixed_width(self, column: C) -> bool:
        """Whether columns like ``column`` can be filled in place."""

    def allocate(self, like: C, nrows: int) -> C:
        """A column of ``like``'s type and ``nrows`` rows, all valid, contents undefined."""

    def copy_into(self, column: C, out: C, position: int) -> None:
        """Copy every row of ``column`` (values and validity) into ``out`` from ``position``."""

    def head(self, out: C, nrows: int) -> C:
        """The first ``nrows`` rows of ``out`` (a view)."""

    def copy(self, column: C) -> C:
        """A copy of ``column`` that shares no memory with it."""

    def concatenate(self, columns: Sequence[C]) -> C:
        """One column of all rows of ``columns``, in order."""

    def finish(self, out: C, nulls: int) -> C:
        """``out`` filled completely, holding ``nulls`` nulls."""


class _Builder(Generic[C]):
    """One output column: filled in place, or collected and concatenated."""

    def __init__(self, ops: ColumnOps[C], first: C, nrows: int) -> None:
        self.ops = ops
        self.out: C | None = ops.allocate(first, nrows) if ops.fixed_width(first) else None
        self.parts: list[C] = []
        self.position = 0
        self.nulls = 0

    def add(self, column: C) -> None:
        ops = self.ops
        if self.out is not None and not ops.fits(column, self.out):
            # A piece of another type (loose meta): give up filling in place
            # and let concatenate decide, as it would have without this.
            if self.position:
                self.parts.append(ops.head(self.out, self.position))
            self.out = None
        if self.out is not None:
            ops.copy_into(column, self.out, self.position)
        else:
            # A view would keep the whole piece (and the buffer it was
            # received in) alive until the end: copy this column alone.
            self.parts.append(ops.copy(column))
        self.position += ops.size(column)
        self.nulls += ops.null_count(column)

    def finish(self) -> C:
        if self.out is not None:
            return self.ops.finish(self.out, self.nulls)
        return self.parts[0] if len(self.parts) == 1 else self.ops.concatenate(self.parts)


def _add(builders: list[_Builder[C]], columns: Sequence[C]) -> None:
    for builder, column in zip(builders, columns, strict=True):
        builder.add(column)


def assemble_columns(
    pieces: Iterable[Sequence[C]], nrows: int, ops: ColumnOps[C]
) -> list[C] | None:
    """The columns of ``pieces`` concatenated, each output column built once.

    Parameters
    ----------
    pieces
        Each piece's columns, in output order; may be a lazy iterator that
        brings a piece up only when asked and releases it when asked for the
        next.  Every piece has the same number of columns; empty pieces may
        be left out.
    nrows
        Total rows of all pieces.
    ops
        Column operations of the backend.

    Returns
    -------
    list or None
        The output columns, or None if ``pieces`` was empty.
    """
    builders: list[_Builder[C]] | None = None
    for columns in pieces:
        if builders is None:
            builders = [_Builder(ops, column, nrows) for column in columns]
        _add(builders, columns)
        # Drop this piece before the iterator brings up the next one.
        del columns
    if builders is None:
        return None
    if builders and builders[0].position != nrows:
        raise ValueError(f"pieces hold {builders[0].position} rows, expected {nrows}")
    return [builder.finish() for builder in builders]
