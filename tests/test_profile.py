"""The profile switch (factory/support/profile.py) and the stack's env file (infra/stack.py): pure logic."""

from __future__ import annotations

import os
import stat

import pytest

from factory.support import profile
from infra.stack import free_port_settings, settings, write_env_file


@pytest.fixture
def production(tmp_path, monkeypatch):
    """FACTORY_PROFILE=production with a fresh env file written the way `infra.stack up` writes it."""
    for key in profile.read_env_file(profile.EXAMPLE_ENV_FILE):
        monkeypatch.delenv(key, raising=False)
    env_file = write_env_file(tmp_path / ".env", {"FACTORY_PG_PASSWORD": "p@ss:/w rd", "FACTORY_PG_PORT": "6543"})
    monkeypatch.setenv("FACTORY_PROFILE", "production")
    monkeypatch.setenv("FACTORY_ENV_FILE", str(env_file))
    monkeypatch.setattr(profile, "_loaded", {})
    saved = dict(os.environ)
    yield env_file
    os.environ.clear()  # activate() loads the file into os.environ: leave none of it to later tests
    os.environ.update(saved)


def test_env_file_syntax(tmp_path):
    path = tmp_path / "x.env"
    path.write_text("# comment\n\nA=1\nexport B = two words \nC='quoted # not a comment'\nD=x  # trailing\n")
    assert profile.read_env_file(path) == {"A": "1", "B": "two words", "C": "quoted # not a comment", "D": "x"}
    path.write_text("A=1\nnot a setting\n")
    with pytest.raises(profile.ProfileError, match=r"x.env:2: expected KEY=VALUE, got 'not a setting'"):
        profile.read_env_file(path)


def test_embedded_is_the_default_and_points_nowhere_else(monkeypatch):
    monkeypatch.delenv("FACTORY_PROFILE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert profile.name() == "embedded"
    assert profile.lake_catalog_props() is None and profile.tracking_uri() is None and profile.ray_address() is None


def test_production_derives_the_catalog_mlflow_and_ray_from_the_env_file(production, monkeypatch):
    props = profile.lake_catalog_props()
    # the password is URL-quoted, the driver named (psycopg2, not SQLAlchemy's psycopg 3 default)
    assert props["uri"] == "postgresql+psycopg2://factory:p%40ss%3A%2Fw%20rd@127.0.0.1:6543/iceberg"
    assert props["type"] == "sql" and props["warehouse"] == "s3://factory-lake/warehouse"
    assert props["s3.endpoint"] == "http://127.0.0.1:9000" and props["s3.access-key-id"] == "S3RVER"
    assert profile.tracking_uri() == "http://127.0.0.1:5000"
    assert profile.ray_address() == "127.0.0.1:6380"
    # a variable set in the environment wins over the file (here: an existing company catalog)
    monkeypatch.setenv("FACTORY_LAKE_CATALOG_URI", "postgresql+psycopg2://u:p@db.example:5432/lake")
    assert profile.lake_catalog_props()["uri"] == "postgresql+psycopg2://u:p@db.example:5432/lake"


def test_production_names_what_is_missing(production, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    with pytest.raises(profile.ProfileError, match=r"MLFLOW_TRACKING_URI is not set: the production profile needs "
                                                   r"it in .*\.env \(see .*env.example\)"):
        profile.tracking_uri()
    monkeypatch.setenv("FACTORY_PROFILE", "prod")
    with pytest.raises(profile.ProfileError, match="FACTORY_PROFILE='prod': choose one of embedded, production"):
        profile.name()


def test_the_written_env_file_is_private_complete_and_overridable(tmp_path, monkeypatch):
    path = write_env_file(tmp_path / ".env", free_port_settings())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    values = profile.read_env_file(path)
    assert set(values) == set(profile.read_env_file(profile.EXAMPLE_ENV_FILE))  # every documented setting
    assert len(values["FACTORY_PG_PASSWORD"]) >= 20  # a fresh random secret, not the example's empty one
    assert values["FACTORY_PG_PASSWORD"] != profile.read_env_file(write_env_file(tmp_path / "b.env"))["FACTORY_PG_PASSWORD"]
    ports = [values["FACTORY_PG_PORT"], values["FACTORY_DAGSTER_PORT"], values["RAY_ADDRESS"].rsplit(":", 1)[1]]
    assert len(set(ports)) == 3
    monkeypatch.setenv("FACTORY_PG_PORT", "1234")
    assert settings(path)["FACTORY_PG_PORT"] == "1234"
