"""Rollout routing replay (R3) for mixture-of-experts policies, on the trainer's side.

A mixture-of-experts layer's router picks each token's top-k experts. The engine (bf16, its own
kernels) and the trainer (fp32 or autocast) compute the router's logits slightly differently, so on
near-ties they pick different experts, and the trainer then scores a sampled token with another
network than the one that produced it: the logprob gap between them is far larger than a dense
model's. With replay, the trainer's forward routes every sampled token through the experts the
engine recorded for it, and the gate weights still come from the trainer's own router (softmax of its
logits at the recorded experts), so the router keeps learning.

Alignment: `Sample.routed_experts[j]` is the routing (per MoE layer, the top-k expert ids) at the input
position whose logits produced completion token j, i.e. position `len(prompt_ids) + j - 1`. Prompt
positions and tokens the engine did not sample (tool results, `[]`) follow the trainer's router.

Routers are found by shape, not by model name: transformers 5's MoE blocks call a `...TopKRouter`
module returning `(router_logits, top-k weights, top-k indices)` (Qwen3-MoE, Qwen2-MoE, Mixtral,
OLMoE...). A forward hook replaces the last two where the routing is recorded. The same hook measures
the router's agreement with the engine, the experts' load and, when asked, the load-balancing loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

UNKNOWN = -1  # an expert id no row holds: a position the engine did not record


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of `model`, in layer order (empty for a dense model)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def routing_tensor(samples: list, width: int) -> torch.Tensor | None:
    """[B, width, layers, k] expert ids per input position (UNKNOWN where not recorded), from each
    sample's `routed_experts`; None when no sample carries any."""
    first = next((r for s in samples for r in s.routed_experts if r), None)
    if first is None:
        return None
    layers, k = len(first), len(first[0])
    out = torch.full((len(samples), width, layers, k), UNKNOWN, dtype=torch.long)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        for j, experts in enumerate(s.routed_experts):
            if experts:
                if len(experts) != layers or any(len(e) != k for e in experts):
                    raise ValueError(f"sample {s.sample_id}: token {j}'s routing is not {layers} layers x {k} experts")
                out[i, p + j - 1] = torch.tensor(experts)
    return out


@dataclass
class LayerStats:
    """One router's last forward: sampled tokens compared and agreed, tokens per expert, its aux loss."""

    agreed: torch.Tensor | int = 0  # kept on the device until read: no sync per layer in the forward
    compared: torch.Tensor | int = 0
    load: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


