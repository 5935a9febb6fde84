import dagster as dg

from assets.__main__ import prepare_home
from factory.paths import REPO_ROOT


def test_embedded_instance_from_dagster_yaml(state, monkeypatch):
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    home = prepare_home()
    assert home == state / "dagster" and (home / "dagster.yaml").resolve() == REPO_ROOT / "dagster.yaml"
    assert prepare_home() == home  # idempotent

    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
        assert not instance.run_retries_retry_on_asset_or_op_failure
        assert instance.run_monitoring_enabled
        # a worker killed with -9 is found by monitoring (the default launcher cannot see it)
        assert type(instance.run_launcher).__name__ == "LocalProcessRunLauncher"
        assert instance.run_launcher.supports_check_run_worker_health
        concurrency = instance.get_concurrency_config()
        assert concurrency.run_queue_config.max_concurrent_runs == 2
        limits = {(t["key"], t["value"]): t["limit"] for t in concurrency.run_queue_config.tag_concurrency_limits}
        assert limits == {("factory/kind", "rl_run"): 1, ("factory/kind", "evaluation"): 1}
        assert concurrency.pool_config.default_pool_limit == 1
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        instance.add_dynamic_partitions("rl_runs", ["k"])  # storage works, and lives under the state dir
    assert (home / "history" / "runs.db").is_file() and (home / "schedules" / "schedules.db").is_file()
