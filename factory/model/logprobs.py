"""Token logprobs of completions under a causal LM, from Samples: what the trainer optimises and what
a scorer (e.g. a distillation teacher, factory/scoring.py) grades with. Shared here so neither of
those imports the other."""

from __future__ import annotations

from typing import Any

import torch

from factory.types import NOT_SAMPLED, Sample


def pad_samples(samples: list[Sample], pad_id: int) -> dict[str, Any]:
    """Right-padded [B, L] inputs plus completion-aligned [B, T] behaviour logprobs, mask and
    versions (NOT_SAMPLED at padding), [B] truncation flags and [B] sampled-token counts; `t_max`: T, an int."""
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    t_max = max(len(s.completion_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    old_logp = torch.zeros((n, t_max))
    mask = torch.zeros((n, t_max))
    versions = torch.full((n, t_max), NOT_SAMPLED, dtype=torch.long)
    prompt_lens = []
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        t = len(s.completion_ids)
        old_logp[i, :t] = torch.tensor(s.logprobs, dtype=torch.float32)
        mask[i, :t] = torch.tensor(s.loss_mask, dtype=torch.float32)
        versions[i, :t] = torch.tensor(s.versions, dtype=torch.long)
        prompt_lens.append(len(s.prompt_ids))
    out = {"input_ids": ids, "attention_mask": attn, "old_logp": old_logp, "mask": mask,
           "prompt_lens": torch.tensor(prompt_lens), "t_max": t_max, "versions": versions,
           "truncated": torch.tensor([s.finish_reason == "length" for s in samples]),
           "sampled_lens": torch.tensor([sum(s.loss_mask) for s in samples])}
    k_max = max((len(c) for s in samples for c in s.support), default=0)
    if k_max:  # the sampler's candidate sets, [B, T, K] ids padded with -1 (all -1: unknown)
        support = torch.full((n, t_max, k_max), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            for j, cands in enumerate(s.support):
                if cands:
                    support[i, j, : len(cands)] = torch.tensor(cands)
        out["support"] = support
    return out


def completion_logprobs(model, tensors: dict[str, Any], temperature: float = 1.0) -> torch.Tensor:
    """[B, T] logprob of each completion token under `model` (logits / temperature).

    Keep-sampling mask: where `tensors["support"]` names the candidate set S_t the sampler drew
    token y_t from (top-k/top-p survivors), the policy is renormalised over that same set,

        log pi_S(y_t) = z_t[y_t] - logsumexp_{s in S_t} z_t[s],

    which is what the engine's processed logprob is — so behaviour and trained policy share a
    support and their ratio is not biased by the mass top-k/top-p cut off. Unknown sets ([] when
    recorded) fall back to the full softmax.
    """
    logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
    logits = logits.float() / temperature
    ids = tensors["input_ids"]
    n, t_max = ids.shape[0], tensors["t_max"]
    # token j of the completion sits at position p+j and is predicted by the logits at p+j-1
    pos = tensors["prompt_lens"][:, None] + torch.arange(t_max, device=ids.device)[None, :] - 1
    pos = pos.clamp(max=ids.shape[1] - 2)
    rows = torch.arange(n, device=ids.device)[:, None]
    targets = ids[rows, pos + 1]
    step_logits = logits[rows, pos]  # [B, T, V]
    chosen = step_logits.gather(-1, targets[..., None]).squeeze(-1)
    log_z = torch.logsumexp(step_logits, dim=-1)
    support = tensors.get("support")
    if support is not None:
        known = support >= 0
        cand = step_logits.gather(-1, support.clamp(min=0))
        # a large finite floor, not -inf: a row with no known candidate must not put NaN in the gradient
        masked_z = torch.logsumexp(torch.where(known, cand, torch.full_like(cand, -1e9)), dim=-1)
        log_z = torch.where(known.any(-1), masked_z, log_z)
    return chosen - log_z


def to_device(tensors: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
