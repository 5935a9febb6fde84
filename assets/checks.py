"""Asset checks on the samples an RL run wrote to the lake (`factory.lake.checks`): each sample id
once, staleness within the run's η, per-token policy versions non-decreasing along a sample, and
each sample's status consistent with its columns."""

import warnings
from collections.abc import Callable

import dagster as dg

from assets.resources import LakeResource
from assets.runs import RL_RUN_KEY, RL_RUNS, run_dir, saved_recipe


def _samples_check(name: str, description: str, evaluate: Callable) -> dg.AssetChecksDefinition:
    """An asset check on one rl_runs partition: `evaluate(samples, run_id, recipe)` -> CheckResult."""

    def _check(context: dg.AssetCheckExecutionContext, lake: LakeResource) -> dg.AssetCheckResult:
        from factory.lake.checks import load_samples

        key = context.partition_key
        recipe = saved_recipe(run_dir(key))
        if not recipe.lake.enabled:
            reason = "the run's recipe has lake.enabled: false; nothing to check"
            return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN, metadata={"reason": reason})
        samples = load_samples(key, lake.catalog(recipe), lake.namespace_for(recipe))
        result = evaluate(samples, key, recipe)
        return dg.AssetCheckResult(passed=result.passed, metadata={
            "samples": samples.num_rows, "offending": result.count,
            "examples": dg.MetadataValue.json(result.examples),
        })

    with warnings.catch_warnings():  # partitioned asset checks are a Dagster preview; we rely on them knowingly
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.asset_check(asset=RL_RUN_KEY, name=name, description=description, partitions_def=RL_RUNS)(_check)


def samples_checks() -> list[dg.AssetChecksDefinition]:
    from factory.lake import checks

    return [
        _samples_check("no_duplicate_sample_ids", "every sample id of the run occurs once in the lake",
                       lambda s, run, recipe: checks.duplicate_sample_ids(s, run)),
        _samples_check("staleness_within_eta",
                       "trained_version − oldest sampled-token version ≤ the run's async.max_staleness (η)",
                       lambda s, run, recipe: checks.staleness_violations(s, recipe.async_.max_staleness, run)),
        _samples_check("versions_non_decreasing", "policy versions never decrease along a sample's sampled tokens",
                       lambda s, run, recipe: checks.version_order_violations(s, run)),
        _samples_check("statuses_consistent",
                       "every generated sample has a known fate (trained once with its step, filtered, rejected, "
                       "unused, failed with its error, evaluation)",
                       lambda s, run, recipe: checks.status_violations(s, run)),
    ]
