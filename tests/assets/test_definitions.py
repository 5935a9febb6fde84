import dagster as dg
import pytest

from assets.resources import LakeResource, TrackingResource, resources_for
from assets.runs import partition_key
from assets.sweeps import parse_grid
from factory.recipe import load_recipe
from tests.assets.conftest import SWEEP_RECIPE


def test_definitions_load_and_validate(defs):
    dg.Definitions.validate_loadable(defs)
    repo = defs.get_repository_def()
    assert {"main_job", "sweep_job", "rl_run_job", "evaluation_job"} <= set(repo.job_names)
    main = defs.resolve_job_def("main_job")
    assert {k.to_user_string() for k in main.asset_layer.selected_asset_keys} == {
        "task_dataset", "base_policy", "rl_run", "evaluation"}
    assert main.tags["factory/kind"] == "rl_run"  # under the one-RL-run-at-a-time limit
    assert {s.name for s in repo.sensor_defs} == {"rl_run_launcher", "checkpoint_evaluation_sensor", "rl_run_recovery"}
    assert [s.name for s in repo.schedule_defs] == ["evaluation_schedule"]
    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == {
        "task_dataset", "base_policy", "rl_run", "checkpoint", "evaluation", "sandbox_image"}
    checks = {key.name for key in graph.asset_check_keys if key.asset_key == dg.AssetKey("rl_run")}
    assert checks == {"no_duplicate_sample_ids", "staleness_within_eta", "versions_non_decreasing", "statuses_consistent"}
    # lineage: data -> policy -> run -> evaluation
    assert graph.get(dg.AssetKey("evaluation")).parent_keys == {dg.AssetKey("checkpoint"), dg.AssetKey("rl_run")}
    assert graph.get(dg.AssetKey("checkpoint")).parent_keys == {dg.AssetKey("rl_run")}
    assert graph.get(dg.AssetKey("rl_run")).parent_keys == {dg.AssetKey("base_policy"), dg.AssetKey("sandbox_image")}
    from factory.envs.base import environment_factory  # the run names the image its environment used

    assert environment_factory("tool_agent").uses_sandbox and not hasattr(environment_factory("single_turn"),
                                                                          "uses_sandbox")


def test_rl_run_job_is_not_retried_by_dagster(defs):
    # rl_run_recovery relaunches RL runs; Dagster's generic retries must not race it
    assert defs.resolve_job_def("rl_run_job").tags["dagster/max_retries"] == "0"


def test_resources_defer_to_the_profile_and_a_bad_profile_says_what_to_fix(monkeypatch, tmp_path):
    resources = resources_for()
    assert resources["lake"].catalog_props() == {} and resources["tracking"].uri == "" and resources["ray"].address == ""
    monkeypatch.setenv("FACTORY_PROFILE", "staging")
    with pytest.raises(ValueError, match="FACTORY_PROFILE='staging': choose one of embedded, production"):
        resources_for()
    monkeypatch.setenv("FACTORY_PROFILE", "production")
    monkeypatch.setenv("FACTORY_ENV_FILE", str(tmp_path / "missing.env"))
    with pytest.raises(ValueError, match="missing.env does not exist: create it from .*env.example"):
        resources_for()


def test_resources_configure_a_copy_of_the_recipe():
    recipe = load_recipe(SWEEP_RECIPE)
    lake = LakeResource(catalog_type="rest", catalog_uri="http://lake:8181", warehouse="s3://b/w", namespace="exp")
    configured = TrackingResource(uri="http://mlflow:5000").configure(lake.configure(recipe))
    assert configured.lake.catalog == {"type": "rest", "uri": "http://lake:8181", "warehouse": "s3://b/w"}
    assert configured.lake.namespace == "exp" and configured.tracking.uri == "http://mlflow:5000"
    assert recipe.lake.catalog == {} and recipe.tracking.uri is None  # the original is untouched


def test_grid_axes_parse_as_yaml_values():
    grid = parse_grid(["algorithm.loss=ppo_clip, reinforce", "train.lr=3e-4,1e-3", "train.betas=[[0.9, 0.99]]"])
    assert grid == {"algorithm.loss": ["ppo_clip", "reinforce"], "train.lr": [3e-4, 1e-3],
                    "train.betas": [[0.9, 0.99]]}
    for bad in ["train.lr", "=1,2", "train.lr=", "train.lr=[]"]:
        with pytest.raises(dg.Failure):
            parse_grid([bad])


def test_partition_key_is_the_name_and_a_fingerprint():
    recipe = load_recipe(SWEEP_RECIPE)
    key = partition_key(recipe)
    assert key == f"sweep_loss_staleness-{recipe.fingerprint()[:8]}"
    assert partition_key(load_recipe(SWEEP_RECIPE, ["train.lr=1e-4"])) != key
