"""Calls the GPU type check must reject (ci/typecheck_gpu.sh checks that it does).

Not part of the package: each line below is a defect the cuDF path once had
(issue 34), which failed at first contact with a GPU.  If the type check
accepts this file, it would accept the defect again.
"""

from __future__ import annotations

import cupy
import numpy as np
import pylibcudf as plc


def offsets_of(sorted_keys: plc.Table, needles: plc.Table) -> np.ndarray:
    bounds = plc.search.lower_bound(
        sorted_keys, needles, [plc.types.Order.ASCENDING], [plc.types.NullOrder.AFTER]
    )
    # A pylibcudf Column has no __cuda_array_interface__: cupy cannot take it.
    return cupy.asnumpy(cupy.asarray(bounds))