@dataclass
class RoutingReplay:
    """Forward hooks on a model's routers. Set the step's routing with `set(routing, valid)` before a
    forward (`routing` None: the trainer's own router everywhere); it stays set through the backward
    pass, so activation checkpointing recomputes the same routes. `replay=False` only measures."""

    routers: list[torch.nn.Module]
    replay: bool = True
    aux_loss: bool = False
    routing: torch.Tensor | None = None  # [N, layers, k]
    valid: torch.Tensor | None = None  # [N] bool: real tokens (not padding)
    stats: dict[int, LayerStats] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    @classmethod
    def install(cls, model: torch.nn.Module, replay: bool = True, aux_loss: bool = False) -> RoutingReplay | None:
        """Hooks on every router of `model`; None for a dense model."""
        routers = moe_routers(model)
        if not routers:
            return None
        self = cls(routers, replay, aux_loss)
        for layer, router in enumerate(routers):
            self.handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def rehook(self, copy: torch.nn.Module) -> RoutingReplay | None:
        """Hooks of the same kind on `copy`, a deep copy of the hooked model (whose routers' copied hooks
        still call this object: they are dropped)."""
        for router in moe_routers(copy):
            router._forward_hooks.clear()
        return RoutingReplay.install(copy, self.replay, self.aux_loss)

    def set(self, routing: torch.Tensor | None, attention_mask: torch.Tensor) -> None:
        """The next forward's routing ([B, L, layers, k] or None) and its real positions ([B, L])."""
        if routing is not None and routing.shape[2] != len(self.routers):
            raise ValueError(f"recorded routing has {routing.shape[2]} MoE layers, the policy {len(self.routers)}")
        self.routing = None if routing is None else routing.flatten(0, 1)
        self.valid = attention_mask.flatten().bool()
        self.stats = {}

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, weights, indices = output
            chosen = indices
            rec = self.routing[:, layer] if self.routing is not None else None
            if rec is not None:
                if rec.shape[0] != indices.shape[0]:
                    raise ValueError(f"routing for {rec.shape[0]} positions, router saw {indices.shape[0]}")
                rec = rec.to(indices.device)
                known = (rec >= 0).all(-1)
                agree = (rec.sort(-1).values == indices.sort(-1).values).all(-1) & known
                if self.replay:
                    chosen = torch.where(known[:, None], rec, indices)
            probs = torch.softmax(logits.float(), dim=-1)
            stats = LayerStats()
            if rec is not None:
                stats.agreed, stats.compared = agree.sum(), known.sum()
            valid = self.valid.to(indices.device) if self.valid is not None and self.valid.numel() == indices.shape[0] else None
            used = chosen if valid is None else chosen[valid]
            stats.load = torch.bincount(used.flatten(), minlength=probs.shape[-1]).detach()
            if self.aux_loss:
                stats.aux_loss = load_balancing_loss(probs if valid is None else probs[valid], used, probs.shape[-1])
            self.stats[layer] = stats
            if chosen is indices:
                return None
            top = probs.gather(-1, chosen)
            if getattr(module, "norm_topk_prob", True):
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(weights.dtype), chosen
        return hook

    def aux(self) -> torch.Tensor | None:
        """The last forward's load-balancing loss, averaged over layers (None unless asked)."""
        losses = [s.aux_loss for s in self.stats.values() if s.aux_loss is not None]
        return torch.stack(losses).mean() if losses else None

    def metrics(self) -> dict[str, float]:
        """train/router_agreement (sampled tokens whose trainer top-k is the engine's, before replay),
        train/expert_load (normalised entropy of tokens over experts, 1 = even, mean over layers) and
        train/expert_load_max (the busiest expert's share x experts, 1 = even)."""
        if not self.stats:
            return {}
        out: dict[str, float] = {}
        agreed, compared = self.counts()
        if compared:
            out["train/router_agreement"] = agreed / compared
        entropies, peaks = [], []
        for s in self.stats.values():
            if s.load is None or not s.load.sum():
                continue
            share = s.load.float().cpu() / s.load.sum().cpu()
            n = share.numel()
            entropies.append(float(-(share * share.clamp_min(1e-12).log()).sum() / torch.log(torch.tensor(float(n)))))
            peaks.append(float(share.max() * n))
        if entropies:
            out["train/expert_load"] = sum(entropies) / len(entropies)
            out["train/expert_load_max"] = sum(peaks) / len(peaks)
        return out

    def counts(self) -> tuple[float, float]:
        """(agreed, compared) sampled tokens over every layer of the last forward."""
        return (sum(float(s.agreed) for s in self.stats.values()), sum(float(s.compared) for s in self.stats.values()))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """Switch-style auxiliary loss: experts x sum_e (share of routed slots to e) x (mean router prob
    of e); 1.0 when the load is even, larger when it piles up on a few."""
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    share = torch.bincount(chosen.flatten(), minlength=experts).to(probs.dtype) / chosen.numel()
    return experts * (share * probs.mean(0)).sum()


def mixture_of_experts(model_dir) -> bool:
    """Whether the Hugging Face model in `model_dir` routes tokens to experts (its config names them)."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return any(config.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def wants_replay(recipe, model_dir) -> bool:
    """Whether a run of `recipe` on the policy in `model_dir` has its engines record each sampled token's
    experts: `algorithm.routing_replay: rollout`, or unset with a mixture-of-experts policy."""
    wanted = recipe.algorithm.routing_replay
    return wanted == "rollout" or (wanted is None and mixture_of_experts(model_dir))
