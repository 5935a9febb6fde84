"""Moving the trainer's weights into running rollout engines.

Two paths share one layout (`BucketPlan`):

* **broadcast** — the trainer (rank 0) broadcasts the weights in packed buckets over a
  torch.distributed process group to a receiver running *inside* each vLLM worker (ranks 1..N).
  gloo on CPU (tested here); NCCL when CUDA is there (same code with `backend="nccl"` and CUDA
  tensors — not runnable on these CPU-only machines, so untested here).
* **disk** — the trainer saves safetensors and the engine reloads them from the path.

The receiver is a vLLM worker extension (`--worker-extension-cls
factory.weightsync.WeightReceiverExtension`); its methods are called through vLLM's
`POST /collective_rpc`, whose arguments must be strings, hence the JSON plans.

Why a private process group: the vLLM worker already owns a default torch.distributed group,
so both ends build their own gloo group from a TCPStore hosted by the trainer.
Why `model_runner.reload_weights`: on CPU, vLLM pre-packs linear weights, and the plain
`model.load_weights` leaves the model half-updated; reload re-packs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class BucketPlan:
    """Which named tensors travel together in each flat bucket, and their shapes."""

    dtype: str
    buckets: list[list[tuple[str, list[int]]]]

    @classmethod
    def for_state(cls, named_shapes: Iterable[tuple[str, list[int]]], dtype: str, bucket_bytes: int) -> "BucketPlan":
        itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
        buckets: list[list[tuple[str, list[int]]]] = [[]]
        size = 0
        for name, shape in named_shapes:
            nbytes = itemsize * _numel(shape)
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, list(shape)))
            size += nbytes
        return cls(dtype, [b for b in buckets if b])

    def to_json(self) -> str:
        return json.dumps({"dtype": self.dtype, "buckets": self.buckets})

    @classmethod
    def from_json(cls, text: str) -> "BucketPlan":
        d = json.loads(text)
        return cls(d["dtype"], [[(n, list(s)) for n, s in b] for b in d["buckets"]])

    def bucket_numel(self, i: int) -> int:
        return sum(_numel(s) for _, s in self.buckets[i])

    @property
    def total_bytes(self) -> int:
        itemsize = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return itemsize * sum(self.bucket_numel(i) for i in range(len(self.buckets)))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def pack_bucket(plan: BucketPlan, i: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    dtype = DTYPES[plan.dtype]
    return torch.cat([tensors[name].detach().to(dtype).reshape(-1) for name, _ in plan.buckets[i]])


def unpack_bucket(plan: BucketPlan, i: int, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for name, shape in plan.buckets[i]:
        n = _numel(shape)
        yield name, flat[offset : offset + n].view(shape)
        offset += n


def make_gloo_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 120.0):
    """A private gloo process group on loopback; rank 0 hosts the rendezvous store."""
    import torch.distributed as dist

    store = dist.TCPStore(
        host, port, world_size, is_master=(rank == 0), timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    prefixed = dist.PrefixStore("factory-weights", store)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    group = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    return group, store  # the store must outlive the group


class WeightBroadcaster:
    """Trainer side (rank 0): sends every bucket of the plan to all receivers."""

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float = 120.0):
        self.group, self._store = make_gloo_group(host, port, 0, world_size, timeout_s)

    def broadcast(self, plan: BucketPlan, tensors: dict[str, torch.Tensor]) -> int:
        sent = 0
        for i in range(len(plan.buckets)):
            flat = pack_bucket(plan, i, tensors).contiguous()
            self.group.broadcast(flat, 0).wait()
            sent += flat.numel() * flat.element_size()
        return sent


class WeightReceiverExtension:
    """Mixed into vLLM's worker class; runs in the worker process next to the model."""

    def init_weight_group(self, host: str, port: str, rank: str, world_size: str, plan_json: str) -> str:
        self._factory_group, self._factory_store = make_gloo_group(host, int(port), int(rank), int(world_size))
        self._factory_plan = BucketPlan.from_json(plan_json)
        return "ok"

    def receive_weights(self) -> str:
        plan = self._factory_plan
        dtype = DTYPES[plan.dtype]
        received = []
        for i in range(len(plan.buckets)):
            flat = torch.empty(plan.bucket_numel(i), dtype=dtype)
            self._factory_group.broadcast(flat, 0).wait()
            received.extend(unpack_bucket(plan, i, flat))
        self.model_runner.reload_weights(weights_iterator=iter(received))
        return str(len(received))

    def weight_checksum(self, name: str) -> str:
        """Sum of one parameter as the worker holds it (tests use it to see an update landed)."""
        params = dict(self.model_runner.get_model().named_parameters())
        return repr(float(params[name].float().sum()))

