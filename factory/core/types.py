"""The data that flows through a run: tasks, samples, groups and batches.

Pure dataclasses: no torch, no Ray. Everything else in the package imports these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

NOT_SAMPLED = -1  # the version recorded for tokens the policy did not sample (prompt, tool output)


@dataclass
class Task:
    """One problem an environment can pose: a prompt and whatever its verifier needs."""

    task_id: str
    family: str
    question: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One trajectory as the trainer sees it.

    `completion_ids` is everything after the first prompt: sampled tokens and, for multi-turn
    episodes, the tool/user tokens between turns. `loss_mask` is 1 on sampled tokens only;
    `logprobs` holds the behaviour policy's logprob of each sampled token (0.0 elsewhere) and
    `versions` the policy version that sampled it (NOT_SAMPLED elsewhere). `support`, when the
    recipe keeps the sampling mask, holds per completion token the ids the sampler could choose
    from (top-k/top-p survivors; [] where unknown or not sampled); empty when not recorded.
    `routed_experts`, when the rollout records routing (mixture-of-experts policies, routing replay),
    holds per completion token the expert ids each MoE layer routed it through, `[layer][top_k]`, taken
    at the position whose logits sampled it ([] where not sampled, e.g. tool output); empty when not
    recorded.
    """

    sample_id: str
    group_id: str
    task_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    versions: list[int]
    reward: float = 0.0
    env: str = ""
    turns: int = 1
    finish_reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    support: list[list[int]] = field(default_factory=list)
    teacher_logprobs: list[float] = field(default_factory=list)  # set by a scorer (factory/training/scoring.py)
    routed_experts: list[list[list[int]]] = field(default_factory=list)
    prompt_text: str = ""  # the decoded prompt_ids / completion_ids (what the model read and wrote)
    completion_text: str = ""

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if not (len(self.logprobs) == len(self.loss_mask) == len(self.versions) == n):
            raise ValueError(
                f"sample {self.sample_id}: completion_ids, logprobs, loss_mask and versions "
                f"must have equal lengths, got {n}, {len(self.logprobs)}, "
                f"{len(self.loss_mask)}, {len(self.versions)}"
            )
        if self.support and len(self.support) != n:
            raise ValueError(f"sample {self.sample_id}: support has {len(self.support)} entries for {n} tokens")
        if self.routed_experts and len(self.routed_experts) != n:
            raise ValueError(f"sample {self.sample_id}: routed_experts has {len(self.routed_experts)} entries "
                             f"for {n} tokens")

    @property
    def sampled_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.loss_mask) if m]

    @property
    def oldest_version(self) -> int:
        """The version of the oldest sampled token (NOT_SAMPLED if nothing was sampled)."""
        vs = self.sampled_versions
        return min(vs) if vs else NOT_SAMPLED

    @property
    def newest_version(self) -> int:
        vs = self.sampled_versions
        return max(vs) if vs else NOT_SAMPLED

    def to_dict(self) -> dict[str, Any]:
        """The fields as a new dict whose values are the sample's own, not copies (`asdict` deep-copies
        every token list: about as much of the driver's CPU as JSON-encoding the row); readers must not
        change them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Group:
    """G completions of one prompt: the unit of admission, filtering and advantage estimation."""

    group_id: str
    task: Task
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (a checkpoint keeps queued groups this way); `from_dict` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        return cls(group_id=d["group_id"], task=Task(**d["task"]), samples=[Sample(**s) for s in d["samples"]])

    @property
    def oldest_version(self) -> int:
        return min(s.oldest_version for s in self.samples)


@dataclass
class Batch:
    """The groups the trainer consumes in one optimizer step at policy version `version`."""

    version: int
    groups: list[Group]

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]

    def staleness(self) -> list[int]:
        """Per-sample staleness: trainer version minus the oldest sampled token's version."""
        return [self.version - s.oldest_version for s in self.samples]
