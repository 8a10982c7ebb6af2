"""The notebooks under docs/notebooks run top to bottom in a real Jupyter
kernel, on a live cluster, and their checks are live: a planted wrong result
stops them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.notebook

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "docs" / "notebooks"
WALKTHROUGH = NOTEBOOKS / "walkthrough.ipynb"


def _execute(nb, tmp_path):
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    start = time.perf_counter()
    client.execute()
    return time.perf_counter() - start


def test_notebooks_are_stored_without_outputs():
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert notebooks, "no notebooks under docs/notebooks"
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        stored = [
            i
            for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and (c.outputs or c.execution_count)
        ]
        assert not stored, (
            f"{path.name}: cells {stored} carry outputs; clear them before committing"
        )


def test_walkthrough_runs_top_to_bottom(tmp_path):
    nb = nbformat.read(WALKTHROUGH, as_version=4)
    seconds = _execute(nb, tmp_path)
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "the same partitions as tasks" in text and "equal to pandas' groupby" in text
    # It shows the comparison as HTML with its picture, inline.
    html = [
        o["data"]["text/html"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "execute_result" and "text/html" in o.get("data", {})
    ]
    assert any("x_gpushuffle" in h and "data:image/png" in h for h in html)
    # About 40 s on the 2-core VM; the limit leaves room for a crowded runner.
    assert seconds < 120, f"the walkthrough took {seconds:.0f} s"


def test_a_planted_wrong_result_stops_the_walkthrough(tmp_path):
    nb = nbformat.read(WALKTHROUGH, as_version=4)
    at = next(
        i for i, c in enumerate(nb.cells) if "shuffle" in c.get("metadata", {}).get("tags", [])
    )
    # Planted: a row lost per partition.
    planted = "by_id = by_id.map_partitions(lambda part: part.iloc[1:])"
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(planted))
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="rows lost or duplicated"):
        _execute(nb, tmp_path)
