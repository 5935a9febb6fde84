"""The recipe's `model`, `async` and `train` sections: the policy, the staleness budget, the trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from factory.recipe.base import Section
from factory.support.threads import Threads


class ModelSection(Section):
    """The policy. With `path` unset, a tiny model of `architecture` is built and warm-started locally."""

    path: str | None = Field(None, description="an existing HF model dir; unset builds the tiny model")
    architecture: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = Field(
        "llama", description="the tiny model built when path is unset: llama (its own role-tag chat template, "
        "untied embeddings), qwen2 (q/k/v biases, grouped-query attention, tied embeddings, ChatML), qwen3 "
        "(ChatML, no attention biases, q/k RMSNorm, tied embeddings) or qwen3_moe (qwen3's attention with a "
        "mixture-of-experts MLP in every block: num_experts, experts_per_token, expert_intermediate_size; untied "
        "embeddings)")
    hidden_size: int = Field(256, gt=0, description="tiny model: the width of its hidden states (a multiple of "
                             "num_heads)")
    num_layers: int = Field(4, gt=0, description="tiny model: decoder blocks")
    num_heads: int = Field(4, gt=0, description="tiny model: attention (query) heads")
    num_kv_heads: int | None = Field(None, gt=0, description="key/value heads (grouped-query attention when "
                                     "fewer than num_heads, which they must divide); unset: num_heads")
    intermediate_size: int = Field(704, gt=0, description="tiny model: the hidden width of each block's MLP")
    num_experts: int = Field(8, gt=0, description="qwen3_moe: experts in each block's MLP (vLLM-CPU's MoE kernel "
                             "wants hidden_size and the expert width multiples of 32)")
    experts_per_token: int = Field(2, gt=0, description="qwen3_moe: experts the router sends each token to (top-k, "
                                   "their weights renormalised to sum to 1); at most num_experts")
    expert_intermediate_size: int | None = Field(
        None, gt=0, description="qwen3_moe: the hidden width of each expert's MLP; unset: intermediate_size // "
        "experts_per_token, so a token's routed experts compute about what the dense MLP would")
    max_position: int = Field(256, gt=16, description="tiny model: its context in tokens (rollout.max_model_len "
                              "may not exceed it)")
    bpe_vocab_size: int = Field(300, ge=260, description="byte-level BPE vocab incl. 256 bytes")
    sft_steps: int = Field(2400, ge=0, description="supervised warm-start steps (at most, with sft_stop_loss)")
    sft_stop_loss: float | None = Field(
        None, gt=0, description="end the warm start once the mean loss of its last 50 updates is at or below "
        "this: a policy just off the loss plateau, with room left for RL, whatever the seed; unset: all sft_steps")
    sft_batch_size: int = Field(32, gt=0, description="warm-start examples per update")
    sft_lr: float = Field(1e-3, gt=0, description="the warm start's peak AdamW learning rate (linear warm-up over "
                          "the first 5% of sft_steps, then cosine decay to 10% of it)")
    sft_examples: int = Field(20000, gt=0, description="training tasks used for the warm start")
    seed: int = Field(0, description="tiny model: seeds its initial weights and the warm start's choice of "
                      "examples")

    @model_validator(mode="after")
    def _heads(self) -> ModelSection:
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} must be a multiple of num_heads ({self.num_heads})")
        return self

    @model_validator(mode="after")
    def _experts(self) -> ModelSection:
        moe = ("num_experts", "experts_per_token", "expert_intermediate_size")
        if self.architecture != "qwen3_moe":
            if set_here := [f for f in moe if getattr(self, f) != type(self).model_fields[f].default]:
                raise ValueError(f"{', '.join(set_here)}: only meaningful for architecture qwen3_moe, not "
                                 f"{self.architecture}")
        elif self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token: {self.experts_per_token} must not exceed num_experts "
                             f"({self.num_experts})")
        return self

    @property
    def expert_width(self) -> int:
        """qwen3_moe: each expert's MLP width (expert_intermediate_size, else intermediate_size // experts_per_token)."""
        return self.expert_intermediate_size or max(1, self.intermediate_size // self.experts_per_token)


class AsyncSection(Section):
    max_staleness: int = Field(1, ge=0, description="η: 0 synchronous, 1 one-step off-policy, k async")
    max_inflight_groups: int = Field(32, gt=0, description="most groups generating at once, whatever the "
                                     "staleness budget allows")
    overprovision: int = Field(0, ge=0, description="groups started beyond the staleness budget, so a step takes "
                               "the first B to finish instead of waiting for the slowest (late ones may go stale)")
    expect_filtering: bool = Field(False, description="admission counts a running group as the share of recent "
                                   "groups the zero-variance filter let through, so a step starts what fills its batch "
                                   "in one round instead of refilling filtered slots round by round (η ≥ 1; see "
                                   "factory/core/buffer.py)")
    schedule: Literal["fifo", "longest_first"] = Field(
        "fifo", description="which upcoming prompt starts next: in order, or the one predicted to run longest "
        "(from the run's own history of group wall times)")
    lookahead: int = Field(16, gt=0, description="longest_first: upcoming tasks it chooses among")


class LoraSection(Section):
    """Train a LoRA adapter instead of the full weights (PEFT); engines then receive only the adapter."""

    enabled: bool = Field(False, description="train an adapter (needs rollout.weight_sync=lora); false: the "
                          "full weights")
    rank: int = Field(8, gt=0, description="r, the inner dimension of each adapter's A and B matrices (also the "
                      "engines' largest LoRA rank)")
    alpha: float = Field(16.0, gt=0, description="scales the adapter's update B·A by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on each adapter's input while training; 0: none")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="names of the linear layers that get an adapter (PEFT matches a module whose name ends with "
        "one); the default: every attention and MLP projection of llama and qwen2")


