"""Ray actors: thin wrappers that put engines, env workers, the buffer and the trainer in processes.
No RL logic lives in them; every method forwards to a plain component. Each lives in a module of its
own; this one names them all in one place.
"""

from __future__ import annotations

from factory.runtime.actor_base import Placed, placed
from factory.runtime.buffer_actor import BufferActor
from factory.runtime.engine_actor import EngineActor, EngineLost, RemoteEngine, WeightGroupChanged, engine_lost
from factory.runtime.env_worker import EnvWorkerActor
from factory.runtime.trainer_actor import ScorerActor, TrainerActor

__all__ = ["BufferActor", "EngineActor", "EngineLost", "EnvWorkerActor", "Placed", "RemoteEngine", "ScorerActor",
           "TrainerActor", "WeightGroupChanged", "engine_lost", "placed"]
