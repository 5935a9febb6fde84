"""A fresh state dir (FACTORY_HOME) and a real, temporary Dagster instance (SQLite) for each test:
one instance per session (creating one takes ~2 s), wiped before each test."""

import dagster as dg
import pytest

from factory.paths import REPO_ROOT

SWEEP_RECIPE = REPO_ROOT / "recipes" / "sweep_loss_staleness.yaml"
# A recipe that fails as soon as the run starts (no model there), with nothing to record: a real
# failed RL run in a fraction of a second.
FAILING_OVERRIDES = ["model.path=/nonexistent/model", "lake.enabled=false", "tracking.enabled=false"]


@pytest.fixture
def state(tmp_path, monkeypatch):
    home = tmp_path / "state"
    monkeypatch.setenv("FACTORY_HOME", str(home))
    monkeypatch.delenv("FACTORY_PROFILE", raising=False)
    return home


@pytest.fixture(scope="session")
def session_instance(tmp_path_factory):
    with dg.instance_for_test(temp_dir=str(tmp_path_factory.mktemp("dagster"))) as instance:
        yield instance


@pytest.fixture
def instance(state, session_instance):
    session_instance.wipe()  # runs, event logs, dynamic partitions
    return session_instance


@pytest.fixture(scope="session")
def defs():
    from assets.definitions import defs

    return defs