class TrainSection(Section):
    steps: int = Field(400, gt=0, description="optimizer steps of the run, each on groups_per_step groups")
    groups_per_step: int = Field(8, gt=0, description="B prompts per optimizer step")
    lr: float = Field(5e-5, gt=0, description="AdamW's learning rate, constant over the run")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay; 0: none")
    grad_clip: float = Field(1.0, gt=0, description="the gradients' global L2 norm is clipped to this before "
                             "each step")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (β1, β2): decay rates of its first "
                                       "and second moment estimates")
    checkpoint_every: int = Field(100, ge=0, description="0 saves only the final checkpoint")
    checkpoint_every_s: float = Field(
        1800, ge=0, description="also checkpoint when this many seconds have passed since the last one, so a "
        "lost trainer costs minutes; 0 = by steps only")
    keep_checkpoints: int = Field(
        0, ge=0, description="keep only the newest N checkpoints in the run dir, deleting older ones as new ones are "
        "written (a run of days at checkpoint_every_s=1800 writes ~50 a day, each the model and its optimizer "
        "state); the lake's checkpoints table keeps every one's row and lineage; 0 = keep all")
    max_trainer_restarts: int = Field(
        2, ge=0, description="a trainer that dies is rebuilt inside the same run, which resumes from its latest "
        "checkpoint (exact, as a resumed run); one more death stops the run")
    max_restarts: int = Field(3, ge=0, description="times a crashed run is relaunched from its last checkpoint "
                              "(Dagster's rl_run_recovery sensor)")
    lora: LoraSection = Field(default_factory=LoraSection, description="a LoRA adapter trained in place of "
                              "the full weights (off unless lora.enabled)")
    threads: Threads = Field("auto", description="the trainer's CPU threads; auto: this node's share by the "
                             "measured rule in factory/support/threads.py")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the trainer's weights, activations and optimizer live: auto = cuda when the "
        "trainer's node has a GPU (cuda is untested here: no GPU)")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16: bf16 compute with fp32 master weights and optimizer state; auto = bf16 on "
        "cuda, fp32 on cpu (keeps resume, replay and reproducibility bitwise, and this CPU has no fast bf16)")
    activation_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute each decoder block in the backward pass instead of keeping its "
        "activations; auto = off on cpu; on cuda decided after the warm-up pass measured the step's peak "
        "memory (off where the device's memory allows, else on; cuda untested here: no GPU)")
    micro_batch_tokens: int = Field(
        16384, ge=0, description="tokens per forward/backward: a packed row's tokens (packing true), else "
        "rows x the longest row (padded rows, or rows of packed samples), samples of similar length sharing a "
        "micro-batch; gradients "
        "accumulate to the whole batch's update; 0 = the whole batch")
    packing: bool | Literal["auto"] = Field(
        "auto", description="pack samples end to end, positions restarting and attention confined to each "
        "sample; true = one row of up to micro_batch_tokens per micro-batch (no padding); auto = that where the "
        "attention runs each sample of a row on its own (flash-attention, flex), and with sdpa or eager (a dense "
        "mask, whose cost grows with row^2) several rows per micro-batch as wide as its longest sample, short "
        "samples sharing a row; either only where a check shows the model confines attention (one line says why "
        "not); true fails where that check does; false = micro-batches of padded rows grouped by length")
    logprob_chunk_tokens: int | Literal["auto"] = Field(
        "auto", description="completion tokens per chunk through the output layer (each chunk's logits "
        "are recomputed in the backward pass; a [B, T, vocab] tensor never exists); auto = 512 on cpu, on cuda "
        "the largest of 2048/1024/512 the measured step's memory allows (cuda untested here)")
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each decoder block once, with dynamic sequence lengths (compile time "
        "paid in the warm-up pass); auto = on for cuda (untested here: no GPU), off on cpu")
    warm_up: bool = Field(True, description="one forward and backward pass on a dummy batch of the step's size "
                          "while the engines start, so step 1 does not pay the first pass's one-time costs "
                          "and AdamW's state made (zero moments at step 0); the run trains bitwise as without it")
    ranks: int = Field(1, ge=1, description="trainer ranks sharding the model with FSDP2 (gloo on cpu, nccl "
                       "on cuda), each a Ray actor placed by placement.trainer")
    seed: int = Field(0, description="seeds the trainer's torch generator (adapter initialisation, dropout) and "
                      "the order in which training tasks are drawn")

    @model_validator(mode="after")
    def _auto_words(self) -> TrainSection:
        chunk = self.logprob_chunk_tokens
        if not isinstance(chunk, str) and chunk <= 0:
            raise ValueError(f"logprob_chunk_tokens: {chunk} must be a positive number of tokens or auto")
        return self
