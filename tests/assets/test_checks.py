import dagster as dg

from assets.checks import samples_checks
from assets.resources import resources_for
from assets.runs import RL_RUNS, run_dir
from assets.training import rl_run
from factory.lake import TrajectoryWriter, open_catalog, sample_rows
from factory.paths import REPO_ROOT
from factory.recipe import load_recipe
from factory.core.types import Batch, Group, Sample, Task


def sample(sample_id: str, versions: list[int]) -> Sample:
    """Three completion tokens; the middle one is a tool token (not sampled)."""
    return Sample(sample_id=sample_id, group_id="g", task_id="t", prompt_ids=[1, 2], completion_ids=[3, 4, 5],
                  logprobs=[-0.5, 0.0, -0.5], loss_mask=[1, 0, 1], versions=versions, reward=1.0)


def write_run(key: str, batches: list[tuple[int, Batch]]) -> None:
    directory = run_dir(key)
    directory.mkdir(parents=True)
    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", ["async.max_staleness=1", "lake.enabled=true"])
    (directory / "recipe.yaml").write_text(recipe.to_yaml())
    with TrajectoryWriter(open_catalog(), run_id=key) as writer:
        for step, batch in batches:
            writer.append("samples", sample_rows(batch, key, step))


def check_results(instance, key: str) -> dict[str, dg.AssetCheckEvaluation]:
    instance.add_dynamic_partitions(RL_RUNS.name, [key])
    # checks only (as "Execute checks" in the UI): the partition goes as a run tag, since Dagster
    # cannot derive a partitions definition from a selection without assets
    result = dg.materialize([rl_run, *samples_checks()], instance=instance, resources=resources_for(),
                            tags={"dagster/partition": key}, selection=dg.AssetSelection.checks_for_assets(rl_run))
    assert result.success and not result.get_asset_materialization_events()  # checks only: nothing retrained
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def test_checks_pass_on_a_clean_run(instance):
    task = Task("t", "arith", "1+1", "2")
    write_run("clean", [(1, Batch(1, [Group("g1", task, [sample("a", [0, -1, 1]), sample("b", [1, -1, 1])])])),
                        (2, Batch(2, [Group("g2", task, [sample("c", [1, -1, 2])])]))])
    results = check_results(instance, "clean")
    assert set(results) == {"no_duplicate_sample_ids", "staleness_within_eta", "versions_non_decreasing",
                            "statuses_consistent"}
    for evaluation in results.values():
        assert evaluation.passed and evaluation.metadata["samples"].value == 3


def test_checks_find_stale_and_out_of_order_samples(instance):
    task = Task("t", "arith", "1+1", "2")
    # trained at version 3: "old" was sampled at version 1 (staleness 2 > η = 1), and "backwards"
    # has a later token from an older policy than an earlier one
    write_run("dirty", [(3, Batch(3, [Group("g", task, [sample("old", [1, -1, 2]), sample("backwards", [3, -1, 2]),
                                                       sample("fine", [3, -1, 3])])]))])
    results = check_results(instance, "dirty")
    assert results["no_duplicate_sample_ids"].passed
    stale, order = results["staleness_within_eta"], results["versions_non_decreasing"]
    assert not stale.passed and stale.metadata["offending"].value == 1
    assert stale.metadata["examples"].value[0]["sample_id"] == "old"
    assert not order.passed and order.metadata["offending"].value == 1
    assert order.metadata["examples"].value[0]["sample_id"] == "backwards"


def test_checks_warn_when_the_run_kept_no_lake(instance):
    directory = run_dir("no-lake")
    directory.mkdir(parents=True)
    recipe = load_recipe(REPO_ROOT / "recipes" / "default.yaml", ["lake.enabled=false"])
    (directory / "recipe.yaml").write_text(recipe.to_yaml())
    for evaluation in check_results(instance, "no-lake").values():
        assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.WARN
