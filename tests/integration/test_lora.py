"""LoRA training with adapter-only sync into a real vLLM server (started with LoRA enabled)."""

from __future__ import annotations

import json

import pytest
import ray

from factory.run import publish_weights, run
from factory.runtime.actors import EngineActor, TrainerActor
from factory.core.types import Batch, Group, Task

from .conftest import small_recipe
from .test_weight_sync import check_against_bf16, diffs, sample_engine

LORA = ["train.lora.enabled=true", "rollout.weight_sync=lora", "train.lora.rank=8"]


@pytest.fixture(scope="module")
def lora_engine(ray_cluster, policy, tmp_path_factory):
    recipe = small_recipe(*LORA)
    actor = EngineActor.remote("vllm", str(policy), recipe.rollout,
                               str(tmp_path_factory.mktemp("lora-engine") / "vllm.log"), recipe.train.lora.rank)
    ray.get(actor.start.remote())
    yield actor
    ray.get(actor.stop.remote())


def test_adapter_sync_makes_vllm_match_the_lora_trainer(lora_engine, policy, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    recipe = small_recipe(*LORA, "train.lr=5e-2")  # one big step, so the adapter changes the policy clearly
    trainer = TrainerActor.remote(str(policy), recipe.algorithm, recipe.train, recipe.rollout)
    base = TrainerActor.remote(str(policy), small_recipe().algorithm, small_recipe().train, recipe.rollout)
    first = sample_engine(lora_engine, tokenizer, "Calculate 23 + 9.", 16, "l0")
    for i, s in enumerate(first):
        s.reward = float(i % 2)
    ray.get(trainer.train_step.remote(Batch(0, [Group("g", Task("t", "basic_arithmetic", "q", "32"), first)])))

    sync = publish_weights([lora_engine], trainer, 1, "lora")
    full_bytes = sum(f.stat().st_size for f in policy.iterdir() if f.suffix == ".safetensors")
    assert 0 < sync["weightsync/bytes"] < full_bytes / 2  # the sync moves the adapter, not the model

    after = sample_engine(lora_engine, tokenizer, "Calculate 23 + 9.", 16, "l1")
    assert all(v == 1 for s in after for v in s.versions)
    d_lora = check_against_bf16(after, trainer)
    d_base = diffs(after, ray.get(base.logprobs.remote(after)))
    assert d_base.mean() > 3 * max(float(d_lora.mean()), 0.01), (d_base.mean(), d_lora.mean())


def test_lora_run_trains_only_the_adapter_and_checkpoints_it(lora_engine, tmp_path):
    recipe = small_recipe(*LORA, "train.steps=3", "eval.before=false", "async.max_staleness=1")
    results = run(recipe, tmp_path, engines=[lora_engine])
    assert results["samples_trained"] > 0
    ckpt = tmp_path / "checkpoints" / "step-000003"
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and (ckpt / "config.json").is_file()
    cfg = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 8
    assert 0.0 <= results["after"]["mean"] <= 1.0


def test_a_resumed_lora_run_with_kl_keeps_the_original_policy_as_base_and_reference(lora_engine, tmp_path):
    """The resumed trainer holds base + the checkpoint's adapter (not the merged checkpoint with the
    adapter applied again), and its KL reference is the base policy (were it the checkpoint, the KL
    at the first step after the resume would be ~0): it repeats the run that went on."""
    from .test_resume import check_resume_repeats, step_metrics

    whole, resumed = check_resume_repeats(lora_engine, tmp_path, *LORA, "train.lr=2e-3", "algorithm.kl_coef=0.5")
    kl_whole, kl_resumed = step_metrics(whole, 3)["train/kl_ref"], step_metrics(resumed, 3)["train/kl_ref"]
    assert kl_whole > 1e-6 and kl_resumed == pytest.approx(kl_whole, rel=0.05)
