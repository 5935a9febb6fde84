"""DuckDB SQL over the lake tables, its CLI, and clean errors for bad SQL."""

from __future__ import annotations

import pytest

from factory.lake import LakeQueryError, TrajectoryWriter, format_table, sql
from factory.lake.cli import main as lake_cli
from tests.lake.rows import sample_row, step_row


@pytest.fixture
def filled(catalog):
    with TrajectoryWriter(catalog) as writer:
        writer.append("samples", [sample_row("a", f"s{i}", reward=float(i)) for i in range(3)])
        writer.append("samples", [sample_row("b", f"s{i}") for i in range(2)])
        writer.append("steps", [step_row("a", s) for s in (1, 2, 4)])
    return catalog


def test_group_by_over_samples(filled):
    result = sql("SELECT run_id, count(*) AS n, sum(reward) AS r FROM samples GROUP BY 1 ORDER BY 1", filled)
    assert result.to_pylist() == [{"run_id": "a", "n": 3, "r": 3.0}, {"run_id": "b", "n": 2, "r": 2.0}]


def test_join_and_map_access(filled):
    result = sql("""SELECT st.step, st.metrics['train/loss'] AS loss, count(sa.sample_id) AS n
                    FROM steps st LEFT JOIN samples sa ON sa.run_id = st.run_id AND sa.trained_step = st.step
                    GROUP BY ALL ORDER BY st.step""", filled)
    assert result.to_pylist() == [{"step": 1, "loss": 1.0, "n": 3}, {"step": 2, "loss": 0.5, "n": 0},
                                  {"step": 4, "loss": 0.25, "n": 0}]


def test_a_table_never_written_is_an_empty_relation(filled):
    assert sql("SELECT count(*) AS n FROM evaluations", filled).to_pylist() == [{"n": 0}]


def test_bad_sql_is_a_one_line_error(filled):
    with pytest.raises(LakeQueryError) as err:
        sql("SELEC run_id FROM samples", filled)
    assert "\n" not in str(err.value) and "syntax error" in str(err.value)
    with pytest.raises(LakeQueryError, match="no_such_column"):
        sql("SELECT no_such_column FROM samples", filled)


def test_lake_sql_command(filled, capsys):
    assert lake_cli(["lake", "sql", "SELECT run_id, count(*) AS n FROM samples GROUP BY 1 ORDER BY 1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run_id", "n"] and lines[2].split() == ["a", "3"] and lines[3].split() == ["b", "2"]
    assert lines[-1] == "(2 rows)"

    assert lake_cli(["lake", "sql", "SELEC 1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: Parser Error") and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err


def test_a_wrong_table_name_lists_the_lake_tables_and_tables_shows_them(filled, capsys):
    with pytest.raises(LakeQueryError) as err:
        sql("SELECT count(*) FROM sample", filled)
    message = str(err.value)
    assert "\n" not in message and "sample" in message
    assert "lake tables: tasks, samples, steps, evaluations, checkpoints, runs" in message
    assert lake_cli(["lake", "tables"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if not line.startswith("  ")]
    assert heads == ["tasks: 0 rows", "samples: 5 rows", "steps: 3 rows", "evaluations: 0 rows",
                     "checkpoints: 0 rows", "runs: 0 rows"]
    samples_columns = out.split("samples: 5 rows\n", 1)[1].split("\nsteps:", 1)[0]
    assert "status" in samples_columns and "completion_text" in samples_columns


def test_format_table_truncates_rows_and_cells():
    import pyarrow as pa

    text = format_table(pa.table({"x": list(range(5)), "s": ["y" * 100] * 5}), max_rows=2, max_width=10)
    lines = text.splitlines()
    assert len(lines) == 2 + 2 + 1 and lines[2].split() == ["0", "y" * 9 + "…"]
    assert lines[-1] == "(5 rows, showing 2)"
