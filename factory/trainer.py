"""The trainer: fresh logprobs -> registry loss -> AdamW step; checkpoints; weights for sync.

It knows no algorithm: the advantage estimator, the policy loss, the off-policy corrections and the
version-spread gate are looked up by the names in the recipe's `algorithm` section and chained by
`factory.algo.policy_objective`. It knows no runtime either: `runtime/` wraps it in a Ray actor.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from factory.algo import (
    CorrectionConfig,
    LossConfig,
    LossContext,
    ObjectiveConfig,
    aggregate,
    batch_advantages,
    distillation_advantages,
    from_section,
    kl_penalty,
    overlong_penalty,
    policy_objective,
)
from factory.model.logprobs import completion_logprobs, pad_samples, to_device
from factory.types import Batch, Sample

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


class Trainer:
    """`train.device` decides where the weights, activations and optimizer state live (auto: CUDA when
    this process sees a GPU). The CPU path is what runs and is tested here; the CUDA path moves the
    same tensors to the GPU but no machine of this project has one, so it is untested here."""

    def __init__(self, model_path: str, algorithm, train, rollout, shape: dict | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from factory.devices import resolve_device

        from factory.threads import resolve

        self.threads = resolve(train.threads, "trainer", shape)  # `shape`: the run's, for train.threads=auto
        torch.set_num_threads(self.threads)
        torch.manual_seed(train.seed)
        self.device = torch.device(resolve_device(train.device))
        self.algorithm = algorithm
        self.train_cfg = train
        self.temperature = rollout.temperature
        self.serving_dtype = rollout.dtype
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model: PreTrainedModel | PeftModel = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.lora = train.lora.enabled
        if self.lora:
            from peft import LoraConfig, get_peft_model

            lc = train.lora
            self.model = get_peft_model(self.model, LoraConfig(
                r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=list(lc.target_modules),
                bias="none", task_type="CAUSAL_LM"))
        self.model.to(self.device).train()  # type: ignore[arg-type]  # transformers types .to as the unbound Module.to
        self.ref_model = None
        if algorithm.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self.ref_model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types .to as the unbound Module.to
            self.ref_model.requires_grad_(False)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=train.lr,
                                           weight_decay=train.weight_decay, betas=tuple(train.betas))
        # one source per setting: each config copies the recipe section's fields of the same names
        self.loss_cfg = from_section(LossConfig, algorithm, max_tokens=rollout.max_new_tokens)
        self.objective = from_section(ObjectiveConfig, algorithm, loss_cfg=self.loss_cfg, corrections=[
            (c.name, from_section(CorrectionConfig, c)) for c in algorithm.corrections])
        self.max_new_tokens = rollout.max_new_tokens
        if algorithm.overlong_buffer > rollout.max_new_tokens:
            raise ValueError(f"algorithm.overlong_buffer ({algorithm.overlong_buffer}) must not exceed "
                             f"rollout.max_new_tokens ({rollout.max_new_tokens})")
        self.version = 0
        self.busy_s = 0.0

    # ---- one optimizer step ------------------------------------------------------------------

    def advantages(self, batch: Batch, rewards: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample advantages of `rewards` (default: the samples' rewards), per group (groups may
        differ in size) or over the whole batch, as the estimator's scope says."""
        if rewards is None:
            rewards = torch.tensor([s.reward for s in batch.samples], dtype=torch.float32)
        return batch_advantages(self.algorithm.advantage, rewards, [len(g.samples) for g in batch.groups])

    def shaped_rewards(self, samples: list[Sample], sampled_lens: torch.Tensor) -> torch.Tensor:
        """Rewards plus DAPO's overlong penalty on the sampled length (when algorithm.overlong_buffer > 0)."""
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=sampled_lens.device)
        if self.algorithm.overlong_buffer:
            rewards = rewards + overlong_penalty(sampled_lens, self.max_new_tokens, self.algorithm.overlong_buffer,
                                                 self.algorithm.overlong_penalty)
        return rewards

    def train_step(self, batch: Batch) -> dict[str, float]:
        t0 = time.perf_counter()
        samples = batch.samples
        tensors = to_device(pad_samples(samples, self.tokenizer.pad_token_id), self.device)
        shaped = self.shaped_rewards(samples, tensors["sampled_lens"])
        adv = self.advantages(batch, shaped)
        if any(s.teacher_logprobs for s in samples):  # graded by a teacher (scoring phase): distillation
            adv = distillation_advantages(adv, samples, tensors["old_logp"], tensors["mask"],
                                          self.algorithm.distill.coef)
        t_forward = time.perf_counter()
        logp = completion_logprobs(self.model, tensors, self.temperature)
        # per-token staleness is measured against the policy being trained (= batch.version in run.py)
        ctx = LossContext(behaviour_logp=tensors["old_logp"], versions=tensors["versions"],
                          trainer_version=self.version, truncated=tensors["truncated"])
        loss, out, mask = policy_objective(logp, adv, tensors["mask"], ctx, self.objective)
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp = completion_logprobs(self.ref_model, tensors, self.temperature)
            kl = aggregate(kl_penalty(logp, ref_logp, self.algorithm.kl_estimator), mask, self.algorithm.aggregation,
                           self.loss_cfg.max_tokens)
            loss = loss + self.algorithm.kl_coef * kl
            out["train/kl_ref"] = float(kl.detach())
        self.optimizer.zero_grad(set_to_none=True)
        t_backward = time.perf_counter()
        loss.backward()
        t_optimizer = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg.grad_clip)
        self.optimizer.step()
        t_done = time.perf_counter()
        self.version += 1

        with torch.no_grad():
            sampled = tensors["mask"]
            diff = (logp.detach() - tensors["old_logp"]).abs() * sampled
        staleness = batch.staleness()
        rewards = [s.reward for s in samples]
        out.update({
            "train/loss": float(loss.detach()),
            "train/grad_norm": float(grad_norm),
            "train/logprob_abs_diff": float(diff.sum() / sampled.sum().clamp(min=1)),
            "train/tokens": float(mask.sum()),
            "train/samples": float(len(samples)),
            "train/version": float(self.version),
            "rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/completion_len": sum(len(s.completion_ids) for s in samples) / len(samples),
            "staleness/mean": sum(staleness) / len(staleness),
            "staleness/max": float(max(staleness)),
        })
        if self.algorithm.overlong_buffer:
            out["rollout/overlong_penalty_mean"] = float((shaped.cpu() - torch.tensor(rewards)).mean())
        if not math.isfinite(out["train/loss"]):
            raise FloatingPointError(f"non-finite loss at step {self.version}: {out}")
        # where the step's time went (bench/step_anatomy.py): batch prep, forward (+ reference), backward, optimizer
        out.update({"perf/trainer_prepare_s": t_forward - t0, "perf/trainer_forward_s": t_backward - t_forward,
                    "perf/trainer_backward_s": t_optimizer - t_backward, "perf/trainer_optimizer_s": t_done - t_optimizer})
        self.busy_s += time.perf_counter() - t0
        out["perf/trainer_step_s"] = time.perf_counter() - t0
        return out

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The current policy's logprob of every completion token of each sample (tests, scoring)."""
        tensors = to_device(pad_samples(samples, self.tokenizer.pad_token_id), self.device)
        logp = completion_logprobs(self.model, tensors, self.temperature).cpu()
        return [logp[i, : len(s.completion_ids)].tolist() for i, s in enumerate(samples)]

    # ---- weights out -------------------------------------------------------------------------

    def _full_model(self):
        """The policy as a plain HF model: with LoRA, a merged copy (the trained model is untouched)."""
        if not self.lora:
            return self.model
        import copy

        return copy.deepcopy(self.model).merge_and_unload()

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Parameters under their Hugging Face names (what vLLM's loaders expect)."""
        return {k: v.detach() for k, v in self._full_model().state_dict().items()}

    def save_hf(self, out_dir: str | Path) -> Path:
        """A servable HF model dir (LoRA merged in)."""
        out = Path(out_dir)
        self._full_model().save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out

    def save_adapter(self, out_dir: str | Path) -> Path:
        """The LoRA adapter alone (PEFT format: adapter_config.json + weights), what engines load in place."""
        if not self.lora:
            raise ValueError("save_adapter: train.lora.enabled is false; there is no adapter")
        out = Path(out_dir)
        self.model.save_pretrained(str(out))
        return out

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, out_dir: str | Path, extra: dict[str, Any]) -> Path:
        """Model (HF format, servable), optimizer, version and the caller's state (sampler, buffer)."""
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        self.save_hf(tmp)
        if self.lora:
            self.save_adapter(tmp / "adapter")
        torch.save({"optimizer": self.optimizer.state_dict(), "version": self.version,
                    "rng": torch.get_rng_state()}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({"version": self.version, **extra}))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)  # a crash mid-save leaves the previous checkpoint intact
        return out

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Continue from a checkpoint: weights (the adapter alone with LoRA: the base stays the original
        policy this trainer was built on, as does the KL reference), optimizer, version and RNG state."""
        from transformers import AutoModelForCausalLM

        ckpt = Path(ckpt_dir)
        if self.lora:  # the base stays frozen; only the adapter was trained
            from peft import load_peft_weights, set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_peft_weights(str(ckpt / "adapter")))
        else:
            self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict())
            self.model.to(self.device)  # type: ignore[arg-type]  # transformers types .to as the unbound Module.to
        state = torch.load(ckpt / "trainer.pt", weights_only=False, map_location=self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        if "rng" in state:
            torch.set_rng_state(state["rng"].cpu())
        return json.loads((ckpt / "state.json").read_text())
