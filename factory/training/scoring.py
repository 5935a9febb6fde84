"""The scoring phase: models that read finished samples and attach per-token scores before training.

A scorer sits between the buffer and the trainer (`factory/run.py`): it takes a batch, computes
something per completion token, and returns the batch with it attached. The one built here is a
teacher for on-policy distillation: it writes the teacher's logprob of every sampled token to
`Sample.teacher_logprobs`, and the trainer turns the gap into a per-token advantage,

    A_t = A_task + coef * (log pi_teacher(y_t) - log pi_behaviour(y_t)),

i.e. a per-token reward of minus the sampled estimate of the reverse KL(student || teacher)
(on-policy distillation: the student's own samples, graded token by token by the teacher).
Other scorers (a process reward model, a reference policy for KL) plug in the same way:
register a class under a name and select it in the recipe (`algorithm.distill.scorer`).
"""

from __future__ import annotations

from typing import Protocol
from collections.abc import Callable

from factory.core import registries
from factory.core.registry import Registry
from factory.core.types import Batch, Sample


class Scorer(Protocol):
    def score(self, samples: list[Sample]) -> None:
        """Attach this scorer's per-token values to each sample in place."""


SCORERS: Registry[Callable[..., Scorer]] = registries.SCORERS


def register_scorer(name: str):
    def wrap(cls):
        return SCORERS.register(name, cls)

    return wrap


@register_scorer("teacher_logprobs")
class TeacherLogprobs:
    """A frozen HF causal LM (same tokenizer as the student) scoring sampled tokens.

    Scores use the rollout temperature, like the student's logprobs, so the two are comparable."""

    def __init__(self, model_path: str, temperature: float = 1.0, threads: int = 1, batch_size: int = 64):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        self.pad_id = self.model.config.pad_token_id or 0
        self.temperature = temperature
        self.batch_size = batch_size

    def score(self, samples: list[Sample]) -> None:
        import torch

        from factory.model.logprobs import completion_logprobs, pad_samples

        with torch.no_grad():
            for i in range(0, len(samples), self.batch_size):
                chunk = samples[i: i + self.batch_size]
                logp = completion_logprobs(self.model, pad_samples(chunk, self.pad_id), self.temperature)
                for j, s in enumerate(chunk):
                    row = logp[j, : len(s.completion_ids)].tolist()
                    # only sampled tokens have a student logprob to compare with
                    s.teacher_logprobs = [lp if m else 0.0 for lp, m in zip(row, s.loss_mask)]


def make_scorer(distill, rollout) -> Scorer | None:
    """The recipe's scorer, or None when distillation is off."""
    if not distill.teacher:
        return None
    if distill.scorer not in SCORERS:
        raise ValueError(f"algorithm.distill.scorer: unknown {distill.scorer!r}; choose one of {sorted(SCORERS)}")
    from pathlib import Path

    if not (Path(distill.teacher) / "config.json").is_file():
        raise FileNotFoundError(f"algorithm.distill.teacher: {distill.teacher} holds no config.json "
                                "(not a Hugging Face model dir)")
    return SCORERS[distill.scorer](distill.teacher, temperature=rollout.temperature)


def score_batch(scorer: Scorer, batch: Batch) -> tuple[Batch, dict[str, float]]:
    """Score `batch` in place; metrics: the sampled reverse-KL estimate E[log pi_b - log pi_teacher]
    over sampled tokens (what distillation drives down)."""
    scorer.score(batch.samples)
    gaps = [lp - t for s in batch.samples for lp, t, m in zip(s.logprobs, s.teacher_logprobs, s.loss_mask) if m]
    return batch, {"distill/reverse_kl": sum(gaps) / max(1, len(gaps))}
