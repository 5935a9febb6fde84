"""Moving the trainer's weights into the rollout engines, wherever each of them runs.

Every path goes over the network: the broadcast over a collective whose rendezvous listens on the
trainer's node address, and the `disk` / `lora` modes as bundles through Ray's object store (each
engine's node pulls the bytes from the trainer's and writes them to a directory of its own).
"""

from __future__ import annotations

import time

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


def load_bundle(engines, bundle, kind: str = "disk") -> None:
    """Load a DirBundle (or an ObjectRef to one) into every engine: each engine's node fetches it."""
    ray.get([e.load_bundle.remote(bundle, kind) for e in engines])


def publish_weights(engines, trainer, version: int, mode: str, timeout_s: float | None = None) -> dict[str, float]:
    """Drain the engines, move the trainer's weights into them, and open them at `version`, all within
    `timeout_s` (`deadlines.weight_sync_s`; None: no limit).

    Returns the seconds of each phase and the bytes sent per engine under `weightsync/…` names."""
    get = Deadline(timeout_s, f"weight sync of version {version} ({mode})", "deadlines.weight_sync_s",
                   "an engine did not drain, receive or reopen").get if timeout_s else ray.get
    t0 = time.perf_counter()
    get([e.begin_update.remote() for e in engines])
    t1 = time.perf_counter()
    if mode == "broadcast":
        sent = get([trainer.broadcast.remote()] + [e.receive_broadcast.remote() for e in engines])[0]
    else:  # disk: a whole HF model dir; lora: the adapter alone (loaded in place)
        bundle, nbytes = trainer.export_weights.options(num_returns=2).remote(mode)
        # the engines' nodes pull the bundle from the trainer's
        get([e.load_bundle.remote(bundle, mode) for e in engines])
        sent = get(nbytes)
    t2 = time.perf_counter()
    get([e.end_update.remote(version) for e in engines])
    t3 = time.perf_counter()
    return {"weightsync/seconds": t3 - t0, "weightsync/drain_s": t1 - t0, "weightsync/transfer_s": t2 - t1,
            "weightsync/reopen_s": t3 - t2, "weightsync/bytes": float(sent)}


def engine_metrics(engines) -> dict[str, float]:
    """The engines' counters, summed over engines (versions: the lowest)."""
    out: dict[str, float] = {}
    for m in ray.get([e.metrics.remote() for e in engines]):
        for k, v in m.items():
            out[k] = min(out.get(k, v), v) if k.endswith("_version") else out.get(k, 0.0) + v
    return out
