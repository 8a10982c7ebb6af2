"""Table backends: pandas now, cuDF behind the same interface."""

from __future__ import annotations

from typing import Any

from gpushuffle.backends.base import TableBackend
from gpushuffle.backends.pandas import PandasBackend

_BACKENDS: dict[str, type[TableBackend]] = {PandasBackend.name: PandasBackend}


def register_backend(backend: type[TableBackend]) -> None:
    """Make ``backend`` available to :func:`backend_for` and the wire format."""
    _BACKENDS[backend.name] = backend


def backend_for(meta: Any) -> TableBackend:
    """The backend that handles frames shaped like ``meta``."""
    for backend in _BACKENDS.values():
        if backend.handles(meta):
            return backend()
    raise TypeError(
        f"gpushuffle cannot shuffle {type(meta).__module__}.{type(meta).__name__} "
        f"partitions; supported: {', '.join(_BACKENDS)} DataFrames. "
        "Convert the collection first (for example with `to_backend('pandas')`)."
    )


def backend_named(name: str) -> TableBackend:
    """The backend registered as ``name`` (used when decoding wire headers)."""
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"Unknown gpushuffle backend {name!r}; registered: {sorted(_BACKENDS)}"
        ) from None


__all__ = ["TableBackend", "backend_for", "backend_named", "register_backend"]
