"""The recipe's `eval`, `failures`, `deadlines`, `lake`, `tracking` and `placement` sections."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from factory.recipe.base import Section


class EvalSection(Section):
    heldout: int = Field(1000, gt=0, description="held-out prompts per evaluation: a seeded random sample of "
                         "the held-out split (all of it when data.heldout_size is not larger)")
    seed: int = Field(0, description="seeds which held-out tasks a subset holds: the same before and after "
                      "training and in every run of the recipe")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of evaluation episodes")
    before: bool = Field(True, description="evaluate the policy the run starts from, before its first step")
    after: bool = Field(True, description="evaluate the policy after the last step")


class FailuresSection(Section):
    """When failed groups (an environment, reward or sandbox error in an episode) fail the run."""

    max_in_a_row: int = Field(20, gt=0, description="consecutive failed groups that fail the run")
    max_share: float = Field(0.5, ge=0, le=1, description="share of finished groups failed that fails the run, "
                             "once min_groups have finished")
    min_groups: int = Field(20, gt=0, description="finished groups before max_share applies")
    tracebacks: int = Field(3, ge=0, description="failures each env worker logs with their whole traceback; "
                            "after them, a count line at 2^k failures")
    max_worker_restarts: int = Field(
        3, ge=0, description="env workers and the scorer restarted within one run after their process died "
        "(a dead worker's groups are re-queued under their ids); one more death stops the run")


class DeadlinesSection(Section):
    """How long each wait of the run may take before the run fails with an error naming it."""

    batch_s: float = Field(600, gt=0, description="the trainer waiting for its next batch")
    weight_sync_s: float = Field(300, gt=0, description="one weight sync into the engines (drain, transfer, reopen)")
    engine_call_s: float = Field(300, gt=0, description="one generation request to an engine (its episode fails)")
    train_step_s: float = Field(600, gt=0, description="one trainer step (also a checkpoint save, a scoring pass)")
    evaluation_s: float = Field(1800, gt=0, description="one held-out evaluation")
    partition_s: float = Field(
        120, gt=0, description="one role unreachable from another (a network partition, a node's network "
        "restart; Ray says the actor is unavailable, not dead): calls are retried, running groups keep their "
        "leases; longer, the role counts as lost (restarted where it can be, its groups re-queued)")
    service_outage_s: float = Field(
        300, gt=0, description="one outage of the lake's catalog or object store or of MLflow: writes are retried "
        "and queued (then spilled to the run dir) while training goes on; longer stops the run")
    no_signal_warn_s: float = Field(
        60, gt=0, description="training with groups finishing but none with a reward spread (rewards not all "
        "equal, the only groups with a gradient) for this long logs a warning, repeated at most this often")
    no_signal_s: float | None = Field(
        480, ge=0, description="no reward spread for this long stops the run (below deadlines.batch_s, so with the "
        "filter on this line, not the batch's deadline, ends it), whether the zero-variance filter "
        "drops those groups (no batch comes) or trains them with advantage 0 (no policy gradient; with the filter "
        "off, not watched where equal rewards may still teach: a teacher, reinforce_pp, overlong_buffer); 0 or "
        "null: never")


class LakeSection(Section):
    enabled: bool = Field(False, description="record the run's samples, steps, evaluations and checkpoints in "
                          "Iceberg tables")
    catalog: dict[str, Any] = Field(default_factory=dict, description="PyIceberg catalog properties")
    namespace: str = Field("factory", description="the catalog namespace holding the tables (created with "
                           "them when missing)")
    commit_interval_s: float = Field(
        5.0, gt=0, description="seconds rows may wait before their table is committed (each Iceberg "
        "commit costs the run ~0.1-0.2 s of CPU; a checkpoint or the run's end commits at once)")


class TrackingSection(Section):
    enabled: bool = Field(False, description="log the run's metrics, plots and artifacts to an MLflow run")
    uri: str | None = Field(None, description="the MLflow tracking URI; unset: the profile's server, else "
                            "$MLFLOW_TRACKING_URI, else a SQLite store under the state dir")
    experiment: str = Field("factory", description="the MLflow experiment the run is logged under (created "
                            "when missing)")


Resources = dict[str, float]


class PlacementSection(Section):
    """Where each role of a run goes on a Ray cluster (`RAY_ADDRESS`), as the Ray resources its actors ask
    for: custom resources a node was started with (`ray start --resources '{"rollout": 1}'`), `node:<ip>`,
    or CPU / GPU. Empty: anywhere (a local Ray has one node). The driver runs where it is launched."""

    trainer: Resources = Field(default_factory=dict, description="the trainer actor, e.g. {trainer: 1, GPU: 1}")
    buffer: Resources = Field(default_factory=dict, description="the staleness buffer and task sampler")
    engine: Resources = Field(default_factory=dict, description="each rollout engine, e.g. {rollout: 1}")
    env_worker: Resources = Field(default_factory=dict, description="each env worker (hosts a gateway)")
    scorer: Resources = Field(default_factory=dict, description="the scoring phase's model, if any")

    @field_validator("trainer", "buffer", "engine", "env_worker", "scorer")
    @classmethod
    def _positive(cls, resources: Resources) -> Resources:
        bad = {k: v for k, v in resources.items() if v <= 0}
        if bad:
            raise ValueError(f"resource amounts must be > 0, got {bad}")
        return resources
