"""The Dagster code location on the real stack, through a `dagster dev` instance's GraphQL API:
a sweep from the launchpad trains one run per grid point (Ray, vLLM, SQLite Iceberg catalog,
SQLite MLflow) and evaluations run on a checkpoint. (An RL run killed with SIGKILL coming back by
itself from its last checkpoint, every sample and step in the lake once, is tested on the
production profile, where the daemon is killed too: tests/infra/test_production.py.)

Runs take the session's cached tiny policy (`model.path`): no SFT here. One RL run at a time
(dagster.yaml's limit). Every run and evaluation here attaches to the session's vLLM server
(`rollout.urls`, the evaluation's `urls`) instead of starting one (~40 s each on 2 cores): each run
gives it its own weights at the start, the evaluation the checkpoint's. A Dagster run that starts
its own engine is tested on the production profile (tests/infra/test_production.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
from mlflow import MlflowClient

from tests.dagster_client import DagsterDev
from assets.runs import partition_key
from assets.sweeps import parse_grid
from factory.lake import open_catalog, sql
from factory.recipe import expand_sweep

from .conftest import REPO, TEST_OVERRIDES, small_recipe

pytestmark = pytest.mark.integration

SWEEP_GRID = ["async.max_staleness=0,1"]
TINY = ["train.steps=3", "eval.heldout=32"]  # with train.checkpoint_every=2: checkpoints at steps 2 and 3


@pytest.fixture(scope="module")
def dagster(policy, ray_cluster, tmp_path_factory):
    """dagster dev on a fresh state dir; the checkpoint sensor is stopped so that the evaluations
    below are the ones the tests launch (it would start one beside any run that has a checkpoint).
    Its runs attach to the session's Ray cluster (RAY_ADDRESS), as a team's runs attach to theirs,
    instead of starting a local Ray each (~5 s and 9 processes a run; `make main`'s test keeps that path)."""
    dev = DagsterDev(tmp_path_factory.mktemp("factory-home"), ray_address=ray.get_runtime_context().gcs_address)
    try:
        dev.start()
        dev.stop_sensor("checkpoint_evaluation_sensor")
        yield dev
    finally:
        dev.stop()


def overrides(policy: Path, *extra: str) -> list[str]:
    return [*TEST_OVERRIDES, f"model.path={policy}", *extra]


def lake(home: Path):
    return open_catalog({"type": "sql", "uri": f"sqlite:///{home / 'lake' / 'catalog.db'}",
                         "warehouse": (home / "lake" / "warehouse").as_uri()})


def mlflow_runs(home: Path) -> dict[str, object]:
    """{factory.run tag (the rl_runs key): MLflow run} in the `factory` experiment."""
    client = MlflowClient(f"sqlite:///{home / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("factory")
    return {r.data.tags["factory.run"]: r for r in client.search_runs([experiment.experiment_id])}


def launch_sweep(dagster: DagsterDev, run_overrides: list[str], grid: list[str]) -> str:
    config = {"recipe": "recipes/default.yaml", "overrides": run_overrides, "grid": grid}
    sweep = dagster.launch("sweep_job", {"ops": {"plan_sweep": {"config": config}}})
    assert dagster.wait_for_run(sweep, 120)["status"] == "SUCCESS"
    return sweep


def test_dagster_dev_as_the_readme_starts_it_listens_on_loopback(dagster):
    from .test_cluster import beyond_loopback, listening

    sockets = listening(dagster.process.pid)  # webserver, daemon, code servers
    assert any(s[1] == dagster.port for s in sockets)
    assert not beyond_loopback(sockets), beyond_loopback(sockets)


def test_a_sweep_of_two_points_trains_two_runs_with_lake_mlflow_and_evaluations(dagster, policy, engine):
    url = ray.get(engine.url.remote())
    run_overrides = overrides(policy, *TINY, f"rollout.urls=[{url}]")
    jobs_before = {j["JobID"] for j in ray._private.state.jobs()}
    sweep = launch_sweep(dagster, run_overrides, SWEEP_GRID)
    recipe = small_recipe(*run_overrides[len(TEST_OVERRIDES):])
    recipe.sweep = parse_grid(SWEEP_GRID)  # what plan_sweep does
    keys = sorted(partition_key(sub) for _, sub in expand_sweep(recipe))
    assert len(keys) == 2 and set(keys) <= set(dagster.partition_keys("rl_run"))

    # the rl_run_launcher sensor starts one rl_run_job per point; dagster.yaml lets one run at a time.
    # Once both have finished (the engine they share is free), an evaluation of the first run's step-2
    # checkpoint (which no run evaluated) is launched the way the schedule launches one.
    in_sweep = [{"key": "factory/sweep_run_id", "value": sweep}]
    runs = dagster.wait_for_runs(2, 900, tags=in_sweep)
    evaluated = runs[-1]["tags"]["dagster/partition"]  # (newest first: the oldest)
    checkpoint = dagster.home / "runs" / evaluated / "checkpoints" / "step-000002"
    config = {"checkpoint": str(checkpoint), "urls": [url]}
    evaluation = dagster.launch("evaluation_job", {"ops": {"evaluation": {"config": config}}},
                                tags={"dagster/partition": evaluated, "factory/kind": "evaluation"})
    assert [r["status"] for r in runs] == ["SUCCESS", "SUCCESS"], [(r["runId"], r["status"]) for r in runs]
    # both ran as drivers on the session's cluster (RAY_ADDRESS), not on a Ray of their own
    assert len({j["JobID"] for j in ray._private.state.jobs()} - jobs_before) >= 2
    assert sorted(r["tags"]["dagster/partition"] for r in runs) == keys
    assert {r["jobName"] for r in runs} == {"rl_run_job"}
    first, second = sorted(runs, key=lambda r: r["startTime"])
    assert second["startTime"] >= first["endTime"] - 1.0, "two RL runs overlapped despite the limit of one"

    catalog = lake(dagster.home)
    mlflow = mlflow_runs(dagster.home)
    for run in runs:
        key = run["tags"]["dagster/partition"]
        events = dagster.events(run["runId"])
        checks = {e["evaluation"]["checkName"]: e["evaluation"]["success"] for e in events
                  if e["__typename"] == "AssetCheckEvaluationEvent"}
        assert checks == {"no_duplicate_sample_ids": True, "staleness_within_eta": True,
                          "versions_non_decreasing": True, "statuses_consistent": True}
        (materialization,) = dagster.materializations("rl_run", key)
        assert materialization["runId"] == run["runId"]
        # lineage: each checkpoint is a materialization of its own asset, naming recipe and code
        reported = dagster.materializations("checkpoint", key)
        assert sorted(m["metadata"]["step"] for m in reported) == [2, 3]
        assert all(m["metadata"]["recipe_hash"] == materialization["metadata"]["recipe_hash"]
                   and len(m["metadata"]["git_sha"]) == 40 for m in reported)
        # one MLflow run per RL run, finished, with the run's step metrics
        assert materialization["metadata"]["mlflow_run_id"] == mlflow[key].info.run_id
        assert mlflow[key].info.status == "FINISHED"
        assert mlflow[key].data.params["async.max_staleness"] in ("0", "1")
        history = MlflowClient(f"sqlite:///{dagster.home / 'mlflow' / 'mlflow.db'}").get_metric_history(
            mlflow[key].info.run_id, "rollout/reward_mean")
        assert sorted(m.step for m in history) == [1, 2, 3]

        # the lake: 3 steps × 4 groups × 4 samples, each once; the before/after evaluations
        per_step = sql(f"SELECT trained_step, count(*) AS n, count(DISTINCT sample_id) AS ids FROM samples "
                       f"WHERE run_id = '{key}' AND status = 'trained' GROUP BY 1 ORDER BY 1",
                       catalog=catalog).to_pylist()
        assert per_step == [{"trained_step": s, "n": 16, "ids": 16} for s in (1, 2, 3)]
        episodes = sql(f"SELECT step, count(*) AS n FROM samples WHERE run_id = '{key}' AND status = 'evaluation' "
                       "AND step IN (0, 3) GROUP BY 1 ORDER BY 1", catalog=catalog).to_pylist()
        assert episodes == [{"step": 0, "n": 32}, {"step": 3, "n": 32}]  # before and after training
        steps = sql(f"SELECT step FROM steps WHERE run_id = '{key}' ORDER BY 1", catalog=catalog).to_pylist()
        assert [r["step"] for r in steps] == [1, 2, 3]
        evaluations = sql(f"SELECT step, suite, n FROM evaluations WHERE run_id = '{key}' AND step IN (0, 3) "
                          f"ORDER BY 1", catalog=catalog).to_pylist()  # (step 2: the evaluation job's, below)
        assert evaluations == [{"step": 0, "suite": "heldout", "n": 32}, {"step": 3, "suite": "heldout", "n": 32}]
    # the sweep is a parent MLflow run, its RL runs are children
    parent = mlflow[f"sweep-{sweep[:8]}"]
    assert parent.data.tags["factory.sweep_run_id"] == sweep
    assert {mlflow[k].data.tags.get("mlflow.parentRunId") for k in keys} == {parent.info.run_id}
    assert len(mlflow) == 3

    # the evaluation of the step-2 checkpoint: in the asset's metadata and the lake
    assert dagster.wait_for_run(evaluation, 600)["status"] == "SUCCESS"
    (scored,) = dagster.materializations("evaluation", evaluated)
    assert scored["metadata"]["source"] == "evaluated now" and scored["metadata"]["n"] == 32
    assert scored["metadata"]["step"] == 2 and 0.0 <= scored["metadata"]["accuracy"] <= 1.0
    row = sql(f"SELECT n, mean FROM evaluations WHERE run_id = '{evaluated}' AND step = 2",
              catalog=catalog).to_pylist()
    assert row == [{"n": 32, "mean": pytest.approx(scored["metadata"]["accuracy"])}]
    episodes = sql(f"SELECT count(*) AS n, avg(reward) AS mean FROM samples WHERE run_id = '{evaluated}' "
                   "AND status = 'evaluation' AND step = 2", catalog=catalog).to_pylist()
    assert episodes == [{"n": 32, "mean": pytest.approx(scored["metadata"]["accuracy"])}]  # each episode too


def test_main_materializes_the_asset_graph_in_process(policy, engine, tmp_path, monkeypatch):
    """`make main`'s command on a tiny recipe: main_job in-process on the embedded instance, then
    the summary and where to look (Dagster UI, MLflow UI, a SQL query that works). The run attaches to
    the session's engine."""
    import subprocess
    import sys

    home = tmp_path / "state"
    env = {**os.environ, "FACTORY_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for name in ("DAGSTER_HOME", "RAY_ADDRESS", "MLFLOW_TRACKING_URI", "FACTORY_PROFILE", "FACTORY_ENV_FILE"):
        env.pop(name, None)
    command = [sys.executable, "-m", "assets", "materialize", "recipes/default.yaml",
               *overrides(policy, "train.steps=2", "eval.heldout=16", f"rollout.urls=[{ray.get(engine.url.remote())}]")]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "accuracy after RL  :" in out and "evaluation asset   : step 2:" in out
    assert "-m assets -p 3000" in out and "mlflow ui --backend-store-uri sqlite:///" in out
    query = out.split('lake sql "', 1)[1].split('"\n', 1)[0]

    import dagster as dg

    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))  # dagster.yaml's storage reads it
    with dg.DagsterInstance.from_config(str(home / "dagster")) as instance:
        (run,) = instance.get_runs()
        assert run.job_name == "main_job" and run.status == dg.DagsterRunStatus.SUCCESS
        key = run.tags["dagster/partition"]
        for asset in ("task_dataset", "base_policy", "rl_run", "evaluation"):
            (record,) = instance.fetch_materializations(dg.AssetKey(asset), limit=5).records
            assert record.run_id == run.run_id
    assert (home / "runs" / key / "results.json").is_file()
    rows = {r["status"]: r for r in sql(query, catalog=lake(home)).to_pylist()}
    assert rows["trained"]["samples"] == 2 * 16 and rows["trained"]["last_step"] == 2  # 2 steps x 4 groups x 4
    assert rows["evaluation"]["samples"] == 2 * 16  # before and after
