"""Profiles: where the lake, MLflow and Ray live, switched by one setting and no code change.

`FACTORY_PROFILE=embedded` (the default) is one machine with nothing to install: a SQLite Iceberg
catalog with a local warehouse, MLflow on SQLite, both under the state dir, and a loopback Ray
started by each run. `FACTORY_PROFILE=production` reads the services from an env file
(`infra/.env`, or the file `FACTORY_ENV_FILE` names; variables already in the environment win):

    lake      PyIceberg SQL catalog on PostgreSQL, warehouse on S3  (FACTORY_PG_*, FACTORY_S3_*,
                                                                      FACTORY_LAKE_WAREHOUSE, AWS_*)
    MLflow    a tracking server over HTTP                            (MLFLOW_TRACKING_URI)
    Ray       a running cluster                                      (RAY_ADDRESS)
    Dagster   Postgres storage, separate webserver and daemon        (infra/production/dagster.yaml)

`infra/production/env.example` lists every variable and which are secrets; `python -m infra.stack
up` brings these services up on one machine and writes the env file. Pointing at a company's own
services is the same file with their addresses (FACTORY_LAKE_CATALOG_URI names any catalog URI).
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Mapping
from urllib.parse import quote

from factory.paths import REPO_ROOT

PROFILE_ENV = "FACTORY_PROFILE"
ENV_FILE_ENV = "FACTORY_ENV_FILE"
PROFILES = ("embedded", "production")
DEFAULT_ENV_FILE = REPO_ROOT / "infra" / ".env"
EXAMPLE_ENV_FILE = REPO_ROOT / "infra" / "production" / "env.example"

_loaded: dict[str, str] = {}  # env file path → the profile it activated (activate is idempotent)


class ProfileError(ValueError):
    """A profile setting is missing or wrong (a user error: one line naming what to fix)."""


def name() -> str:
    profile = os.environ.get(PROFILE_ENV, "").strip() or "embedded"
    if profile not in PROFILES:
        raise ProfileError(f"{PROFILE_ENV}={profile!r}: choose one of {', '.join(PROFILES)}")
    return profile


def env_file() -> Path:
    return Path(os.environ.get(ENV_FILE_ENV) or DEFAULT_ENV_FILE)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and `#` comments skipped; optional quotes around the value."""
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.replace("_", "").isalnum():
            raise ProfileError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        values[key] = value
    return values


def activate() -> str:
    """Load the production env file into os.environ (explicit variables win); return the profile.

    Called by every entry point that reads a service address (the catalog, MLflow, Ray, Dagster's
    definitions), so the run worker, the code server and `factory run` all see the same settings.
    """
    profile = name()
    if profile != "production":
        return profile
    path = env_file()
    if str(path) in _loaded:
        return profile
    if not path.is_file():
        raise ProfileError(f"{PROFILE_ENV}=production but {path} does not exist: create it from {EXAMPLE_ENV_FILE} "
                           f"(or `python -m infra.stack up` writes one), or set {ENV_FILE_ENV}")
    for key, value in read_env_file(path).items():
        os.environ.setdefault(key, value)
    _loaded[str(path)] = profile
    return profile


def require(key: str, env: Mapping[str, str] | None = None) -> str:
    value = (os.environ if env is None else env).get(key, "")
    if not value:
        raise ProfileError(f"{key} is not set: the production profile needs it in {env_file()} "
                           f"(see {EXAMPLE_ENV_FILE})")
    return value


def postgres_url(database: str, env: Mapping[str, str] | None = None) -> str:
    """A SQLAlchemy URL of `database` on the profile's Postgres (settings from `env`, default
    os.environ), with the psycopg2 driver named (SQLAlchemy 2.1 maps a bare postgresql:// to
    psycopg 3, which Dagster's NOTIFY breaks on)."""
    user, password = quote(require("FACTORY_PG_USER", env), safe=""), quote(require("FACTORY_PG_PASSWORD", env), safe="")
    return (f"postgresql+psycopg2://{user}:{password}@{require('FACTORY_PG_HOST', env)}:"
            f"{require('FACTORY_PG_PORT', env)}/{database}")


def s3_properties() -> dict[str, str]:
    """PyIceberg FileIO properties of the profile's object store."""
    props = {"s3.access-key-id": require("AWS_ACCESS_KEY_ID"), "s3.secret-access-key": require("AWS_SECRET_ACCESS_KEY"),
             "s3.region": os.environ.get("FACTORY_S3_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    if os.environ.get("FACTORY_S3_ENDPOINT"):  # empty: AWS itself
        props["s3.endpoint"] = os.environ["FACTORY_S3_ENDPOINT"]
    return props


def lake_catalog_props() -> dict[str, str] | None:
    """The production lake's catalog properties, or None for the embedded SQLite catalog."""
    if activate() != "production":
        return None
    uri = os.environ.get("FACTORY_LAKE_CATALOG_URI") or postgres_url("iceberg")
    props = {"type": "sql", "uri": uri, "warehouse": require("FACTORY_LAKE_WAREHOUSE")}
    if props["warehouse"].startswith("s3://"):
        props.update(s3_properties())
    return props


def tracking_uri() -> str | None:
    """The profile's MLflow tracking server, or None (embedded: SQLite under the state dir)."""
    if activate() != "production":
        return None
    return require("MLFLOW_TRACKING_URI")


def ray_address() -> str | None:
    """The profile's Ray cluster (production requires one), else $RAY_ADDRESS if set, else None."""
    if activate() == "production":
        return require("RAY_ADDRESS")
    return os.environ.get("RAY_ADDRESS") or None
