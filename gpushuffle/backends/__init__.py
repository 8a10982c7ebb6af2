"""Table backends: pandas, and cuDF (imported only when a cuDF frame shows up).

Importing this package registers them with the engine's registry
(:mod:`gpushuffle.engine.registry`), whose functions it re-exports.
"""

from __future__ import annotations

from gpushuffle.backends.pandas import PandasBackend
from gpushuffle.engine.registry import (
    available,
    backend_for,
    backend_named,
    register_backend,
    register_lazy_backend,
    unregister_backend,
)
from gpushuffle.engine.tables import TableBackend

register_backend(PandasBackend)
register_lazy_backend("cudf", "gpushuffle.backends.cudf", "CudfBackend", "cudf")

__all__ = [
    "TableBackend",
    "available",
    "backend_for",
    "backend_named",
    "register_backend",
    "unregister_backend",
]
