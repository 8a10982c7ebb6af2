"""gpushuffle's configuration, the Dask way.

Defaults live in ``gpushuffle.yaml`` beside this file and are merged into
``dask.config`` on import, so they can be changed with ``dask.config.set``,
a YAML file in ``~/.config/dask/`` or ``DASK_GPUSHUFFLE__...`` environment
variables.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes

_DEFAULTS_FILE = os.path.join(os.path.dirname(__file__), "gpushuffle.yaml")

with open(_DEFAULTS_FILE) as f:
    defaults: dict[str, Any] = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def get(key: str) -> Any:
    """``dask.config.get("gpushuffle." + key)``."""
    return dask.config.get(f"gpushuffle.{key}")


def parse_budget(value: Any, total: int | None) -> int:
    """Bytes from ``"2 GiB"``, ``2_000_000`` or a fraction of ``total`` (``0.25``)."""
    if isinstance(value, str):
        return int(parse_bytes(value))
    if isinstance(value, float) and 0 <= value <= 1:
        if total is None:
            raise ValueError(f"A fractional budget ({value}) needs a total to take it from")
        return int(value * total)
    if isinstance(value, int | float) and value >= 0:
        return int(value)
    raise ValueError(f"Not a memory budget: {value!r}; use bytes ('2 GiB') or a fraction (0.25)")
