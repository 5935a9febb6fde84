"""The trainer: fresh logprobs -> registry loss -> AdamW step; checkpoints; weights for sync.

It knows no algorithm: the advantage estimator and the policy loss are looked up by the names in
the recipe's `algorithm` section. It knows no runtime either: `runtime/` wraps it in a Ray actor.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from factory.algo import ADVANTAGES, POLICY_LOSSES, LossConfig, aggregate, kl_penalty
from factory.types import Batch, Sample


def pad_samples(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [B, L] inputs plus completion-aligned [B, T] behaviour logprobs and mask."""
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    t_max = max(len(s.completion_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    old_logp = torch.zeros((n, t_max))
    mask = torch.zeros((n, t_max))
    prompt_lens = []
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        t = len(s.completion_ids)
        old_logp[i, :t] = torch.tensor(s.logprobs, dtype=torch.float32)
        mask[i, :t] = torch.tensor(s.loss_mask, dtype=torch.float32)
        prompt_lens.append(len(s.prompt_ids))
    out = {"input_ids": ids, "attention_mask": attn, "old_logp": old_logp, "mask": mask,
           "prompt_lens": torch.tensor(prompt_lens), "t_max": t_max}
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
    pos = tensors["prompt_lens"][:, None] + torch.arange(t_max)[None, :] - 1
    pos = pos.clamp(max=ids.shape[1] - 2)
    rows = torch.arange(n)[:, None]
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


class Trainer:
    def __init__(self, model_path: str, algorithm, train, rollout):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(train.threads)
        torch.manual_seed(train.seed)
        self.algorithm = algorithm
        self.train_cfg = train
        self.temperature = rollout.temperature
        self.serving_dtype = rollout.dtype
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.ref_model = None
        if algorithm.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
            self.ref_model.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.lr, weight_decay=train.weight_decay, betas=tuple(train.betas)
        )
        self.loss_cfg = LossConfig(
            clip_low=algorithm.clip_low, clip_high=algorithm.clip_high,
            aggregation=algorithm.aggregation, max_tokens=rollout.max_new_tokens,
        )
        self.version = 0
        self.busy_s = 0.0

    # ---- one optimizer step ------------------------------------------------------------------

    def advantages(self, batch: Batch) -> torch.Tensor:
        """Per-sample advantages, estimated within each group (groups may differ in size)."""
        estimator = ADVANTAGES[self.algorithm.advantage]
        parts = [estimator(torch.tensor([g.rewards], dtype=torch.float32))[0] for g in batch.groups]
        return torch.cat(parts)

    def train_step(self, batch: Batch) -> dict[str, float]:
        t0 = time.perf_counter()
        samples = batch.samples
        adv = self.advantages(batch)
        tensors = pad_samples(samples, self.tokenizer.pad_token_id)
        mask = tensors["mask"]
        logp = completion_logprobs(self.model, tensors, self.temperature)
        loss_fn = POLICY_LOSSES[self.algorithm.loss]
        loss, metrics = loss_fn(logp, tensors["old_logp"], adv, mask, self.loss_cfg)
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp = completion_logprobs(self.ref_model, tensors, self.temperature)
            kl = aggregate(kl_penalty(logp, ref_logp, self.algorithm.kl_estimator), mask, self.algorithm.aggregation,
                           self.loss_cfg.max_tokens)
            loss = loss + self.algorithm.kl_coef * kl
            metrics["kl_ref"] = float(kl.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg.grad_clip)
        self.optimizer.step()
        self.version += 1

        with torch.no_grad():
            diff = (logp.detach() - tensors["old_logp"]).abs() * mask
            n_tok = mask.sum().clamp(min=1)
        staleness = batch.staleness()
        rewards = [s.reward for s in samples]
        out = {f"train/{k}": float(v) for k, v in metrics.items()}
        out.update({
            "train/loss": float(loss.detach()),
            "train/grad_norm": float(grad_norm),
            "train/logprob_abs_diff": float(diff.sum() / n_tok),
            "train/tokens": float(n_tok),
            "train/samples": float(len(samples)),
            "train/version": float(self.version),
            "rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/completion_len": sum(len(s.completion_ids) for s in samples) / len(samples),
            "staleness/mean": sum(staleness) / len(staleness),
            "staleness/max": float(max(staleness)),
            "staleness/version_spread": float(max(s.newest_version for s in samples)
                                             - min(s.oldest_version for s in samples)),
        })
        if not math.isfinite(out["train/loss"]):
            raise FloatingPointError(f"non-finite loss at step {self.version}: {out}")
        self.busy_s += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The current policy's logprob of every completion token of each sample (tests, scoring)."""
        tensors = pad_samples(samples, self.tokenizer.pad_token_id)
        logp = completion_logprobs(self.model, tensors, self.temperature)
        return [logp[i, : len(s.completion_ids)].tolist() for i, s in enumerate(samples)]

    # ---- weights out -------------------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Parameters under their Hugging Face names (what vLLM's loaders expect)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save_hf(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, out_dir: str | Path, extra: dict[str, Any]) -> Path:
        """Model (HF format, servable), optimizer, version and the caller's state (sampler, buffer)."""
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        self.save_hf(tmp)
        torch.save({"optimizer": self.optimizer.state_dict(), "version": self.version}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({"version": self.version, **extra}))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)  # a crash mid-save leaves the previous checkpoint intact
        return out

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        ckpt = Path(ckpt_dir)
        self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict())
        state = torch.load(ckpt / "trainer.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        return json.loads((ckpt / "state.json").read_text())
