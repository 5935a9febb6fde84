"""TrajectoryWriter: round trip, concurrency, exactly-once across a crash, retries, validation."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from factory.lake import TrajectoryWriter
from factory.lake.writer import POSITION_PROPERTY
from tests.lake import workers
from tests.lake.rows import sample_row, step_row


def _rows(catalog, table: str) -> list[dict]:
    return catalog.load_table(("factory", table)).scan().to_arrow().to_pylist()


def test_samples_round_trip(catalog):
    written = [sample_row("run-a", f"s{i}", step=i, reward=0.5 * i) for i in range(5)]
    written[0]["info"] = {"tool": "python"}
    with TrajectoryWriter(catalog, run_id="run-a", batch_rows=2) as writer:
        assert writer.append("samples", written) == 5
    back = sorted(_rows(catalog, "samples"), key=lambda r: r["sample_id"])
    assert len(back) == 5
    for got, want in zip(back, written):
        assert json.loads(got.pop("timings")) == want["timings"]
        info = got.pop("info")
        assert (json.loads(info) if info else None) == want["info"]
        assert {k: v for k, v in got.items() if k in want} == {k: v for k, v in want.items() if k not in ("timings", "info")}
        assert all(got[k] is None for k in got.keys() - want.keys())  # columns the rows did not set


def test_steps_round_trip_and_default_timestamp(catalog):
    rows = [step_row("run-a", s) for s in (1, 2)]
    rows[1]["metrics"].update({"note": "skipped", "missing": None, "perf/count": 7, "flag": True})
    with TrajectoryWriter(catalog, run_id="run-a") as writer:
        writer.append("steps", rows)
    back = sorted(_rows(catalog, "steps"), key=lambda r: r["step"])
    assert [r["step"] for r in back] == [1, 2]
    assert dict(back[1]["metrics"]) == {"train/loss": 0.5, "rollout/reward_mean": pytest.approx(0.2),
                                        "perf/count": 7.0, "flag": 1.0}
    assert all(r["time"] is not None and r["time"].tzinfo is not None for r in back)


def test_rows_that_do_not_fit_the_schema_fail_at_append(catalog):
    with TrajectoryWriter(catalog, run_id="r") as writer:
        with pytest.raises(ValueError, match="no column"):
            writer.append("samples", [sample_row("r", "a", rewrd=1.0)])
        with pytest.raises(ValueError, match="do not match"):
            writer.append("samples", [sample_row("r", "b", turns="two")])
        with pytest.raises(ValueError, match="unknown lake table"):
            writer.append("sample", [sample_row("r", "c")])
        assert writer.append("samples", [sample_row("r", "b")]) == 1  # the failed key was not remembered
    assert [r["sample_id"] for r in _rows(catalog, "samples")] == ["b"]


def test_two_processes_append_concurrently_without_losing_rows(catalog, tmp_path):
    # 100 commits each (~5 s of commits on 2 cores; 200 took twice as long and collided no more usefully)
    commits, per_commit = 100, 3
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=workers.append_many, args=(str(tmp_path), k, commits, per_commit, out, None, start))
             for k in range(2)]
    for p in procs:
        p.start()
    metrics = workers.collect(procs, out, timeout_s=300)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [m["lake/commits"] for m in metrics] == [commits, commits]
    # the writers committed at the same time (else this tests nothing): each began before the other ended
    assert max(m["first_commit_at"] for m in metrics) < min(m["last_commit_at"] for m in metrics), metrics
    ids = [r["sample_id"] for r in catalog.load_table(("factory", "samples")).scan(
        selected_fields=("sample_id",)).to_arrow().to_pylist()]
    expected = {f"w{k}-{i}-{j}" for k in range(2) for i in range(commits) for j in range(per_commit)}
    assert len(ids) == len(expected) == 2 * commits * per_commit
    assert set(ids) == expected


def test_exactly_once_across_a_crash(catalog, tmp_path):
    ctx = mp.get_context("spawn")
    crashed = ctx.Process(target=workers.crash_after_steps, args=(str(tmp_path),))
    crashed.start()
    crashed.join(timeout=120)
    assert crashed.exitcode == 0
    assert sorted(r["step"] for r in _rows(catalog, "steps")) == [1, 2, 3, 4, 5]  # 6, 7 were never committed

    writer = TrajectoryWriter(catalog, run_id="r", batch_rows=4)
    assert writer.position("steps") == 5 and writer.position("samples") == 5
    new_steps = sum(writer.append("steps", [step_row("r", s)]) for s in range(3, 9))
    new_samples = sum(writer.append("samples", [sample_row("r", f"s{s}-{k}", step=s) for k in range(2)])
                      for s in range(3, 9))
    writer.close()
    assert (new_steps, new_samples) == (3, 6)
    assert writer.metrics()["lake/skipped_rows"] == 3 + 6
    steps = [r["step"] for r in _rows(catalog, "steps")]
    assert sorted(steps) == list(range(1, 9))
    samples = [r["sample_id"] for r in _rows(catalog, "samples")]
    assert sorted(samples) == sorted(f"s{s}-{k}" for s in range(1, 9) for k in range(2))
    assert writer.position("steps") == 8


def test_another_runs_keys_do_not_block_this_run(catalog):
    with TrajectoryWriter(catalog, run_id="a") as writer:
        writer.append("samples", [sample_row("a", "s1")])
    with TrajectoryWriter(catalog, run_id="b") as writer:
        assert writer.append("samples", [sample_row("b", "s1")]) == 1
        assert writer.append("samples", [sample_row("a", "s1")]) == 0
    assert sorted((r["run_id"], r["sample_id"]) for r in _rows(catalog, "samples")) == [("a", "s1"), ("b", "s1")]


def test_commit_conflicts_beyond_pyicebergs_retries_are_retried(catalog, monkeypatch):
    real_append, failures = Table.append, {"left": 6}

    def conflicting_append(self, df, snapshot_properties={}, branch="main"):  # noqa: B006  (PyIceberg's own signature)
        if failures["left"]:
            failures["left"] -= 1
            raise CommitFailedException("Table has been updated by another process")
        return real_append(self, df, snapshot_properties=snapshot_properties, branch=branch)

    monkeypatch.setattr(Table, "append", conflicting_append)
    monkeypatch.setattr("factory.lake.writer.backoff_s", lambda attempt: 0.001)
    with TrajectoryWriter(catalog, run_id="r") as writer:
        writer.append("samples", [sample_row("r", f"s{i}") for i in range(4)])
    assert writer.metrics()["lake/retries"] == 6
    assert writer.metrics()["lake/commits"] == 1
    assert len(_rows(catalog, "samples")) == 4


def test_a_commit_that_landed_before_an_error_is_not_repeated(catalog, monkeypatch):
    real_append, calls = Table.append, []

    def lost_response(self, df, snapshot_properties={}, branch="main"):  # noqa: B006  (PyIceberg's own signature)
        calls.append(snapshot_properties)
        real_append(self, df, snapshot_properties=snapshot_properties, branch=branch)
        if len(calls) == 1:
            raise OperationalError("COMMIT", {}, Exception("disk I/O error after commit"))

    monkeypatch.setattr(Table, "append", lost_response)
    with TrajectoryWriter(catalog, run_id="r") as writer:
        writer.append("samples", [sample_row("r", f"s{i}", step=7) for i in range(3)])
    assert len(calls) == 1  # found its batch id in the table and stopped
    assert writer.metrics()["lake/retries"] == 1
    assert len(_rows(catalog, "samples")) == 3
    summary = catalog.load_table(("factory", "samples")).current_snapshot().summary.additional_properties
    assert summary[POSITION_PROPERTY + "r"] == "7"


@pytest.mark.parametrize("read", ["cut short", "gone"])
def test_a_metadata_file_deleted_under_a_read_is_reloaded(catalog, monkeypatch, read):
    """Concurrent writers' race: the catalog points at a metadata file that reads cut short or is gone
    (others' commits replaced and deleted it before or during the read), then at a newer one. The
    commit reloads the table and lands, once."""
    monkeypatch.setattr("factory.lake.writer.backoff_s", lambda attempt: 0.05)
    with TrajectoryWriter(catalog, run_id="r") as writer:
        writer.append("samples", [sample_row("r", "s0")])
        writer.flush()
        current = Path(urlparse(catalog.load_table(("factory", "samples")).metadata_location).path)
        whole = current.read_bytes()
        newer = current.with_name("99999-newer.metadata.json")
        newer.write_bytes(whole)
        if read == "gone":
            current.unlink()
        else:
            current.write_bytes(whole[: len(whole) // 2])

        def repoint() -> None:  # what a concurrent commit does: the catalog names a newer file
            time.sleep(0.3)
            with catalog.engine.begin() as db:
                db.execute(text("UPDATE iceberg_tables SET metadata_location = :new WHERE table_name = 'samples'"),
                           {"new": newer.as_uri()})

        mover = threading.Thread(target=repoint)
        mover.start()
        writer.append("samples", [sample_row("r", "s1")])
        writer.flush()
        mover.join()
    assert writer.metrics()["lake/retries"] >= 1  # it met the cut-short file (the pointer moved 0.3 s later)
    assert writer.metrics()["lake/commits"] == 2
    assert sorted(r["sample_id"] for r in _rows(catalog, "samples")) == ["s0", "s1"]


def test_a_metadata_file_that_stays_unreadable_fails_the_commit_and_keeps_rows(catalog, monkeypatch):
    monkeypatch.setattr("factory.lake.writer.backoff_s", lambda attempt: 0.001)
    writer = TrajectoryWriter(catalog, run_id="r", max_retries=2, flush_interval_s=0.05)
    writer.append("samples", [sample_row("r", "s0")])
    writer.flush()
    current = Path(urlparse(catalog.load_table(("factory", "samples")).metadata_location).path)
    whole = current.read_bytes()
    current.write_bytes(whole[:40])
    writer.append("samples", [sample_row("r", "s1")])
    with pytest.raises(Exception, match="lake commit failed"):
        writer.flush()
    current.write_bytes(whole)
    writer.flush()  # the kept row goes in once the file reads whole
    writer.close()
    assert sorted(r["sample_id"] for r in _rows(catalog, "samples")) == ["s0", "s1"]


def test_a_failing_catalog_surfaces_in_flush_and_keeps_rows(catalog, monkeypatch):
    real_append = Table.append

    def broken(self, df, snapshot_properties={}, branch="main"):  # noqa: B006  (PyIceberg's own signature)
        raise CommitFailedException("always conflicting")

    monkeypatch.setattr(Table, "append", broken)
    writer = TrajectoryWriter(catalog, run_id="r", max_retries=1, flush_interval_s=0.05)
    writer.append("samples", [sample_row("r", "s1")])
    with pytest.raises(Exception, match="lake commit failed"):
        writer.flush()
    monkeypatch.setattr(Table, "append", real_append)
    writer.flush()  # the kept rows go in once the catalog works again
    writer.close()
    assert [r["sample_id"] for r in _rows(catalog, "samples")] == ["s1"]


def test_periodic_expiry_bounds_the_snapshot_count(catalog):
    with TrajectoryWriter(catalog, run_id="r", expire_every=10, keep_snapshots=3) as writer:
        for i in range(25):
            writer.append("steps", [step_row("r", i + 1)])
            writer.flush()
    table = catalog.load_table(("factory", "steps"))
    assert writer.metrics()["lake/commits"] == 25
    assert writer.metrics()["lake/snapshots_expired"] == 7 + 10  # at commits 10 and 20, keeping 3
    assert len(table.metadata.snapshots) == 25 - 17
    assert sorted(r["step"] for r in table.scan().to_arrow().to_pylist()) == list(range(1, 26))


def test_sample_rows_from_a_trained_batch(catalog):
    from factory.lake import sample_rows
    from factory.core.types import Batch, Group, Sample, Task

    task = Task("t1", "arith", "1+1", "2")
    samples = [Sample(f"s{i}", "g1", "t1", [1, 2], [3, 4, 5], [-0.1, 0.0, -0.2], [1, 0, 1], [i, -1, 4],
                      reward=float(i), timings={"generate_s": 0.5}) for i in range(3)]
    batch = Batch(version=5, groups=[Group("g1", task, samples)])
    with TrajectoryWriter(catalog, run_id="r") as writer:
        assert writer.append("samples", sample_rows(batch, "r", step=9)) == 3
    back = sorted(_rows(catalog, "samples"), key=lambda r: r["sample_id"])
    assert [(r["staleness"], r["trained_step"], r["trained_version"]) for r in back] == [
        (5, 9, 5), (4, 9, 5), (3, 9, 5)]  # staleness = 5 − oldest sampled version i
    assert back[2]["versions"] == [2, -1, 4] and json.loads(back[0]["timings"]) == {"generate_s": 0.5}


def task_row(dataset: str, task_id: str, question: str) -> dict:
    return {"dataset": dataset, "task_id": task_id, "family": "a", "question": question, "answer": "1",
            "split": "train"}


def test_tasks_are_keyed_by_dataset_and_task_id(catalog):
    """Task ids repeat across datasets (a/train/0 in each): each dataset keeps its own rows, once."""
    with TrajectoryWriter(catalog) as writer:
        assert writer.append("tasks", [task_row("d1", "a/train/0", "1+1"), task_row("d1", "a/train/1", "1+2")]) == 2
        assert writer.append("tasks", [task_row("d2", "a/train/0", "7+7")]) == 1
    with TrajectoryWriter(catalog) as writer:  # a new writer reads the committed keys back per dataset
        assert writer.append("tasks", [task_row("d1", "a/train/0", "1+1"), task_row("d2", "a/train/1", "7+8")]) == 1
    back = sorted((r["dataset"], r["task_id"], r["question"]) for r in _rows(catalog, "tasks"))
    assert back == [("d1", "a/train/0", "1+1"), ("d1", "a/train/1", "1+2"), ("d2", "a/train/0", "7+7"),
                    ("d2", "a/train/1", "7+8")]


def test_rewind_deletes_a_runs_rows_beyond_a_checkpoint(catalog):
    """A run resumed from its step-2 checkpoint: its rows of steps 3-4 go, other runs keep theirs,
    and the steps it trains again land once, from the new attempt."""
    with TrajectoryWriter(catalog, run_id="r") as writer:
        writer.append("samples", [sample_row("r", f"s{step}-{i}", step=step) for step in (1, 2, 3, 4) for i in (0, 1)])
        writer.append("steps", [step_row("r", step) for step in (1, 2, 3, 4)])
        writer.append("samples", [sample_row("other", "s4-0", step=4)])
    with TrajectoryWriter(catalog, run_id="r") as writer:
        assert writer.rewind(2) == {"samples": 4, "steps": 2}
        assert writer.position("samples") == 2 and writer.position("steps") == 2
        assert writer.rewind(2) == {}
        again = [sample_row("r", f"s{step}-{i}", step=step, reward=0.0) for step in (3, 4) for i in (0, 1)]
        assert writer.append("samples", again) == 4  # the deleted keys are free again
        writer.append("steps", [step_row("r", step) for step in (3, 4)])
    samples = _rows(catalog, "samples")
    mine = [r for r in samples if r["run_id"] == "r"]
    assert sorted(r["sample_id"] for r in mine) == sorted({r["sample_id"] for r in mine}) and len(mine) == 8
    assert {r["sample_id"]: r["reward"] for r in mine if r["trained_step"] > 2} == {
        "s3-0": 0.0, "s3-1": 0.0, "s4-0": 0.0, "s4-1": 0.0}
    assert [r["sample_id"] for r in samples if r["run_id"] == "other"] == ["s4-0"]
    assert sorted(r["step"] for r in _rows(catalog, "steps")) == [1, 2, 3, 4]


def test_a_runs_writer_forgets_the_keys_below_a_checkpoint_and_drops_re_sends(catalog):
    """Before a checkpoint at step 3 the run's rows are all committed (`committed_through`): the writer
    keeps only keys from step 3 up (a run of days holds a checkpoint interval's keys), a re-sent row below
    it is dropped without a scan, one at or above it by its key; new rows land."""
    with TrajectoryWriter(catalog, run_id="r") as writer:
        writer.append("samples", [sample_row("r", f"s{step}-{i}", step=step) for step in (1, 2, 3, 4) for i in (0, 1)])
        writer.append("steps", [step_row("r", step) for step in (1, 2, 3, 4)])
        writer.append("samples", [sample_row("other", "x1", step=1)])
        writer.flush()
        assert writer.metrics()["lake/held_keys"] == 8 + 4 + 1
        writer.committed_through("r", 3)
        assert writer.metrics()["lake/held_keys"] == 4 + 2 + 1  # run r's steps 3-4, and the other run's key
        writer.committed_through("r", 2)  # a floor never goes back (only a rewind lowers it)
        assert writer.metrics()["lake/held_keys"] == 4 + 2 + 1
        assert writer.append("samples", [sample_row("r", "s1-0", step=1), sample_row("r", "s3-1", step=3),
                                         sample_row("other", "x1", step=1)]) == 0
        assert writer.append("samples", [sample_row("r", "s5-0", step=5), sample_row("other", "x2", step=1)]) == 2
        assert writer.metrics()["lake/skipped_rows"] == 3
    mine = [r["sample_id"] for r in _rows(catalog, "samples") if r["run_id"] == "r"]
    assert sorted(mine) == sorted({*mine}) and len(mine) == 9
    assert sorted(r["step"] for r in _rows(catalog, "steps")) == [1, 2, 3, 4]


def test_a_relaunch_reads_back_only_the_keys_from_its_checkpoint_up(catalog):
    """A relaunched run rewinds to its checkpoint (step 2): it reads back the run's keys from step 2 up,
    not the whole run's; re-sends below and at the checkpoint are dropped, the steps after it land once."""
    with TrajectoryWriter(catalog, run_id="r") as writer:
        writer.append("samples", [sample_row("r", f"s{step}-{i}", step=step) for step in range(1, 7) for i in (0, 1)])
    with TrajectoryWriter(catalog, run_id="r") as writer:
        assert writer.rewind(2) == {"samples": 8}
        assert writer.append("samples", [sample_row("r", "s1-0", step=1), sample_row("r", "s2-1", step=2)]) == 0
        assert writer.metrics()["lake/held_keys"] == 2  # step 2's two keys, read back; not step 1's
        assert writer.append("samples", [sample_row("r", f"s3-{i}", step=3, reward=0.0) for i in (0, 1)]) == 2
    mine = [r for r in _rows(catalog, "samples") if r["run_id"] == "r"]
    assert sorted(r["sample_id"] for r in mine) == ["s1-0", "s1-1", "s2-0", "s2-1", "s3-0", "s3-1"]


def test_a_mixture_of_experts_samples_routing_round_trips_through_the_lake_into_replay(catalog):
    from factory.core.types import Batch, Group, Sample, Task
    from factory.lake.rows import pack_routing, sample_rows
    from factory.recording.replay import trained_batches

    routed = [[[1, 2], [7, 0]], [], [[3, 4], [5, 6]], [[0, 1], [2, 3]]]  # token 1: a tool token, not sampled
    sample = Sample("s0", "g0", "t-1", [5, 6], [7, 8, 9, 10], [-0.5, 0.0, -0.25, -1.5], [1, 0, 1, 1],
                    [2, -1, 3, 3], reward=1.0, routed_experts=routed)
    plain = Sample("s1", "g0", "t-1", [5, 6], [7, 8], [-0.5, -0.1], [1, 1], [3, 3])
    batch = Batch(3, [Group("g0", Task("t-1", "", "", ""), [sample, plain])])
    with TrajectoryWriter(catalog, run_id="run-moe") as writer:
        writer.append("samples", sample_rows(batch, "run-moe", step=1))
    stored = {r["sample_id"]: r for r in _rows(catalog, "samples")}
    assert stored["s0"]["routed_experts"] == pack_routing(routed) and len(stored["s0"]["routed_experts"]) == 2 * (2 + 4 * 4)
    assert stored["s1"]["routed_experts"] is None
    (version, groups), = trained_batches("run-moe", catalog).values()
    back = {s.sample_id: s for s in groups[0].samples}
    assert version == 3 and back["s0"].routed_experts == routed and back["s1"].routed_experts == []
