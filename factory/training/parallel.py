"""How the trainer spreads a step over micro-batches and ranks, and how a model is sharded.

Pure planning (which samples go to which rank and micro-batch) plus the torch.distributed pieces
the trainer needs: forming the trainer ranks' process group, applying FSDP2 per decoder block and
then at the root (torchtitan's `parallelize`), and gathering full weights one tensor at a time.
No Ray here (`factory/runtime/` places the ranks), no algorithm (`factory/algo/`).

FSDP2 on CPU runs with gloo and is tested here (2 ranks against 1); on CUDA the same code runs with
NCCL, which no machine of this project has: untested here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch


class TrainerSetupError(ValueError):
    """A recipe or checkpoint the sharded trainer cannot run (a user error: one line, no traceback)."""


# ---------------------------------------------------------------- planning (pure)

def balanced_shards(lengths: list[int], ranks: int) -> list[list[int]]:
    """Sample indices per rank, balanced by tokens: longest first, each to the rank with the fewest
    tokens so far (each shard comes out longest-first)."""
    shards: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda k: (loads[k], k))
        shards[r].append(i)
        loads[r] += lengths[i]
    return shards


def plan_micro_batches(lengths: list[int], ranks: int = 1, budget_tokens: int = 0) -> list[list[list[int]]]:
    """Sample indices per rank, per micro-batch: `plan[r][m]` is rank r's m-th micro-batch.

    Ranks get samples balanced by tokens (longest first, each to the rank with the fewest tokens so
    far). Within a rank, samples sorted by length fill a micro-batch while its padded cost — rows ×
    the longest row — stays within `budget_tokens`, so similar lengths share a micro-batch and
    little is padding. A sample longer than the budget gets a micro-batch of its own. With one rank
    and a batch that fits (or budget 0: no limit) the plan is the batch as it came, in its order.
    """
    n = len(lengths)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if ranks == 1 and (budget_tokens <= 0 or n * max(lengths, default=0) <= budget_tokens):
        return [[list(range(n))]] if n else [[]]
    plan: list[list[list[int]]] = []
    for shard in balanced_shards(lengths, ranks):  # each shard is already longest-first
        micro: list[list[int]] = []
        for i in shard:
            if micro and budget_tokens > 0 and (len(micro[-1]) + 1) * lengths[micro[-1][0]] > budget_tokens:
                micro.append([])
            if not micro:
                micro.append([])
            micro[-1].append(i)
        plan.append(micro)
    return plan


def plan_packed_rows(lengths: list[int], ranks: int = 1, budget_tokens: int = 0) -> list[list[list[int]]]:
    """Sample indices per rank, per packed row: `plan[r][m]` is rank r's m-th micro-batch, one row in
    which its samples sit end to end (positions restarting per sample, attention confined to each).

    Ranks get samples balanced by tokens as in `plan_micro_batches`. Within a rank, first-fit
    decreasing: each sample, longest first, goes into the first row it still fits in (rows hold at most
    `budget_tokens`; a sample longer than that gets a row of its own; budget 0: no limit, one row).
    A row is as long as its samples together, so nothing is padding."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    plan: list[list[list[int]]] = []
    for shard in balanced_shards(lengths, ranks):
        rows = first_fit([lengths[i] for i in shard], budget_tokens)
        plan.append([[shard[k] for k in row] for row in rows])
    return plan


