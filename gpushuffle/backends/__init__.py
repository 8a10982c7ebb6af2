"""Table backends: pandas, and cuDF (imported only when a cuDF frame shows up)."""

from __future__ import annotations

import importlib
from typing import Any

from gpushuffle.backends.base import TableBackend
from gpushuffle.backends.pandas import PandasBackend

_BACKENDS: dict[str, type[TableBackend]] = {PandasBackend.name: PandasBackend}
#: Backends whose module imports heavy libraries: name -> (module, class, the
#: top-level package of the frames it handles).
_LAZY: dict[str, tuple[str, str, str]] = {
    "cudf": ("gpushuffle.backends.cudf", "CudfBackend", "cudf"),
}


def register_backend(backend: type[TableBackend], *, first: bool = False) -> None:
    """Make ``backend`` available to :func:`backend_for` and the wire format.

    :func:`backend_for` asks backends in registration order; with ``first``
    this one is asked before the others.
    """
    _BACKENDS.pop(backend.name, None)
    if first:
        others = dict(_BACKENDS)
        _BACKENDS.clear()
        _BACKENDS[backend.name] = backend
        _BACKENDS.update(others)
    else:
        _BACKENDS[backend.name] = backend


def unregister_backend(name: str) -> None:
    """Forget the backend registered as ``name`` (a no-op if there is none)."""
    _BACKENDS.pop(name, None)


def _load(name: str) -> type[TableBackend]:
    module, cls, _ = _LAZY[name]
    backend: type[TableBackend] = getattr(importlib.import_module(module), cls)
    register_backend(backend)
    return backend


def backend_for(meta: Any) -> TableBackend:
    """The backend that handles frames shaped like ``meta``."""
    for backend in _BACKENDS.values():
        if backend.handles(meta):
            return backend()
    package = type(meta).__module__.split(".")[0]
    for name, (_, _, handles_package) in _LAZY.items():
        if package == handles_package and name not in _BACKENDS:
            backend = _load(name)
            if backend.handles(meta):
                return backend()
    raise TypeError(
        f"gpushuffle cannot shuffle {type(meta).__module__}.{type(meta).__name__} "
        f"partitions; supported: pandas and cudf DataFrames. "
        "Convert the collection first (for example with `to_backend('pandas')`)."
    )


def backend_named(name: str) -> TableBackend:
    """The backend registered as ``name`` (used when decoding wire headers)."""
    if name not in _BACKENDS and name in _LAZY:
        _load(name)
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"Unknown gpushuffle backend {name!r}; known: {sorted({*_BACKENDS, *_LAZY})}"
        ) from None


def available(name: str) -> bool:
    """Whether backend ``name`` can be loaded here (its libraries import)."""
    if name in _BACKENDS:
        return True
    try:
        _load(name)
    except Exception:  # ImportError, or a CUDA library failing to initialise
        return False
    return True


__all__ = [
    "TableBackend",
    "available",
    "backend_for",
    "backend_named",
    "register_backend",
    "unregister_backend",
]
