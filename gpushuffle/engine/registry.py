"""Which backend handles which frames: the engine asks here, by meta or by name.

Backends register themselves (``gpushuffle.backends`` registers pandas, and
cuDF lazily: its module imports heavy libraries and is loaded only when a
cuDF frame shows up), so the engine depends on the interface
(:mod:`gpushuffle.engine.tables`), never on a backend's module.
"""

from __future__ import annotations

import importlib
from typing import Any

from gpushuffle.engine.tables import TableBackend

_BACKENDS: dict[str, type[TableBackend]] = {}
#: Backends whose module imports heavy libraries: name -> (module, class, the
#: top-level package of the frames it handles).
_LAZY: dict[str, tuple[str, str, str]] = {}


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


def register_lazy_backend(name: str, module: str, cls: str, package: str) -> None:
    """Register backend ``name``, class ``cls`` of ``module``, imported only when
    a frame of top-level package ``package`` (or a wire header naming it)
    shows up."""
    _LAZY[name] = (module, cls, package)


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
