"""What some tests need of the installed pandas.

gpushuffle runs on pandas 2.2 and later (``pyproject.toml``); CI runs the
suite on the newest pandas and on RAPIDS 26.10's pin (3.0).  Two behaviours
of gpushuffle exist only from pandas 3 on, and the tests of them are skipped
on pandas 2, with the reason:

- rows a worker keeps stay in its persisted input partitions ("borrowed")
  only where pandas tracks which frames share a block (copy-on-write, the
  default from pandas 3 on); pandas 2 copies them into the store, as p2p does;
- pandas' default string dtype ``"str"`` is Arrow-backed from pandas 3 on; on
  pandas 2 it is numpy ``object``, and the tests of Arrow string columns
  built with it test nothing Arrow.
"""

from __future__ import annotations

import pandas as pd
import pytest

from gpushuffle.backends.pandas import BORROWS_FROM_INPUTS

PANDAS_3 = int(pd.__version__.split(".")[0]) >= 3

#: The test needs rows borrowed from persisted inputs.
borrows = pytest.mark.skipif(
    not BORROWS_FROM_INPUTS,
    reason="kept rows are borrowed from inputs with pandas 3's copy-on-write; pandas 2 copies them",
)

ARROW_STR_REASON = "pandas' default 'str' dtype is Arrow-backed from pandas 3 on"

#: The test needs pandas' default "str" dtype to be Arrow-backed.
arrow_str = pytest.mark.skipif(not PANDAS_3, reason=ARROW_STR_REASON)
