"""The sample checks find planted duplicates, staleness and version-order violations, and pass clean data."""

from __future__ import annotations

import pyarrow as pa

from factory.lake import TrajectoryWriter, table_spec
from factory.lake.checks import (duplicate_sample_ids, load_samples, run_checks, staleness_violations,
                                 status_violations, version_order_violations)
from tests.lake.rows import sample_row

ETA = 2


def _table(rows: list[dict]) -> pa.Table:
    for row in rows:
        row["timings"] = None
    return pa.Table.from_pylist(rows, schema=table_spec("samples").arrow)


def _clean() -> list[dict]:
    # oldest sampled version = version − 1, so staleness 1 ≤ η; versions rise along the sample
    return [sample_row("r", f"s{i}", version=3) for i in range(6)]


def test_clean_data_passes_every_check():
    samples = _table(_clean())
    assert duplicate_sample_ids(samples, "r").count == 0
    assert staleness_violations(samples, ETA, "r").count == 0
    assert version_order_violations(samples, "r").count == 0


def test_planted_duplicates_are_found():
    rows = _clean() + [sample_row("r", "s2"), sample_row("r", "s2"), sample_row("r", "s4"),
                       sample_row("other", "s0")]  # same id in another run is fine
    result = duplicate_sample_ids(_table(rows), "r")
    assert result.count == 2 and not result.passed
    assert result.examples[0] == {"run_id": "r", "sample_id": "s2", "n": 3}
    assert result.examples[1]["sample_id"] == "s4"


def test_planted_staleness_violations_are_found():
    rows = _clean()
    # oldest sampled token at version 0 under trained_version 3: staleness 3 > η = 2
    rows[1]["versions"] = [0, -1, 3, 3]
    # an old version on a masked (tool) token does not count: staleness stays 1
    rows[2]["versions"], rows[2]["loss_mask"] = [2, 0, 3, 3], [1, 0, 1, 1]
    # exactly η behind is allowed
    rows[3]["versions"] = [1, -1, 2, 3]
    rows[4]["versions"], rows[4]["loss_mask"] = [3, -1, 0, 0], [1, 0, 1, 0]
    result = staleness_violations(_table(rows), ETA, "r")
    assert result.count == 2
    assert {e["sample_id"]: e["staleness"] for e in result.examples} == {"s1": 3, "s4": 3}
    assert staleness_violations(_table(rows), 3, "r").count == 0


def test_planted_version_order_violations_are_found():
    rows = _clean()
    rows[0]["versions"] = [3, -1, 2, 3]  # goes down at position 3 (1-based)
    rows[5]["versions"] = [2, 9, 2, 1]  # position 2 is masked out; 2 → 2 → 1 goes down at 4
    result = version_order_violations(_table(rows), "r")
    assert result.count == 2
    assert {e["sample_id"]: e["first_position"] for e in result.examples} == {"s0": 3, "s5": 4}


def test_run_checks_reads_the_run_from_the_lake(catalog):
    with TrajectoryWriter(catalog, run_id="r") as writer:
        writer.append("samples", _clean() + [sample_row("r", "late", versions=[0, -1, 0, 0], version=3)])
        writer.append("samples", [sample_row("q", "s0", versions=[0, -1, 0, 0], version=9)])
    assert load_samples("r", catalog).num_rows == 7
    results = run_checks("r", ETA, catalog)
    assert {name: r.count for name, r in results.items()} == {
        "duplicate_sample_ids": 0, "staleness_violations": 1, "version_order_violations": 0, "status_violations": 0}
    assert results["staleness_violations"].examples[0]["sample_id"] == "late"


def test_lake_check_command_fails_on_a_violation(catalog, capsys):
    from factory.lake.cli import main as lake_cli

    with TrajectoryWriter(catalog, run_id="r") as writer:
        writer.append("samples", _clean() + [sample_row("r", "late", versions=[0, -1, 0, 0], version=3)])
    assert lake_cli(["lake", "check", "r", "--max-staleness", "2"]) == 1
    out = capsys.readouterr().out
    assert "FAIL staleness_violations" in out and '"sample_id": "late"' in out and "ok  duplicate_sample_ids" in out
    assert lake_cli(["lake", "check", "r", "--max-staleness", "3"]) == 0


def test_every_status_is_accepted_and_inconsistent_fates_are_found():
    fine = _clean() + [
        sample_row("r", "f0", status="filtered", trained_step=None, trained_version=None, staleness=None),
        sample_row("r", "e0", status="evaluation", trained_step=None, trained_version=None, staleness=None),
        sample_row("r", "x0", status="failed", trained_step=None, trained_version=None, error="ValueError: boom"),
        sample_row("r", "d0", status="dropped", trained_step=None, trained_version=None, error="prompt of 300 tokens"),
        sample_row("r", "old", status=None),  # written before statuses existed: a trained sample
    ]
    assert status_violations(_table(fine), "r").passed
    planted = fine + [
        sample_row("r", "bad1", status="lost"),  # unknown status
        sample_row("r", "bad2", trained_step=None),  # trained, but at no step
        sample_row("r", "bad3", status="rejected"),  # rejected, yet claims a trained step
        sample_row("r", "bad4", status="failed", trained_step=None, trained_version=None),  # no error
        sample_row("r", "bad5", status="dropped", trained_step=None, trained_version=None),  # no error
    ]
    result = status_violations(_table(planted), "r")
    assert result.count == 5 and [e["sample_id"] for e in result.examples] == ["bad1", "bad2", "bad3", "bad4", "bad5"]
