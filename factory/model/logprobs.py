"""Token logprobs of completions under a causal LM, from Samples: what the trainer optimises and what
a scorer (e.g. a distillation teacher, factory/training/scoring.py) grades with. Shared here so neither of
those imports the other.

Lean by construction: the model's body runs once, then only the hidden states of completion
positions go through the output layer, `chunk_tokens` rows at a time, each chunk under activation
checkpointing (its backward recomputes the chunk's logits). A `[B, T, V]` float32 tensor never
exists: at vocabulary 151,936 and 16 × 1,024 tokens that tensor alone is 10 GB, and the naive
path held three of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from factory.core.types import NOT_SAMPLED, Sample
from factory.model.routing import routing_tensor

DEFAULT_CHUNK_TOKENS = 512


def pad_samples(samples: list[Sample], pad_id: int) -> dict[str, Any]:
    """Right-padded [B, L] inputs plus completion-aligned [B, T] behaviour logprobs, mask and
    versions (NOT_SAMPLED at padding), [B] truncation flags, [B] sampled-token counts and [B]
    completion lengths; `t_max`: T, an int."""
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
           "completion_lens": torch.tensor([len(s.completion_ids) for s in samples]),
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
    routing = routing_tensor(samples, width)
    if routing is not None:  # [B, L, MoE layers, k]: the engine's experts per input position (routing.py)
        out["routing"] = routing
    return out


def pack_tensors(tensors: dict[str, Any], rows: list[list[int]] | None = None) -> dict[str, Any]:
    """`pad_samples`' tensors with the samples packed end to end into one row: `input_ids` [1, N]
    (N: their tokens together, no padding), `position_ids` [1, N] restarting at 0 for each sample,
    `sample_starts` [B] (each sample's first position in the row) and, where recorded, `routing`
    [1, N, layers, k] packed the same way as the ids. `attention_mask` becomes [1, N] ones: it tells
    the router hooks which positions are real, and a packed forward does not pass it to the model
    (transformers 5 builds the block-diagonal causal mask from the restarting positions only when
    no 2D mask is given). The completion-aligned [B, T] tensors, and so the loss, are unchanged.
    `rows`: the samples of each of several rows instead (see `_pack_rows`)."""
    lens = tensors["attention_mask"].sum(1)
    keep = tensors["attention_mask"].bool()
    starts = torch.cumsum(lens, 0) - lens
    out = dict(tensors)
    if "completion_lens" not in out:  # tensors built by hand: every step up to the end of the row
        out["completion_lens"] = lens - tensors["prompt_lens"]
    if rows is not None:
        return _pack_rows(out, tensors, [int(n) for n in lens], rows)
    out["input_ids"] = tensors["input_ids"][keep][None]
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    out["position_ids"] = torch.cat([torch.arange(int(n)) for n in lens])[None].to(out["input_ids"].device)
    out["sample_starts"] = starts
    if "routing" in tensors:
        out["routing"] = tensors["routing"][keep][None]
    return out


def _pack_rows(out: dict[str, Any], tensors: dict[str, Any], lens: list[int], rows: list[list[int]]) -> dict[str, Any]:
    """`pack_tensors` into several rows (`rows`: each row's samples, `row_layout`): [R, W] ids, W the
    longest row; each row's samples end to end, then padding whose positions restart at 0 too (a
    sequence of its own that no sample attends to; its outputs are never read). `attention_mask` marks
    the real positions (for the router hooks; the model is not given it), `sample_rows` [B] and
    `sample_starts` [B] say where each sample sits; recorded routing is packed the same way (-1: none)."""
    ids = tensors["input_ids"]
    width = max(sum(lens[i] for i in row) for row in rows)
    packed = torch.zeros((len(rows), width), dtype=ids.dtype, device=ids.device)
    mask = torch.zeros_like(packed)
    positions = torch.zeros_like(packed)
    sample_rows = torch.zeros(len(lens), dtype=torch.long)
    sample_starts = torch.zeros(len(lens), dtype=torch.long)
    routing = tensors.get("routing")
    packed_routing = None if routing is None else torch.full(
        (len(rows), width, *routing.shape[2:]), -1, dtype=routing.dtype, device=routing.device)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = lens[i]
            packed[r, at: at + n] = ids[i, :n]
            mask[r, at: at + n] = 1
            positions[r, at: at + n] = torch.arange(n)
            if packed_routing is not None and routing is not None:
                packed_routing[r, at: at + n] = routing[i, :n]
            sample_rows[i], sample_starts[i] = r, at
            at += n
        positions[r, at:] = torch.arange(width - at)
    out.update({"input_ids": packed, "attention_mask": mask, "position_ids": positions,
                "sample_rows": sample_rows, "sample_starts": sample_starts})
    if packed_routing is not None:
        out["routing"] = packed_routing
    return out


def packing_unsupported(model) -> str | None:
    """Why `model` cannot take packed rows (None: it can). Checked, not assumed from a name: two
    short sequences packed into one row with restarting positions must give the second one's hidden
    states as it gives them alone (a model whose attention ignores the restarting positions mixes
    the two, a model without a separate body gives no hidden states to gather)."""
    body = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    if body is None or not callable(getattr(model, "get_output_embeddings", None)):
        return f"{type(model).__name__} has no separate decoder body and output layer"
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if vocab < 2:
        return f"{type(model).__name__} has no vocabulary size in its config"
    first, second = 5, 7
    ids = torch.randint(0, vocab, (1, first + second), generator=torch.Generator().manual_seed(0))
    device = next(model.parameters()).device
    ids = ids.to(device)
    pos = torch.cat([torch.arange(first), torch.arange(second)])[None].to(device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = body(input_ids=ids[:, first:], use_cache=False).last_hidden_state
            packed = body(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[:, first:]
    except Exception as e:  # noqa: BLE001 - any failure means: not packable, said in one line
        return f"{type(model).__name__} failed on a packed row ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    finally:
        model.train(training)
    gap = float((alone.float() - packed.float()).abs().max())
    scale = float(alone.float().abs().max()) or 1.0
    if gap > 1e-3 * scale:
        attn = getattr(model.config, "_attn_implementation", None)
        return (f"{type(model).__name__} (attention {attn}) does not confine attention to each packed sample: "
                f"a packed sample's hidden states differ from its own by {gap:.3g}")
    return None


def _body_and_head(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor | None = None):
    """(the last hidden states [B, L, H], the output layer) of a Hugging Face causal LM (PEFT-wrapped
    or not); a module without a separate body (a test's logit table) gives its logits and identity.
    `position_ids`: a packed row's restarting positions (then no attention mask is passed; see
    `pack_tensors`)."""
    get_body = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    body = get_body() if get_body is not None else None
    head = get_head() if get_head is not None else None
    if body is None or head is None:
        if position_ids is not None:
            raise ValueError(f"{type(model).__name__} cannot take packed rows (no separate body and output layer)")
        return model(input_ids=input_ids, attention_mask=attention_mask).logits, None
    if position_ids is not None:
        return body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state, head
    hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return hidden, head


def _chunk_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, support: torch.Tensor | None,
                    temperature: float) -> torch.Tensor:
    """log pi(y) over the full softmax, or renormalised over the recorded candidate set (see
    `completion_logprobs`), for one chunk of [N, H] hidden states.

    Why this shape: the [N, V] passes dominate a large vocabulary's step. Temperature divides the
    [N, H] hidden states before a bias-free output layer (z / T = (h / T) W^T), not the logits; and
    log_softmax's fused backward is one pass where logsumexp's is three."""
    if head is not None and getattr(head, "bias", None) is None and temperature != 1.0:
        logits = head(hidden / temperature).float()
    else:
        logits = (head(hidden) if head is not None else hidden).float()
        if temperature != 1.0:
            logits = logits / temperature
    out = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [N]
    if support is not None:
        known = support >= 0
        chosen = logits.gather(-1, targets[:, None]).squeeze(-1)
        cand = logits.gather(-1, support.clamp(min=0))
        # a large finite floor, not -inf: a row with no known candidate must not put NaN in the gradient
        masked_z = torch.logsumexp(torch.where(known, cand, torch.full_like(cand, -1e9)), dim=-1)
        out = torch.where(known.any(-1), chosen - masked_z, out)
    return out


def completion_logprobs(model, tensors: dict[str, Any], temperature: float = 1.0,
                        chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """[B, T] logprob of each completion token under `model` (logits / temperature); 0 past each
    completion's end.

    Keep-sampling mask: where `tensors["support"]` names the candidate set S_t the sampler drew
    token y_t from (top-k/top-p survivors), the policy is renormalised over that same set,

        log pi_S(y_t) = z_t[y_t] - logsumexp_{s in S_t} z_t[s],

    which is what the engine's processed logprob is — so behaviour and trained policy share a
    support and their ratio is not biased by the mass top-k/top-p cut off. Unknown sets ([] when
    recorded) fall back to the full softmax.

    Memory: the output layer sees the completion positions only, `chunk_tokens` at a time; with
    gradients on, each chunk is checkpointed, so at most one chunk's [chunk, V] logits live at once.
    """
    ids = tensors["input_ids"]
    starts = tensors.get("sample_starts")  # packed (pack_tensors): each sample in its row from its start
    hidden, head = _body_and_head(model, ids, tensors["attention_mask"],
                                  tensors.get("position_ids") if starts is not None else None)
    n, t_max = tensors["prompt_lens"].shape[0], tensors["t_max"]
    steps = torch.arange(t_max, device=ids.device)
    lens = tensors.get("completion_lens")
    if lens is None:  # callers that built tensors by hand: every step up to the end of the row
        lens = tensors["attention_mask"].sum(1) - tensors["prompt_lens"]
    rows, cols = (steps[None, :] < lens.to(ids.device)[:, None]).nonzero(as_tuple=True)
    # token j of the completion sits at position p+j and is predicted by the hidden state at p+j-1
    pos = tensors["prompt_lens"].to(ids.device)[rows] + cols - 1
    if starts is not None:
        pos = pos + starts.to(ids.device)[rows]
        sample_rows = tensors.get("sample_rows")  # several packed rows (`_pack_rows`), else all in row 0
        rows_in = sample_rows.to(ids.device)[rows] if sample_rows is not None else torch.zeros_like(rows)
    else:
        rows_in = rows
    states = hidden[rows_in, pos]  # [N, H]: the completion positions only
    targets = ids[rows_in, pos + 1]
    support = tensors.get("support")
    cand = support[rows, cols] if support is not None else None
    chunk = max(int(chunk_tokens), 1)
    recompute = torch.is_grad_enabled() and states.requires_grad
    parts = []
    for lo in range(0, states.shape[0], chunk):
        args = (head, states[lo: lo + chunk], targets[lo: lo + chunk],
                None if cand is None else cand[lo: lo + chunk], temperature)
        parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute else _chunk_logprobs(*args))
    flat = torch.cat(parts) if parts else states.new_zeros(0, dtype=torch.float32)
    out = torch.zeros((n, t_max), dtype=torch.float32, device=ids.device)
    return out.index_put((rows, cols), flat)


def to_device(tensors: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
