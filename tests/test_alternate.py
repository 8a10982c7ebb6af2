"""benchmarks/alternate.py: versions of gpushuffle timed in alternation, for real
(each round a `gpushuffle bench` of a few thousand rows on a local cluster)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

REPOSITORY = Path(__file__).resolve().parent.parent
TINY = ["--rows", "20000", "--columns", "4", "--partitions", "4"]


def _alternate(*args: str) -> subprocess.CompletedProcess:
    # From the repository: `-m benchmarks.alternate`, and `.` is the checkout.
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.alternate", *args],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
    )


def _worktrees() -> str:
    return subprocess.run(
        ["git", "-C", str(REPOSITORY), "worktree", "list"], capture_output=True, text=True
    ).stdout


def test_variants_alternate_and_a_revision_is_checked_out_then_removed(tmp_path):
    if subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "HEAD"]).returncode:
        pytest.skip("not a git checkout: no revision to check out")
    # A copy of the package in a directory of its own: each variant must be
    # imported from where it says (the checkout is installed editable).
    copy = tmp_path / "copy"
    shutil.copytree(
        REPOSITORY / "gpushuffle",
        copy / "gpushuffle",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    before = _worktrees()
    out = tmp_path / "summary.json"
    done = _alternate(
        "-v",
        f"here={REPOSITORY}",
        "-v",
        f"copy={copy}",
        "-v",
        "head=HEAD",
        "--rounds",
        "2",
        "--repeat",
        "1",
        "--json",
        str(out),
        "--",
        *TINY,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["order"] == ["here", "copy", "head", "head", "copy", "here"]
    rows = {row["variant"]: row for row in summary["variants"]}
    assert rows["here"]["path"] == str(REPOSITORY)
    assert rows["copy"]["path"] == str(copy)
    assert "worktree" in rows["head"]["path"]
    for row in rows.values():
        assert len(row["round_medians_s"]) == 2 and all(m > 0 for m in row["round_medians_s"])
        assert len(row["first_run_peak_above_start_mib"]) == 2
    assert rows["here"]["ratio"] == 1.0
    # The ratio is of the unrounded medians (tiny runs: tens of ms, 0.1 ms shown).
    assert rows["copy"]["ratio"] == pytest.approx(
        rows["copy"]["median_s"] / rows["here"]["median_s"], rel=0.01
    )
    assert _worktrees() == before  # the revision's worktree is gone


@pytest.mark.parametrize(
    "args, message",
    [
        (["-v", "now"], "is not NAME=WHERE"),
        (["-v", "a=.", "-v", "a=."], "each with a name of its own"),
        (["-v", "a=.", "-v", "b=.", "--", "--methods", "p2p"], "--methods is set by this tool"),
        (["-v", "a=.", "-v", "b=no-such-revision-xyz"], "neither a directory holding gpushuffle"),
    ],
)
def test_bad_variants_get_a_clear_error_and_run_nothing(args, message):
    done = _alternate(*args)
    assert done.returncode != 0
    assert message in done.stderr
    assert "round 0" not in done.stdout