def first_fit(lengths: list[int], capacity: int, max_rows: int = 0) -> list[list[int]]:
    """Rows of local indices: each of `lengths`, in order, goes into the first row whose tokens stay
    within `capacity` (0: no limit), else into a new row (at most `max_rows`, 0: no limit; a sample
    that then fits nowhere is left out, one longer than `capacity` gets a row of its own)."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i, n in enumerate(lengths):
        slot = next((k for k, used in enumerate(fill) if capacity <= 0 or used + n <= capacity), None)
        if slot is None:
            if max_rows and len(rows) >= max_rows:
                continue
            rows.append([])
            fill.append(0)
            slot = len(rows) - 1
        rows[slot].append(i)
        fill[slot] += n
    return rows


def row_layout(lengths: list[int], max_rows: int = 0) -> list[list[int]]:
    """A micro-batch's samples (`lengths`, longest first) packed first-fit into rows as wide as its
    longest sample (`first_fit`; at most `max_rows`, 0: no limit). Rows of local indices."""
    return first_fit(lengths, max(lengths, default=0), max_rows)


def plan_row_packs(lengths: list[int], ranks: int = 1, budget_tokens: int = 0) -> list[list[list[int]]]:
    """Sample indices per rank, per micro-batch, for packing into several rows per micro-batch
    (`row_layout`): where attention builds a dense mask per row (sdpa, eager), one long packed row
    costs row² while rows as wide as the micro-batch's longest sample cost no more than the padded
    rows they replace, and hold several short samples each.

    Ranks get samples balanced by tokens as in `plan_micro_batches`. Within a rank, longest first: a
    micro-batch is as wide as the longest sample left and holds as many rows as `budget_tokens` allows
    (rows × width, as a padded micro-batch; at least one row; budget 0: no limit), filled first-fit by
    every sample left that fits; the rest go to the next micro-batch. Each micro-batch lists its samples
    longest first, so `row_layout` of their lengths gives back its rows."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    plan: list[list[list[int]]] = []
    for shard in balanced_shards(lengths, ranks):  # longest first
        micro: list[list[int]] = []
        left = list(shard)
        while left:
            width = lengths[left[0]]
            max_rows = max(1, budget_tokens // max(width, 1)) if budget_tokens > 0 else 0
            rows = row_layout([lengths[i] for i in left], max_rows)
            taken = sorted(k for row in rows for k in row)  # positions in `left`: still longest first
            micro.append([left[k] for k in taken])
            chosen = set(taken)
            left = [i for k, i in enumerate(left) if k not in chosen]
        plan.append(micro)
    return plan


def padding_share(plan: list[list[list[int]]], lengths: list[int], packed: bool | str = False) -> float:
    """Share of the token positions the forward passes compute that are padding: a micro-batch
    computes rows × its longest row, a packed row (`packed` True) its samples' tokens and nothing more,
    rows of packed samples (`packed` "rows": `plan_row_packs`) their number × the longest sample."""
    if packed is True:
        return 0.0
    if packed == "rows":
        computed = sum(len(row_layout([lengths[i] for i in mb])) * max(lengths[i] for i in mb)
                       for shard in plan for mb in shard if mb)
    else:
        computed = sum(len(mb) * max(lengths[i] for i in mb) for shard in plan for mb in shard if mb)
    real = sum(lengths[i] for shard in plan for mb in shard for i in mb)
    return 1.0 - real / computed if computed else 0.0


# ---------------------------------------------------------------- the trainer ranks' process group

def init_trainer_group(rank: int, world_size: int, host: str, port: int, backend: str, local_host: str,
                       store=None, timeout_s: float = 600.0) -> None:
    """Join the trainer ranks' default process group: rank 0 hosts the store (`store`, from
    `factory.model.weightsync.open_rendezvous` on its node's address), the others connect to host:port.
    `local_host`: this rank's node address; gloo and NCCL pick their interface from environment
    variables, set here to the one carrying it (the hostname may resolve to loopback)."""
    import torch.distributed as dist

    from factory.model.weightsync import interface_of

    if dist.is_initialized():
        return
    iface = interface_of(local_host)
    if iface and local_host not in ("127.0.0.1", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=dist.PrefixStore("factory-trainer", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


# ---------------------------------------------------------------- sharding

def decoder_blocks(model) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (PEFT-wrapped or not): FSDP's units."""
    body = model.get_decoder()
    blocks = getattr(body, "layers", None)
    if blocks is None:
        raise TrainerSetupError(f"train.ranks: {type(model).__name__} has no decoder `layers` to shard (FSDP2 "
                                "wraps each repeated block); use train.ranks=1 for this model")
    return list(blocks)


def parallelize(root: torch.nn.Module, model, world_size: int, device: str, bf16: bool) -> None:
    """FSDP2 over `world_size` ranks: each decoder block of `model` is its own unit, then `root` (the
    module whose forward the trainer calls, holding embeddings, final norm and output layer). With
    `bf16`, parameters are gathered and computed in bf16 while the sharded masters, their gradients'
    reduction and the optimizer stay fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(root, mesh=mesh, mp_policy=mp)


def full_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor whole, one at a time: a sharded (DTensor) one is all-gathered — a collective, so
    every rank must walk the same names in the same order; plain tensors pass through."""
    from torch.distributed.tensor import DTensor

    for name, t in named:
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum `values` over the trainer ranks (identity without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def step_metrics_merge(parts: list[dict[str, Any]], weight_key: str = "train/objective_weight") -> dict[str, float]:
    """One step's metrics from those of its micro-batches or ranks: `*max*` keys by max, `perf/` keys
    by max (the slowest part bounds the step), `weight_key` summed, everything else a mean weighted
    by `weight_key` (the aggregation's denominator, so `train/loss` is the whole batch's loss)."""
    if len(parts) == 1:
        return dict(parts[0])
    weights = [float(p.get(weight_key, 0.0)) for p in parts]
    total = sum(weights)
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        vals = [(float(p[key]), w) for p, w in zip(parts, weights) if key in p]
        if key == weight_key:
            out[key] = total
        elif "max" in key or key.startswith("perf/"):
            out[key] = max(v for v, _ in vals)
        elif all(v == vals[0][0] for v, _ in vals):
            out[key] = vals[0][0]
        else:
            wsum = sum(w for _, w in vals)
            out[key] = sum(v * w for v, w in vals) / wsum if wsum else sum(v for v, _ in vals) / len(vals)
    return out
