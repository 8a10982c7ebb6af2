"""The tools that lose workers on purpose: the soak (``gpushuffle soak``, a
few seeded rounds on Nanny workers here, and the check it relies on
catching what is wrong; longer soaks are run by hand, docs/development.md)
and the loss benchmark (``gpushuffle bench --kill-at``), once each."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from gpushuffle.cli import main
from gpushuffle.soak import (
    Round,
    differences,
    explain,
    fingerprint,
    output_digest,
    unmatched,
)


def _part(keys: list[int], names: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"key": keys, "x": [k * 0.5 for k in keys], "name": names})


def test_the_digest_sees_a_row_moved_changed_or_lost_but_not_the_order():
    truth = pd.concat(
        [output_digest(_part([1, 2, 3], ["a", "b", "c"])), output_digest(_part([4], ["d"]))]
    )
    reordered = pd.concat(
        [output_digest(_part([3, 1, 2], ["c", "a", "b"])), output_digest(_part([4], ["d"]))]
    )
    assert differences(reordered, truth) == []
    moved = pd.concat(
        [output_digest(_part([1, 2], ["a", "b"])), output_digest(_part([4, 3], ["d", "c"]))]
    )
    assert differences(moved, truth) == [0, 1]
    # A string changed and nothing else: the row count and the numbers agree.
    changed = pd.concat(
        [output_digest(_part([1, 2, 3], ["a", "b", "x"])), output_digest(_part([4], ["d"]))]
    )
    assert differences(changed, truth) == [0]
    lost = pd.concat([output_digest(_part([1, 2, 3], ["a", "b", "c"]))])
    assert differences(lost, truth) == [-1]


def test_unmatched_rows_are_counted_as_a_multiset():
    truth = np.array([5, 7, 7, 9], dtype=np.uint64)
    # One 7 lost, a 3 that tasks does not have, the order changed.
    got = np.array([9, 3, 7, 5], dtype=np.uint64)
    missing, extra = unmatched(got, truth)
    assert truth[missing].tolist() == [7] and got[extra].tolist() == [3]
    assert [len(x) for x in unmatched(truth[::-1], truth)] == [0, 0]


def test_a_wrong_partition_names_the_input_rows_behind_it(client):
    """What the soak says of a wrong output: the keys of its missing rows
    and the input partitions and rows that hold them, on both sides."""
    import dask.dataframe as dd

    left = dd.from_pandas(pd.DataFrame({"key": range(40), "x": range(40)}), npartitions=4)
    right = dd.from_pandas(pd.DataFrame({"key": [13, 27], "y": [1.0, 2.0]}), npartitions=2)
    merged = left.merge(right, on="key", npartitions=2, shuffle_method="tasks")
    truth = merged.map_partitions(fingerprint).compute().reset_index(drop=True)
    where = int(np.flatnonzero(truth["rows"].to_numpy())[0])
    got = truth.copy()
    # The partition's first row lost.
    got["hashes"] = [h[1:] if i == where else h for i, h in enumerate(got["hashes"])]
    lost = int(truth["keys"].iloc[where][0])
    found = explain(client, [left, right], got, truth, [where])
    side = 0 if lost < 20 else 1
    assert found == [
        f"output {where}: 1 rows missing, keys [{lost}]; rows with them: "
        f"frame 0 input {lost // 10} rows [{lost % 10}]; frame 1 input {side} rows [0]"
    ]


def test_rounds_are_drawn_from_the_seed_alone():
    drawn = [Round.draw(7, n, "partial") for n in range(40)]
    assert drawn == [Round.draw(7, n, "partial") for n in range(40)]
    assert drawn != [Round.draw(8, n, "partial") for n in range(40)]
    # Both operations, both column kinds, rounds without a loss, with two at once.
    assert {r.operation for r in drawn} == {"shuffle", "merge"}
    assert {r.dtypes for r in drawn} == {"numeric", "mixed"}
    assert any(not r.kills for r in drawn)
    assert any(len(r.kills) == 2 and r.kills[0] == r.kills[1] for r in drawn)


@pytest.mark.recovery
@pytest.mark.timeout(600)
def test_a_short_soak_is_right_and_leaves_nothing_behind(tmp_path):
    """Four rounds (seed 49: shuffles and a merge, one and two losses, every
    one within the first half of the no-fault time) on three Nanny workers,
    with the default recovery (``partial``; round 2 is the one that found
    it missing rows before the same-host lease): every output partition of
    every run equal to the tasks method's, nothing left on the workers."""
    out = tmp_path / "soak.json"
    result = CliRunner().invoke(
        main, ["soak", "--rounds", "4", "--seed", "49", "--workers", "3", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    rounds = json.loads(out.read_text())
    assert len(rounds) == 4 and all(r["right"] for r in rounds), result.output
    assert {r["round"]["recovery"] for r in rounds} == {"partial"}
    assert sum(r["killed"] for r in rounds) >= 2, result.output
    assert "every round right and clean" in result.output


@pytest.mark.recovery
@pytest.mark.timeout(600)
def test_the_loss_benchmark_kills_a_worker_and_checks_the_results(tmp_path):
    """``gpushuffle bench --kill-at``: one loss per run with losses, the
    results of both runs compared with the tasks shuffle's."""
    out = tmp_path / "loss.json"
    args = ["bench", "--rows", "400000", "--partitions", "8", "--workers", "3"]
    args += ["--repeat", "1", "--kill-at", "0.3", "--methods", "gpushuffle", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (run,) = json.loads(out.read_text())["results"]
    assert run["method"] == "gpushuffle" and run["kills"] == 1, run
    assert run["correct"] and run["fault_s"] is not None, (run.get("error"), run)
