"""Resources: the lake, MLflow tracking and Ray, injected into assets.

Where they point is the profile's business (`factory.support.profile`, switched by FACTORY_PROFILE): empty
fields mean "the profile's service" — embedded: a SQLite Iceberg catalog and a SQLite MLflow store
under the state dir and a loopback Ray per run; production: the catalog on PostgreSQL with the
warehouse on S3, an MLflow server and a Ray cluster. Fields set here (in the Dagster UI's launchpad,
say) override the profile for one run. Only configuration changes, never code.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING
from collections.abc import Iterator

import dagster as dg
from pydantic import Field

from factory.recipe import Recipe

if TYPE_CHECKING:
    from factory.support.progress import RunProgress

class LakeResource(dg.ConfigurableResource):
    """The Iceberg trajectory lake. Empty catalog fields: the profile's catalog."""

    catalog_type: str = Field(default="", description="PyIceberg catalog type (sql, rest, glue, hive); empty: embedded")
    catalog_uri: str = Field(default="", description="catalog URI, e.g. http://iceberg-rest:8181")
    warehouse: str = Field(default="", description="warehouse location, e.g. s3://bucket/lake")
    properties: dict[str, str] = Field(default={}, description="further PyIceberg catalog properties")
    namespace: str = Field(default="", description="table namespace; empty: the recipe's lake.namespace")

    def catalog_props(self) -> dict[str, str]:
        """Catalog properties for `factory.lake.open_catalog` ({} means the embedded default)."""
        props = dict(self.properties)
        for key, value in (("type", self.catalog_type), ("uri", self.catalog_uri), ("warehouse", self.warehouse)):
            if value:
                props[key] = value
        return props

    def namespace_for(self, recipe: Recipe | None = None) -> str:
        from factory.lake import NAMESPACE

        return self.namespace or (recipe.lake.namespace if recipe is not None else NAMESPACE)

    def catalog(self, recipe: Recipe | None = None):
        from factory.lake import open_catalog

        return open_catalog(self.catalog_props() or None, namespace=self.namespace_for(recipe))

    def writer(self, recipe: Recipe | None = None, run_id: str | None = None):
        """A TrajectoryWriter on this lake (use as a context manager: closing commits what is pending)."""
        from factory.lake import TrajectoryWriter

        return TrajectoryWriter(self.catalog(recipe), self.namespace_for(recipe), run_id=run_id)

    def configure(self, recipe: Recipe) -> Recipe:
        """A copy of `recipe` that writes to this lake (the deployment's catalog wins over the recipe's)."""
        recipe = recipe.model_copy(deep=True)
        if self.catalog_props():
            recipe.lake.catalog = self.catalog_props()
        if self.namespace:
            recipe.lake.namespace = self.namespace
        return recipe


class TrackingResource(dg.ConfigurableResource):
    """MLflow. Empty uri: the recipe's tracking.uri, else the profile's (a server, or SQLite under the state dir)."""

    uri: str = Field(default="", description="MLflow tracking URI, e.g. http://mlflow:5000")

    def configure(self, recipe: Recipe) -> Recipe:
        recipe = recipe.model_copy(deep=True)
        if self.uri:
            recipe.tracking.uri = self.uri
        return recipe

    def tracker(self, recipe: Recipe):
        from factory.recording.tracking import RunTracker

        return RunTracker(self.uri or recipe.tracking.uri, recipe.tracking.experiment)

    def find_run(self, recipe: Recipe, run_name: str) -> str | None:
        """The MLflow run id of RL run `run_name`, or None when tracking is off or it never started."""
        if not recipe.tracking.enabled:
            return None
        return self.tracker(recipe).find_run(run_name)


class RayResource(dg.ConfigurableResource):
    """Where runs get their Ray. Empty address: the profile's (embedded: a local Ray per run on 127.0.0.1)."""

    address: str = Field(default="", description="a Ray cluster (head:6379 or auto); empty: the profile's")

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Point `factory.runtime.cluster.local_ray` at the cluster (it reads RAY_ADDRESS) for one call."""
        if not self.address:
            yield
            return
        before = os.environ.get("RAY_ADDRESS")
        os.environ["RAY_ADDRESS"] = self.address
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = before


class ProgressResource(dg.ConfigurableResource):
    """How runs report progress: always to the Dagster event log; with `live`, also as rich bars on
    the terminal of the process executing them (`python -m assets materialize` sets it)."""

    live: bool = Field(default=False, description="draw live progress bars on this process's terminal")

    @contextlib.contextmanager
    def bars(self, total_steps: int) -> Iterator[RunProgress | None]:
        """A `factory.support.progress.RunProgress` for a run of `total_steps` steps, or None unless live."""
        if not self.live:
            yield None
            return
        from factory.support.progress import RunProgress

        with RunProgress(total_steps) as progress:
            yield progress


def resources_for() -> dict[str, dg.ConfigurableResource]:
    """The resources of the code location, after loading the profile ($FACTORY_PROFILE, one line
    naming what to fix when it is wrong or its env file is missing)."""
    from factory.support import profile

    profile.activate()
    return {"lake": LakeResource(), "tracking": TrackingResource(), "ray": RayResource(),
            "progress": ProgressResource()}
