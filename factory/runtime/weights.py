"""Moving the trainer's weights into the rollout engines, wherever each of them runs.

Every path goes over the network: the broadcast over a collective whose rendezvous listens on the
trainer's node address, and the `disk` / `lora` modes as bundles through Ray's object store (each
engine's node pulls the bytes from the trainer's and writes them to a directory of its own).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import ray

from factory.runtime.deadlines import Deadline


def connect_broadcast(engines, trainer, backend: str = "auto") -> str:
    """Form the weight-sync group: the trainer (rank 0) listens on its node's address, each engine's
    receiver joins from its own. Returns the backend used (auto: nccl for a CUDA trainer, else gloo)."""
    backend = ray.get(trainer.sync_backend.remote(backend))
    plan = ray.get(trainer.plan_json.remote())
    world = len(engines) + 1
    host, port = ray.get(trainer.open_broadcast.remote(world, backend))
    ray.get([trainer.join_broadcast.remote()]
            + [e.init_broadcast.remote(host, port, i + 1, world, plan, backend) for i, e in enumerate(engines)])
    return backend


class WeightPublisher:
    """Moves the trainer's weights into the engines after each step.

    `publish(version)`: close the engines' admission (a request from then on waits and is sampled by
    the new weights), then start the update — the trainer copies its weights into staging buckets and
    sends them from a background thread (`broadcast`) or exports a bundle (`disk` / `lora`), and each
    engine drains, takes them and reopens in one call. With `overlap` it returns once admission is
    closed: the drain and the transfer run while the driver records the step and the trainer takes
    the next one (Ray runs the trainer's calls in order, so the next step starts after the copy).
    The next `publish` (or `finish`) first waits for the update before it, within `timeout_s`
    (`deadlines.weight_sync_s`). Without `overlap` it returns when the engines have reopened.

    What it returns describes the last completed update, under `weightsync/…` names: its seconds
    end to end and per phase (the slowest engine's), its bytes, and `weightsync/blocked_s`, how long
    this call held the driver."""

    def __init__(self, engines, trainer, mode: str, timeout_s: float | None = None, overlap: bool = True,
                 poll: Callable[[], bool] | None = None):
        self.engines, self.trainer, self.mode, self.timeout_s, self.overlap = engines, trainer, mode, timeout_s, overlap
        self.poll = poll  # called while waiting; the run's supervisor raises from it when an engine is lost
        self._pending: tuple | None = None  # (version, engine refs, bytes ref, start time)

    def _get(self, refs, version: int):
        return Deadline(self.timeout_s or float("inf"), f"weight sync of version {version} ({self.mode})",
                        "deadlines.weight_sync_s", "an engine did not drain, receive or reopen").get(refs, self.poll)

    def abandon(self) -> None:
        """Forget the update under way: an engine it waits on was lost (the supervisor then gives every
        engine the current weights itself). Its results are still awaited, off the loop, so that a
        failed update is not reported again as an unhandled error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            threading.Thread(target=_settle, args=([*pending[1], pending[2]],), name="factory-abandoned-sync",
                             daemon=True).start()

    def failure(self) -> BaseException | None:
        """The error of the update under way once it has failed; None while it runs, or once it
        succeeded. Polled while the loop waits for a batch: a failed update leaves the engines closed
        (no new request is admitted), so the batch would never come."""
        if self._pending is None:
            return None
        refs = [*self._pending[1], self._pending[2]]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception as err:  # noqa: BLE001  (handed to the caller, which recovers)
                return err
        return None

    def _collect(self) -> dict[str, float]:
        if self._pending is None:
            return {}
        version, updates, nbytes, t0 = self._pending
        self._pending = None
        phases = self._get(updates, version)
        sent = self._get(nbytes, version)
        out = {f"weightsync/{k}": max(p[k] for p in phases) for k in ("drain_s", "transfer_s", "reopen_s")}
        out["weightsync/seconds"] = time.perf_counter() - t0 if not self.overlap else sum(out.values())
        out["weightsync/bytes"] = float(sent)
        return out

    def publish(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        done = self._collect()
        self._get([e.close_admission.remote() for e in self.engines], version)
        if self.mode == "broadcast":
            nbytes, bundle = self.trainer.stage_broadcast.remote(), None
        else:  # disk: a whole HF model dir; lora: the adapter alone (loaded in place); each engine's node pulls it
            bundle, nbytes = self.trainer.export_weights.options(num_returns=2).remote(self.mode)
        self._pending = (version, [e.update.remote(version, self.mode, bundle) for e in self.engines], nbytes,
                         time.perf_counter())
        if not self.overlap:
            done = self._collect()
        return {**done, "weightsync/blocked_s": time.perf_counter() - t0}

    def finish(self) -> dict[str, float]:
        """Wait for the update under way (before evaluating, stopping, or handing the engines on)."""
        t0 = time.perf_counter()
        done = self._collect()
        return {**done, "weightsync/blocked_s": time.perf_counter() - t0}


def _settle(refs, timeout_s: float = 600) -> None:
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception:  # noqa: BLE001  (the loss is being recovered from)
            pass


def publish_weights(engines, trainer, version: int, mode: str, timeout_s: float | None = None) -> dict[str, float]:
    """Drain the engines, move the trainer's weights into them and open them at `version`, all within
    `timeout_s` (`deadlines.weight_sync_s`; None: no limit); returns when they have reopened.

    Returns the seconds of each phase and the bytes sent per engine under `weightsync/…` names."""
    return WeightPublisher(engines, trainer, mode, timeout_s, overlap=False).publish(version)


def engine_metrics(engines) -> dict[str, float]:
    """The engines' counters, summed over engines (versions: the lowest); an engine whose actor died is left out."""
    out: dict[str, float] = {}
    for ref in [e.metrics.remote() for e in engines]:
        try:
            m = ray.get(ref, timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # lost or unreachable: the
            continue  # supervisor restarts a lost one at the loop's next wait
        for k, v in m.items():
            out[k] = min(out.get(k, v), v) if k.endswith("_version") else out.get(k, 0.0) + v
    return out
