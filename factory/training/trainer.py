"""The trainer: fresh logprobs -> registry loss -> AdamW step; checkpoints; weights for sync.

A step is lean: logprobs of completion positions only, through the output layer in checkpointed
chunks (`factory.model.logprobs`); bf16 mixed precision (`train.precision`); activation
checkpointing; micro-batches of similar length under a token budget whose gradients add up to the
whole batch's update for every aggregation. With `train.ranks` > 1 this same class is one rank of
an FSDP2 group (`factory.training.parallel`): each rank takes its share of the batch by tokens, and weights
leave it gathered one tensor at a time.

It knows no algorithm: the advantage estimator, the policy loss, the off-policy corrections and the
version-spread gate are looked up by the names in the recipe's `algorithm` section and chained by
`factory.algo.policy_objective`. It knows no runtime either: `runtime/` wraps it in a Ray actor.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import time
from collections.abc import Iterator
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
from factory.algo.losses import aggregation_denominator
from factory.model.logprobs import completion_logprobs, pack_tensors, packing_unsupported, pad_samples, to_device
from factory.model.routing import RoutingReplay
from factory.training.memory import SAFE_CHUNK, choose_memory_settings, resolve_compile
from factory.training.parallel import (
    TrainerSetupError,
    all_reduce_sum,
    padding_share,
    plan_micro_batches,
    plan_packed_rows,
    plan_row_packs,
    row_layout,
    step_metrics_merge,
)
from factory.core.types import Batch, Sample

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


# the tensors a forward pass reads (FSDP's mixed precision casts the floating inputs of the root's forward)
FORWARD_KEYS = ("input_ids", "attention_mask", "prompt_lens", "completion_lens", "t_max", "support", "routing",
                "position_ids", "sample_starts", "sample_rows")


# attention implementations that run each sample of a packed row on its own (no dense [row, row] mask):
# where `train.packing: auto` packs a micro-batch into one row; elsewhere it packs into rows as wide as the
# micro-batch's longest sample (`plan_row_packs`)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


class PolicyLogprobs(torch.nn.Module):
    """The module a step calls, and FSDP's root: a causal LM's completion logprobs (see
    `completion_logprobs`). Its forward runs the LM's body and output layer, so the root's hooks
    gather the embeddings, final norm and output layer around them."""

    def __init__(self, lm, temperature: float, chunk_tokens: int, routing: RoutingReplay | None = None):
        super().__init__()
        self.lm = lm
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.routing = routing  # a mixture-of-experts policy's router hooks (factory/model/routing.py)

    def forward(self, tensors: dict[str, Any]) -> torch.Tensor:
        if self.routing is not None:  # the recorded experts (or none: the trainer's router) for this forward
            self.routing.set(tensors.get("routing"), tensors["attention_mask"])
        return completion_logprobs(self.lm, tensors, self.temperature, self.chunk_tokens)


def resolve_precision(wanted: str, device: torch.device) -> str:
    """auto -> bf16 on CUDA, fp32 on CPU (bitwise resume/replay there, and no fast bf16 on this CPU)."""
    if wanted == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return wanted


class Trainer:
    """`train.device` decides where the weights, activations and optimizer state live (auto: CUDA when
    this process sees a GPU). The CPU path is what runs and is tested here; the CUDA path moves the
    same tensors to the GPU (docs/trainer.md says which GPU paths have run).

    `rank`/`world_size`: this trainer's place in an FSDP2 group whose default process group the
    caller has formed (`factory.training.parallel.init_trainer_group`); 1 rank is the plain path."""

    def __init__(self, model_path: str, algorithm, train, rollout, shape: dict | None = None,
                 rank: int = 0, world_size: int = 1):
        from factory.support.lean_imports import lean_transformers

        lean_transformers()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from factory.support.devices import resolve_device

        from factory.support.threads import resolve

        self.threads = resolve(train.threads, "trainer", shape)  # `shape`: the run's, for train.threads=auto
        torch.set_num_threads(self.threads)
        torch.manual_seed(train.seed)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(resolve_device(train.device))
        if self.device.type == "cuda" and world_size > 1:
            torch.cuda.set_device(0)  # each rank's actor sees its own GPU as device 0 (Ray sets CUDA_VISIBLE_DEVICES)
        self.precision = resolve_precision(train.precision, self.device)
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
        # auto on CUDA: on (safe) until the warm-up pass has measured the step's peak (`_choose_memory`)
        checkpointing = train.activation_checkpointing
        if checkpointing == "auto":
            checkpointing = self.device.type == "cuda"
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.to(self.device).train()  # type: ignore[arg-type]  # transformers types .to as the unbound Module.to
        self.packing, self.packing_why = self._resolve_packing(train.packing)
        chunk = SAFE_CHUNK if train.logprob_chunk_tokens == "auto" else int(train.logprob_chunk_tokens)
        # what the `auto` settings became, for the run's first lines and results.json (`settings`)
        self.chosen: dict[str, Any] = {"packing": self.packing, "activation_checkpointing": bool(checkpointing),
                                       "logprob_chunk_tokens": chunk}
        if self.packing_why:
            self.chosen["packing_why"] = self.packing_why
        # routing replay: on unless the recipe turns it off; it acts where the engine recorded experts
        replay = algorithm.routing_replay != "off"
        self.routing = RoutingReplay.install(self.model, replay, aux_loss=algorithm.router_aux_loss_coef > 0)
        self.policy = PolicyLogprobs(self.model, rollout.temperature, chunk, self.routing)
        self.ref_model = None
        self.ref_policy: PolicyLogprobs | None = None
        if algorithm.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self.ref_model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types .to as the unbound Module.to
            self.ref_model.requires_grad_(False)
            self.ref_policy = PolicyLogprobs(self.ref_model, rollout.temperature, chunk,
                                             RoutingReplay.install(self.ref_model, replay))
        if world_size > 1:
            from factory.training.parallel import parallelize

            parallelize(self.policy, self.model, world_size, self.device.type, self.precision == "bf16")
            if self.ref_policy is not None:
                parallelize(self.ref_policy, self.ref_model, world_size, self.device.type, self.precision == "bf16")
        self.chosen["compile"] = resolve_compile(train.compile, self.device.type)
        if self.chosen["compile"]:
            self._compile_blocks()
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=train.lr,
                                           weight_decay=train.weight_decay, betas=tuple(train.betas),
                                           fused=self.device.type == "cuda" or None)
        # one source per setting: each config copies the recipe section's fields of the same names
        self.loss_cfg = from_section(LossConfig, algorithm, max_tokens=rollout.max_new_tokens)
        self.objective = from_section(ObjectiveConfig, algorithm, loss_cfg=self.loss_cfg, corrections=[
            (c.name, from_section(CorrectionConfig, c)) for c in algorithm.corrections])
        self.max_new_tokens = rollout.max_new_tokens
        self.group_size = rollout.group_size
        if algorithm.overlong_buffer > rollout.max_new_tokens:
            raise ValueError(f"algorithm.overlong_buffer ({algorithm.overlong_buffer}) must not exceed "
                             f"rollout.max_new_tokens ({rollout.max_new_tokens})")
        self.version = 0
        self.busy_s = 0.0

    def _resolve_packing(self, wanted: bool | str) -> tuple[bool | str, str | None]:
        """train.packing: (True: one packed row per micro-batch, "rows": several rows per micro-batch,
        False; a note on what auto chose and why). Checked on the model itself (`packing_unsupported`);
        `true` on a model that cannot is a one-line error. `auto` packs a micro-batch into one row only
        where the attention runs each sample of a row on its own (variable-length kernels): sdpa and
        eager build a dense [row, row] mask, so one long row's attention costs row² (the default
        recipe's step: 0.88 s in one row vs 0.65 s grouped). There it packs into rows as wide as the
        micro-batch's longest sample, which cost no more than the padded rows they replace."""
        if wanted is False:
            return False, None
        attention = str(getattr(self.model.config, "_attn_implementation", None))
        why = packing_unsupported(self.model)
        if why is None and wanted == "auto" and attention not in VARLEN_ATTENTION:
            rows = (f"rows: attention {attention} builds a dense [row, row] mask, so samples are packed into "
                    "rows as wide as each micro-batch's longest, several short ones a row (one long row: "
                    "train.packing: true)")
            log.info("train.packing: %s", rows)
            return "rows", rows
        if why is None:
            return True, None
        if wanted is True:
            raise TrainerSetupError(f"train.packing: {why}; set train.packing to false or auto")
        log.warning("train.packing: off: %s", why)
        return False, f"off: {why}"

    def _compile_blocks(self) -> None:
        """train.compile: each decoder block compiled once with dynamic sequence lengths (the first pass,
        the warm-up's when it runs, pays the compile). Blocks only: the chunked output layer and the loss
        stay eager, so a new batch shape recompiles nothing outside the blocks."""
        from factory.training.parallel import decoder_blocks

        for block in decoder_blocks(self.model):
            block.compile(dynamic=True)

    def settings(self) -> dict[str, Any]:
        """What the trainer's `auto` settings became (packing and why not, output-layer chunk, activation
        checkpointing, compiled blocks, and on CUDA why): the run's first lines and results.json say it."""
        return dict(self.chosen)

    def _apply_memory(self, chunk: int, checkpointing: bool) -> None:
        for policy in (self.policy, self.ref_policy):
            if policy is not None:
                policy.chunk_tokens = chunk
        if checkpointing != self.chosen["activation_checkpointing"]:
            if checkpointing:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_disable()
        self.chosen.update(logprob_chunk_tokens=chunk, activation_checkpointing=checkpointing)

    def _memory_auto(self) -> bool:
        cfg = self.train_cfg
        return self.device.type == "cuda" and "auto" in (cfg.logprob_chunk_tokens, cfg.activation_checkpointing)

    def _choose_memory(self, tensors: dict[str, Any]) -> None:
        """CUDA, `auto` chunk or checkpointing: after the warm-up pass measured the step's peak under the
        safe settings, the fastest settings `choose_memory_settings` predicts to fit, then one more pass
        under them; out of memory there, the safe settings stay. Not run here (no GPU)."""
        cfg = self.train_cfg
        peak = torch.cuda.max_memory_allocated(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        available = free + torch.cuda.memory_reserved(self.device)
        config = getattr(self.model, "config", None)
        pick = choose_memory_settings(
            available, peak, tokens=int(tensors["input_ids"].numel()),
            layers=int(getattr(config, "num_hidden_layers", 1)), hidden=int(getattr(config, "hidden_size", 1)),
            vocab=int(getattr(config, "vocab_size", 1)), dtype_bytes=2 if self.precision == "bf16" else 4,
            measured_chunk=int(self.policy.chunk_tokens),
            want_checkpointing=None if cfg.activation_checkpointing == "auto" else bool(cfg.activation_checkpointing),
            want_chunk=None if cfg.logprob_chunk_tokens == "auto" else int(cfg.logprob_chunk_tokens))
        safe = (int(self.policy.chunk_tokens), bool(self.chosen["activation_checkpointing"]))
        self.chosen["memory_why"] = pick.why
        if (pick.logprob_chunk_tokens, pick.activation_checkpointing) == safe:
            return
        self._apply_memory(pick.logprob_chunk_tokens, pick.activation_checkpointing)
        try:
            self._forward(self.policy, tensors).sum().backward()
        except torch.cuda.OutOfMemoryError:
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            self._apply_memory(*safe)
            self.chosen["memory_why"] = f"{pick.why}; out of memory when tried: the safe settings kept"
        self.chosen["peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30

    def warm_up(self, prompt_tokens: int = 32) -> float:
        """One forward and backward pass on a dummy micro-batch of the run's size (its rows; a guessed
        prompt plus `rollout.max_new_tokens`), its gradients dropped; the seconds it took. A run calls
        it while its engines start, so the first step does not pay the first pass's one-time costs
        (the allocator growing to a step's size, kernels set up per shape). Measured on the default
        recipe here: step 1's forward 0.43-0.46 s without, 0.11-0.16 s with (later steps 0.11-0.25). It also
        makes the optimizer's state (`_allocate_optimizer_state`). It changes no weight, no value a step
        reads and no RNG stream: a warmed run trains bitwise as an unwarmed one."""
        t0 = time.perf_counter()
        width = prompt_tokens + self.max_new_tokens
        rows = self.train_cfg.groups_per_step * self.group_size
        # a micro-batch's tokens at most (16,384 where the step takes the whole batch at once): the real
        # rows are often far shorter than max_new_tokens, and a warm-up must not be what runs out of memory
        rows = max(1, min(rows, (self.train_cfg.micro_batch_tokens or 16384) // width))
        rows = max(1, -(-rows // self.world_size))  # this rank's share
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, int(self.model.config.vocab_size), (rows, width), generator=gen)
        tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "t_max": self.max_new_tokens,
                   "prompt_lens": torch.full((rows,), prompt_tokens),
                   "completion_lens": torch.full((rows,), self.max_new_tokens)}
        if self.packing is True:  # the step's shape: its rows end to end in one row (rows: as they are)
            tensors = pack_tensors(tensors)
        tensors = to_device(tensors, self.device)
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        try:
            measure = self._memory_auto()
            if measure:  # the step's peak includes AdamW's state: made first, then the pass measured
                self._allocate_optimizer_state()
                self.optimizer.zero_grad(set_to_none=True)
                torch.cuda.reset_peak_memory_stats(self.device)
            self._forward(self.policy, tensors).sum().backward()
            self._allocate_optimizer_state()
            if measure:
                self.optimizer.zero_grad(set_to_none=True)
                self._choose_memory(tensors)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            torch.random.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        return time.perf_counter() - t0

    @torch.no_grad()
    def _allocate_optimizer_state(self) -> None:
        """AdamW's state (zero moments), made now instead of in step 1: one step at lr 0 on zero
        gradients (the moments stay 0, the weights and the decay factor 1 - 0·wd leave every weight
        as it was), then the step counts back to 0, so step 1's update is the fresh optimizer's."""
        if self.optimizer.state:
            return  # a loaded checkpoint's, or made already
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        try:
            self.optimizer.step()
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"].zero_()
            elif "step" in state:
                state["step"] = 0

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

    def _autocast(self):
        """bf16 compute for the plain path (FSDP casts through its mixed-precision policy instead)."""
        if self.precision == "bf16" and self.world_size == 1:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, policy: PolicyLogprobs, tensors: dict[str, Any]) -> torch.Tensor:
        with self._autocast():
            return policy({k: tensors[k] for k in FORWARD_KEYS if k in tensors})

    def _micro_loss(self, samples: list[Sample], adv: torch.Tensor,
                    probe: bool = False) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """The objective of one micro-batch, aggregated over it alone: (loss, metrics, mask kept).
        `probe`: also measure what routing replay saves (a step's first micro-batch)."""
        tensors = self._tensors(samples)
        adv = adv.to(self.device)
        if any(s.teacher_logprobs for s in samples):  # graded by a teacher (scoring phase): distillation
            adv = distillation_advantages(adv, samples, tensors["old_logp"], tensors["mask"],
                                          self.algorithm.distill.coef)
        logp = self._forward(self.policy, tensors)
        routing_out = self._routing_metrics(tensors, samples if probe else []) if self.routing is not None else {}
        # per-token staleness is measured against the policy being trained (= batch.version in run.py)
        ctx = LossContext(behaviour_logp=tensors["old_logp"], versions=tensors["versions"],
                          trainer_version=self.version, truncated=tensors["truncated"])
        loss, out, mask = policy_objective(logp, adv, tensors["mask"], ctx, self.objective)
        out.update(routing_out)
        aux = self.routing.aux() if self.routing is not None else None
        if aux is not None:
            loss = loss + self.algorithm.router_aux_loss_coef * aux
            out["train/router_aux_loss"] = float(aux.detach())
        if self.ref_policy is not None:
            with torch.no_grad():
                ref_logp = self._forward(self.ref_policy, tensors)
            kl = aggregate(kl_penalty(logp, ref_logp, self.algorithm.kl_estimator), mask, self.algorithm.aggregation,
                           self.loss_cfg.max_tokens)
            loss = loss + self.algorithm.kl_coef * kl
            out["train/kl_ref"] = float(kl.detach())
        with torch.no_grad():
            sampled = tensors["mask"]
            diff = (logp.detach() - tensors["old_logp"]).abs() * sampled
        out["train/loss"] = float(loss.detach())
        out["train/logprob_abs_diff"] = float(diff.sum() / sampled.sum().clamp(min=1))
        return loss, out, mask

    def _tensors(self, samples: list[Sample]) -> dict[str, Any]:
        """A micro-batch's inputs on the device: padded rows, one packed row, or rows of packed samples
        (`train.packing`); the [B, T] tensors the loss reads stay per sample."""
        tensors = pad_samples(samples, self.tokenizer.pad_token_id)
        if self.packing == "rows":  # the planner listed them longest first: their rows as it laid them out
            tensors = pack_tensors(tensors, row_layout([len(s.prompt_ids) + len(s.completion_ids) for s in samples]))
        elif self.packing:
            tensors = pack_tensors(tensors)
        return to_device(tensors, self.device)

    def _routing_metrics(self, tensors: dict[str, Any], probe: list[Sample]) -> dict[str, float]:
        """A mixture-of-experts policy's router metrics for the forward just run (RoutingReplay.metrics)
        and, where it replayed recorded routes, the engine-vs-trainer logprob gap the trainer's own router
        gives on a quarter of `probe`'s samples (one extra forward without gradients on those: what replay
        is saving; a step probes its first micro-batch)."""
        assert self.routing is not None
        out = self.routing.metrics()
        if probe and "routing" in tensors and self.routing.replay:
            replayed = self.routing.stats
            few = self._tensors(probe[: max(1, len(probe) // 4)])
            few.pop("routing", None)
            with torch.no_grad():
                own = self._forward(self.policy, few)
            self.routing.set(tensors["routing"], tensors["attention_mask"])  # the backward recomputes replayed
            self.routing.stats = replayed  # the step's metrics and aux loss stay the replayed forward's
            sampled = few["mask"]
            gap = (own - few["old_logp"]).abs() * sampled
            out["train/logprob_abs_diff_own_routing"] = float(gap.sum() / sampled.sum().clamp(min=1))
        return out

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on the batch. Micro-batches (and ranks) each aggregate over their own
        samples; their gradients are summed as agg_m * den_m and divided by the whole batch's
        denominator sum_m den_m (`aggregation_denominator`), which equals the whole batch's
        aggregate for every aggregation. One micro-batch on one rank is the plain loss.backward()."""
        t0 = time.perf_counter()
        samples = batch.samples
        shaped = self.shaped_rewards(samples, torch.tensor([sum(s.loss_mask) for s in samples]))
        adv = self.advantages(batch, shaped)
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
        planner = {True: plan_packed_rows, "rows": plan_row_packs}.get(self.packing, plan_micro_batches)
        plan = planner(lengths, self.world_size, self.train_cfg.micro_batch_tokens)
        mine, n_micro = plan[self.rank], max(len(p) for p in plan)
        plain = n_micro == 1 and self.world_size == 1
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[dict[str, float]] = []
        den_sum = kept_sum = 0.0
        t_forward = time.perf_counter()
        forward_s = backward_s = 0.0
        for m in range(n_micro):
            # a rank with fewer micro-batches repeats one at weight 0: FSDP needs every rank in every pass
            idx, weight = (mine[m], 1.0) if m < len(mine) else ((mine or [[0]])[0], 0.0)
            tf = time.perf_counter()
            loss, out, mask = self._micro_loss([samples[i] for i in idx], adv[idx], probe=m == 0)
            den = float(aggregation_denominator(mask, self.algorithm.aggregation))
            tb = time.perf_counter()
            (loss if plain else loss * (max(den, 1.0) * weight)).backward()
            forward_s += tb - tf
            backward_s += time.perf_counter() - tb
            if weight:
                parts.append({**out, "train/objective_weight": den})
                den_sum += den
                kept_sum += float((mask > 0).sum())
        den_all, kept_all = all_reduce_sum([den_sum, kept_sum], self.device)
        if not plain:  # FSDP averaged the ranks' gradients: x world_size / the whole batch's denominator
            scale = self.world_size / max(den_all, 1.0)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        t_optimizer = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                                   self.train_cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        t_done = time.perf_counter()
        self.version += 1

        out = step_metrics_merge(parts) if parts else {}
        staleness = batch.staleness()
        rewards = [s.reward for s in samples]
        out.update({
            "train/grad_norm": float(grad_norm),
            "train/tokens": kept_all,
            "train/samples": float(len(samples)),
            "train/version": float(self.version),
            "train/micro_batches": float(n_micro),
            "train/padding_share": padding_share(plan, lengths, packed=self.packing),
            "rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/completion_len": sum(len(s.completion_ids) for s in samples) / len(samples),
            "staleness/mean": sum(staleness) / len(staleness),
            "staleness/max": float(max(staleness)),
        })
        if self.algorithm.overlong_buffer:
            out["rollout/overlong_penalty_mean"] = float((shaped.cpu() - torch.tensor(rewards)).mean())
        if not math.isfinite(out.get("train/loss", 0.0)):
            raise FloatingPointError(f"non-finite loss at step {self.version}: {out}")
        # where the step's time went (bench/step_anatomy.py): batch prep, forward (+ reference), backward, optimizer
        out.update({"perf/trainer_prepare_s": t_forward - t0, "perf/trainer_forward_s": forward_s,
                    "perf/trainer_backward_s": backward_s, "perf/trainer_optimizer_s": t_done - t_optimizer})
        self.busy_s += time.perf_counter() - t0
        out["perf/trainer_step_s"] = time.perf_counter() - t0
        return out

    @torch.no_grad()
    def logprobs(self, samples: list[Sample], bf16: bool = False, replay: bool = True) -> list[list[float]]:
        """The current policy's logprob of every completion token of each sample (tests, scoring).

        `bf16`: computed by a copy of the policy whose parameters are bf16 — so its activations, norms
        and residual stream are too — as a bf16 engine serves it: how far serving in bf16 moves each logprob.
        Autocast is not that: it keeps the residual stream and norms in fp32. Measured on the Qwen2-style
        tiny model, a token that vLLM's bf16 moved 0.194 from fp32 moved 0.194 in a bf16 copy and 0.017
        under autocast. One rank only: a sharded policy is not copied."""
        tensors = to_device(pad_samples(samples, self.tokenizer.pad_token_id), self.device)
        if not replay:  # a mixture-of-experts policy's own router on every token, recorded experts or not
            tensors.pop("routing", None)
        if bf16:
            if self.world_size > 1:
                raise ValueError("Trainer.logprobs(bf16=True) runs on one rank; this trainer is sharded")
            held = copy.deepcopy(self.policy)
            for param in held.parameters():  # buffers (RoPE's frequencies) stay fp32, as in a bf16-loaded model
                param.data = param.data.to(torch.bfloat16)
            if self.routing is not None:
                held.routing = self.routing.rehook(held.lm)
        else:
            held = self.policy
        logp = self._forward(held, tensors).cpu()  # (autocast, where precision=bf16, is a no-op on a bf16 copy)
        return [logp[i, : len(s.completion_ids)].tolist() for i, s in enumerate(samples)]

    # ---- weights out -------------------------------------------------------------------------

    def _lora_scaling(self) -> float:
        return float(self.train_cfg.lora.alpha) / float(self.train_cfg.lora.rank)

    def _own_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The state dict without the second names of shared parameters: with tied embeddings
        `lm_head.weight` is `model.embed_tokens.weight`, which the engine and a saved model hold once."""
        aliases = ({n for n, _ in self.model.named_parameters(remove_duplicate=False)}
                   - {n for n, _ in self.model.named_parameters()})
        return ((k, v) for k, v in self.model.state_dict().items() if k not in aliases)

    def weight_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's weights under their Hugging Face names (what vLLM's loaders expect), one at a
        time, LoRA merged in, each shared parameter once. Sharded weights are gathered one tensor at a
        time, so no rank ever holds a second full copy — and every rank must walk this iterator together."""
        from factory.training.parallel import full_tensors

        items = full_tensors(self._own_state())
        yield from merge_lora(items, self._lora_scaling()) if self.lora else items

    def weight_shapes(self) -> list[tuple[str, list[int]]]:
        """(name, shape) of `weight_items`, in its order, without gathering or computing anything."""
        meta = ((k, torch.empty(v.shape, dtype=v.dtype, device="meta")) for k, v in self._own_state())
        items = merge_lora(meta, self._lora_scaling()) if self.lora else meta
        return [(k, list(v.shape)) for k, v in items]

    def named_weights(self) -> dict[str, torch.Tensor]:
        """`weight_items` as a dict (one full copy: for tests and replay on one rank)."""
        return dict(self.weight_items())

    def save_hf(self, out_dir: str | Path) -> Path:
        """A servable HF model dir (LoRA merged in). Every rank calls it; rank 0 writes."""
        out = Path(out_dir)
        if self.world_size == 1 and not self.lora:
            self.model.save_pretrained(str(out))
        else:
            base: Any = self.model.get_base_model() if self.lora else self.model  # type: ignore[operator]  # PEFT's, when LoRA
            save_hf_streaming(self.weight_items(), out, base.config if self.rank == 0 else None)
        if self.rank == 0:
            self.tokenizer.save_pretrained(out)
        return out

    def save_adapter(self, out_dir: str | Path) -> Path:
        """The LoRA adapter alone (PEFT format: adapter_config.json + weights), what engines load in place."""
        if not self.lora:
            raise ValueError("save_adapter: train.lora.enabled is false; there is no adapter")
        out = Path(out_dir)
        if self.world_size == 1:
            self.model.save_pretrained(str(out))
            return out
        from peft.utils import get_peft_model_state_dict

        from factory.training.parallel import full_tensors

        # the adapter's tensors gathered (every rank), then written by rank 0 in PEFT's layout
        adapter = dict(full_tensors(get_peft_model_state_dict(self.model).items()))  # type: ignore[arg-type]
        if self.rank == 0:
            from safetensors.torch import save_file

            out.mkdir(parents=True, exist_ok=True)
            self.model.peft_config["default"].save_pretrained(str(out))
            save_file({k: v.contiguous().cpu() for k, v in adapter.items()}, str(out / "adapter_model.safetensors"),
                      metadata={"format": "pt"})
        return out

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, out_dir: str | Path, extra: dict[str, Any]) -> Path:
        """Model (HF format, servable), optimizer, version and the caller's state (sampler, buffer).

        One rank: `trainer.pt` holds the optimizer. Several: `dcp/` holds model and optimizer as
        torch.distributed.checkpoint shards (each rank writes its own; the caller gathers the ranks'
        directories into one), which any number of ranks — one included — can load."""
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"version": self.version, "rng": torch.get_rng_state()}
        if self.world_size > 1:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        else:
            state["optimizer"] = self.optimizer.state_dict()
        self.save_hf(tmp)
        if self.lora:
            self.save_adapter(tmp / "adapter")
        if self.rank == 0:
            torch.save(state, tmp / "trainer.pt")
            (tmp / "state.json").write_text(json.dumps({"version": self.version, "ranks": self.world_size, **extra}))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)  # a crash mid-save leaves the previous checkpoint intact
        return out

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Continue from a checkpoint written by any number of ranks: weights (the adapter alone with
        LoRA: the base stays the original policy this trainer was built on, as does the KL
        reference), optimizer, version and RNG state."""
        ckpt = Path(ckpt_dir)
        state = torch.load(ckpt / "trainer.pt", weights_only=False, map_location="cpu")
        if (ckpt / "dcp").is_dir():  # sharded: resharded onto however many ranks load it
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt / "dcp"))
            set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        elif self.world_size > 1:  # a one-rank checkpoint onto several ranks
            self._load_full_checkpoint(ckpt, state["optimizer"])
        else:
            from transformers import AutoModelForCausalLM

            if self.lora:  # the base stays frozen; only the adapter was trained
                from peft import load_peft_weights, set_peft_model_state_dict

                set_peft_model_state_dict(self.model, load_peft_weights(str(ckpt / "adapter")))
            else:
                self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict())
                self.model.to(self.device)  # type: ignore[arg-type]  # transformers types .to as the unbound Module.to
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        if "rng" in state:
            torch.set_rng_state(state["rng"].cpu())
        return json.loads((ckpt / "state.json").read_text())

    def _load_full_checkpoint(self, ckpt: Path, optimizer_state: dict[str, Any]) -> None:
        """A one-rank checkpoint (HF weights + an optimizer state keyed by parameter index) into this
        rank's shards, through full state dicts keyed by parameter name."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict,
        )
        from transformers import AutoModelForCausalLM

        if self.lora:
            from factory.training.parallel import TrainerSetupError

            raise TrainerSetupError(f"{ckpt}: resuming a one-rank LoRA checkpoint on {self.world_size} ranks is "
                                    "not supported; resume it with train.ranks=1")
        full = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, full, options=options)
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        by_name: dict[str, Any] = {"state": {names[i]: v for i, v in optimizer_state["state"].items()},
                   "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                    for g in optimizer_state["param_groups"]]}
        set_optimizer_state_dict(self.model, self.optimizer, by_name, options=options)


def merge_lora(items, scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A PEFT LoRA model's state dict, streamed, as the merged model's: `W + (B @ A) * scaling` under
    the base layer's name (what `merge_and_unload` computes), other weights renamed out of PEFT's
    wrapping. Holds at most one layer's base weight while it waits for the layer's A and B."""
    prefix = "base_model.model."
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in items:
        name = name.removeprefix(prefix)
        if ".lora_A." in name or ".lora_B." in name:
            module, part = name.split(".lora_A." if ".lora_A." in name else ".lora_B.")[0], name
            key = "A" if ".lora_A." in part else "B"
        elif name.endswith(".base_layer.weight"):
            module, key = name.removesuffix(".base_layer.weight"), "W"
        else:
            yield name.replace(".base_layer.", "."), t
            continue
        parts = waiting.setdefault(module, {})
        parts[key] = t
        if len(parts) == 3:
            del waiting[module]
            yield f"{module}.weight", parts["W"] + (parts["B"] @ parts["A"]) * scaling
    if waiting:
        raise ValueError(f"LoRA layers without base, A and B weights: {sorted(waiting)}")


def save_hf_streaming(items, out: Path, config, shard_bytes: int = 2 << 30) -> None:
    """Write `items` as a Hugging Face safetensors model (shards of `shard_bytes` written as they
    fill, with an index past one) when `config` is given; otherwise only walk them (the other ranks'
    part of the gathers)."""
    from safetensors.torch import save_file

    if config is not None:
        out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = out / f"part-{len(written):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, t in items:
        if config is None:
            continue
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = t.detach().to("cpu", copy=True).contiguous()  # its own storage: tied weights share one
        size += nbytes
        total += nbytes
    if config is None:
        return
    flush()
    if len(written) == 1:
        written[0][0].rename(out / "model.safetensors")
    else:
        weight_map = {}
        for i, (path, names) in enumerate(written):
            fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
            path.rename(out / fname)
            weight_map.update(dict.fromkeys(names, fname))
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(out)
