"""Lineage on the real stack: one evaluation, followed back through the public APIs (the lake's SQL,
the checkpoint's manifest, Iceberg time travel, MLflow) to its checkpoint, recipe, code, base
policy and the exact samples it was trained on."""

from __future__ import annotations

import json
import subprocess

import pytest
from mlflow import MlflowClient

from factory.recording import lineage
from factory.lake import open_catalog, sql
from factory.paths import REPO_ROOT
from factory.recipe import load_recipe
from factory.run import run

from .conftest import small_recipe

pytestmark = pytest.mark.integration


def test_an_evaluation_leads_back_to_its_checkpoint_recipe_code_and_data(engine, policy, tmp_path, capsys):
    recipe = small_recipe("train.steps=2", "train.checkpoint_every=1", "eval.before=false", "eval.heldout=16",
                          f"model.path={policy}")
    recipe.lake.catalog = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db",
                           "warehouse": (tmp_path / "warehouse").as_uri()}
    recipe.tracking.uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = tmp_path / "run"
    run(recipe, run_dir, engines=[engine])
    catalog = open_catalog(recipe.lake.catalog)
    key = run_dir.name

    # the evaluation after training names its checkpoint and carries that checkpoint's manifest
    (evaluation,) = sql(f"SELECT step, checkpoint, lineage FROM evaluations WHERE run_id = '{key}'",
                        catalog=catalog).to_pylist()
    assert evaluation["step"] == 2 and evaluation["checkpoint"].endswith("checkpoints/step-000002")
    manifest = lineage.read_manifest(evaluation["checkpoint"])
    assert json.loads(evaluation["lineage"]) == manifest

    # the recipe, the code and the base policy
    assert manifest["recipe_hash"] == recipe.fingerprint()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    assert manifest["git_sha"] == head and isinstance(manifest["git_dirty"], bool)
    assert manifest["base_policy_fingerprint"] == lineage.policy_fingerprint(policy)
    (origin,) = sql(f"SELECT recipe_hash, recipe_yaml, git_sha, mlflow_run_id FROM runs WHERE run_id = '{key}'",
                    catalog=catalog).to_pylist()
    recipe_file = tmp_path / "from_lake.yaml"
    recipe_file.write_text(origin["recipe_yaml"])
    assert load_recipe(recipe_file).fingerprint() == manifest["recipe_hash"] == origin["recipe_hash"]

    # the data: time travel to the checkpoint's snapshot reads exactly the samples trained up to it
    samples = catalog.load_table(("factory", "samples"))
    for step in (1, 2):
        snapshot = lineage.read_manifest(run_dir / "checkpoints" / f"step-{step:06d}")["lake_snapshots"]["samples"]
        rows = samples.scan(snapshot_id=snapshot, selected_fields=("run_id", "trained_step", "status")).to_arrow()
        trained = [r["trained_step"] for r in rows.to_pylist() if r["run_id"] == key and r["status"] == "trained"]
        assert len(trained) == step * 16 and max(trained) == step, (step, len(trained))

    # MLflow: the same run, tagged with the same origin
    tags = MlflowClient(recipe.tracking.uri).get_run(manifest["mlflow_run_id"]).data.tags
    assert manifest["mlflow_run_id"] == origin["mlflow_run_id"]
    assert tags["factory.git_sha"] == head and tags["factory.recipe_hash"] == recipe.fingerprint()
    assert tags["factory.base_policy_fingerprint"] == manifest["base_policy_fingerprint"]

    # the same through the command line: `factory runs show` / `compare`
    from factory.cli import main

    catalog_args = [arg for k, v in recipe.lake.catalog.items() for arg in ("--catalog", f"{k}={v}")]
    assert main(["runs", "show", key, *catalog_args]) == 0
    shown = capsys.readouterr().out
    assert f"recipe {manifest['recipe_hash']}, git {head}" in shown and "eval step     2 heldout" in shown
    assert main(["runs", "compare", key, key, *catalog_args]) == 0
    compared = capsys.readouterr().out
    assert "B − A held-out: +0.000" in compared and "recipes: identical" in compared
    assert main(["runs", "show", "no-such-run", *catalog_args]) == 2
    assert f"no run 'no-such-run' in the lake; runs: {key}" in capsys.readouterr().err

