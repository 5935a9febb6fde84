"""The actors that hold a model on the training side: the trainer (one rank of it) and the scoring phase's teacher."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from factory.runtime.actor_base import Placed
from factory.runtime.transfer import DirBundle, local_dir, node_ip
from factory.core.types import Batch

if TYPE_CHECKING:

    from factory.training.trainer import Trainer
    from factory.model.weightsync import BucketPlan, WeightBroadcaster


def _trainer(*args, **kwargs) -> Trainer:
    from factory.training.trainer import Trainer

    return Trainer(*args, **kwargs)


@ray.remote(num_cpus=0)
class TrainerActor(Placed):
    """The trainer on its node: one rank of `world_size` (`TrainerGroup` drives several as one). Rank
    0 owns the weight broadcast into the engines; every rank takes part in each call (the gathers of
    sharded weights are collectives), and the others' results are dropped. `model`: a DirBundle or a
    path on this node. Nothing it writes is read by path elsewhere: weights, adapters and checkpoints
    leave it as DirBundles."""

    def __init__(self, model: str | DirBundle, algorithm, train, rollout, shape: dict | None = None,
                 rank: int = 0, world_size: int = 1):
        self._build(model, algorithm, train, rollout, shape, rank, world_size)

    def _build(self, model, algorithm, train, rollout, shape, rank: int, world_size: int) -> None:
        self.args = (local_dir(model, "trainer model"), algorithm, train, rollout, shape)
        self.rank, self.world_size = rank, world_size
        self._store = None
        self.trainer: Trainer = _trainer(*self.args) if world_size == 1 else None  # type: ignore[assignment]  # set by join
        self.warm_up_s = 0.0
        self.bucket_bytes = rollout.bucket_mb << 20
        self.broadcaster: WeightBroadcaster | None = None
        self.plan: BucketPlan | None = None

    def release(self) -> bool:
        """The run's end for a process kept for the next run (factory/runtime/warm.py): its trainer, weight
        group and bucket plan dropped, their memory freed; whether it may be kept (a one-rank CPU trainer: a
        CUDA process keeps its context and allocator, and that path has not run here, so it ends with its run)."""
        import gc

        keep = self.world_size == 1 and self.trainer is not None and self.trainer.device.type == "cpu"
        if self.broadcaster is not None:
            try:
                self.broadcaster.wait()
            except RuntimeError:  # the run's last broadcast failed: nothing of it is kept
                pass
        self.trainer = self.broadcaster = self.plan = None  # type: ignore[assignment]
        gc.collect()
        return keep

    def rebuild(self, model: str | DirBundle, algorithm, train, rollout, shape: dict | None = None) -> None:
        """A new run's trainer (one rank) in this released process, whose imports are done: built as
        `__init__` builds it (threads, seed, model, optimizer)."""
        self._build(model, algorithm, train, rollout, shape, 0, 1)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the trainer ranks' store, listening on this node's address; (address, port)."""
        from factory.model.weightsync import open_rendezvous

        self._store, port = open_rendezvous(node_ip(), self.world_size, 600.0)
        return node_ip(), port

    def join(self, host: str, port: int) -> None:
        """Form the ranks' process group (gloo on CPU, NCCL on CUDA), then build this rank's trainer."""
        from factory.support.devices import resolve_device
        from factory.training.parallel import init_trainer_group

        backend = "nccl" if resolve_device(self.args[2].device) == "cuda" else "gloo"
        init_trainer_group(self.rank, self.world_size, host, port, backend, node_ip(), store=self._store)
        self.trainer = _trainer(*self.args, rank=self.rank, world_size=self.world_size)

    def warm_up(self) -> float:
        """`train.warm_up`: the first pass's one-time costs now (`Trainer.warm_up`); `start_trainer` sends
        it without waiting, so it runs while the engines start, and the actor's later calls queue behind it."""
        if self.args[2].warm_up:
            try:
                self.warm_up_s = self.trainer.warm_up()
            except Exception as err:  # noqa: BLE001  (nobody waits for this call: say it, train cold)
                from factory.recording.outage import first_line

                logging.getLogger(__name__).warning("trainer warm-up failed (%s: %s); step 1 pays the first "
                                                    "pass's costs", type(err).__name__, first_line(err))
        return self.warm_up_s

    def threads(self) -> int:
        return self.trainer.threads

    def settings(self) -> dict:
        """What the trainer's auto settings became (`Trainer.settings`); queued behind the warm-up."""
        return self.trainer.settings()

    def plan_json(self) -> str:
        from factory.model.weightsync import BucketPlan

        self.plan = BucketPlan.for_state(self.trainer.weight_shapes(), self.trainer.serving_dtype, self.bucket_bytes)
        return self.plan.to_json()

    def sync_backend(self, wanted: str) -> str:
        """The weight-sync collective: auto = nccl when this trainer computes on CUDA, else gloo."""
        if wanted != "auto":
            return wanted
        return "nccl" if self.trainer.device.type == "cuda" else "gloo"

    def open_broadcast(self, world_size: int, backend: str) -> tuple[str, int] | None:
        """Rank 0: start the rendezvous on this node's own address; returns (address, port) for the receivers."""
        from factory.model.weightsync import WeightBroadcaster

        if self.rank:
            return None
        self.broadcaster = WeightBroadcaster(node_ip(), world_size, backend)
        return self.broadcaster.host, self.broadcaster.port

    def join_broadcast(self) -> None:
        if self.rank:
            return
        if self.broadcaster is None:
            raise RuntimeError("join_broadcast before open_broadcast")
        self.broadcaster.connect()

    def broadcast(self) -> int:
        sent = self.stage_broadcast()
        if self.broadcaster is not None:
            self.broadcaster.wait()
        return sent

    def stage_broadcast(self) -> int:
        """Copy the weights into the staging buckets and send them from a background thread: returns at
        once (the bytes it sends), so the next train step overlaps the engines' drain and receive.
        The other ranks take part in gathering the sharded weights, bucket by bucket."""
        if self.rank:
            for _ in self.trainer.weight_items():
                pass
            return 0
        if self.broadcaster is None or self.plan is None:
            raise RuntimeError("broadcast before open_broadcast and plan_json")
        return self.broadcaster.stage(self.plan, self.trainer.weight_items())

    def export_weights(self, kind: str) -> tuple[DirBundle, int]:
        """`disk`: the policy as an HF model dir; `lora`: the adapter alone. As a bundle, and its bytes."""
        with tempfile.TemporaryDirectory(prefix="factory-export-") as tmp:
            if kind == "lora":
                self.trainer.save_adapter(tmp)
            else:
                self.trainer.save_hf(tmp)
            bundle = DirBundle.of(tmp, f"weights-{kind}")
        return bundle, bundle.nbytes

    def train_step(self, batch: Batch) -> dict[str, float]:
        return self.trainer.train_step(batch)

    def logprobs(self, samples, bf16: bool = False, replay: bool = True) -> list[list[float]]:
        return self.trainer.logprobs(samples, bf16, replay)

    def weight_checksum(self, name: str, dtype: str, accumulate: str = "float32") -> float:
        """Sum (in `accumulate`) of one weight rounded to `dtype`: what an engine serving that dtype must hold."""
        from factory.model.weightsync import DTYPES

        weight = next(t for n, t in self.trainer.weight_items() if n == name)  # every rank stops at the same name
        return float(weight.to(DTYPES[dtype]).to(DTYPES[accumulate]).sum())

    def checkpoint(self, extra: dict) -> DirBundle:
        """A checkpoint (see Trainer.save_checkpoint) as a bundle — this rank's part of it when there
        are several (`TrainerGroup` merges them); the driver writes it into the run dir."""
        with tempfile.TemporaryDirectory(prefix="factory-ckpt-") as tmp:
            self.trainer.save_checkpoint(Path(tmp) / "ckpt", extra)
            return DirBundle.of(Path(tmp) / "ckpt", "checkpoint")

    def load_checkpoint(self, checkpoint: str | DirBundle) -> dict:
        return self.trainer.load_checkpoint(local_dir(checkpoint, "checkpoint to resume from"))

    def version(self) -> int:
        return self.trainer.version

    def busy_seconds(self) -> float:
        return self.trainer.busy_s


@ray.remote(num_cpus=0)
class ScorerActor(Placed):
    """The scoring phase's model (e.g. a distillation teacher) in its own process. `teacher`: the teacher
    model as a DirBundle (shipped by the run) or a path on this node."""

    def __init__(self, distill, rollout, teacher: str | DirBundle):
        from factory.training.scoring import make_scorer

        local = local_dir(teacher, "algorithm.distill.teacher")
        scorer = make_scorer(distill.model_copy(update={"teacher": local}), rollout)
        if scorer is None:
            raise ValueError("ScorerActor: no teacher to score with (algorithm.distill.teacher)")
        self.scorer = scorer

    def score(self, batch: Batch):
        from factory.training.scoring import score_batch

        return score_batch(self.scorer, batch)
