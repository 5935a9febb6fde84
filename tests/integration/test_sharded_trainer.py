"""FSDP2 trainer ranks on Ray (gloo on CPU): two ranks train like one (the Llama and the Qwen3-MoE), their
sharded checkpoint resumes on a different number of ranks, and a whole run with two ranks trains on the
session's vLLM server."""

from __future__ import annotations

import json

import pytest
import ray
import torch
from safetensors.torch import load

from factory.run import run
from factory.runtime.trainers import start_trainer
from factory.runtime.transfer import DirBundle
from factory.core.types import Batch, Group, Sample, Task

from .conftest import small_recipe

pytestmark = pytest.mark.integration

STEPS = ["train.lr=1e-3", "train.grad_clip=1e9"]


def batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(8):
        t, p = int(torch.randint(2, 8, (1,), generator=g)), int(torch.randint(4, 12, (1,), generator=g))
        samples.append(Sample(f"s{seed}-{i}", f"g{i // 4}", "t", prompt_ids=torch.randint(5, 200, (p,), generator=g).tolist(),
                              completion_ids=torch.randint(5, 200, (t,), generator=g).tolist(),
                              logprobs=(-torch.rand(t, generator=g) * 3).tolist(), loss_mask=[1] * t,
                              versions=[0] * t, reward=float(i % 2)))
    return Batch(0, [Group(f"g{j}", Task("t", "f", "q", "a"), samples[4 * j: 4 * j + 4]) for j in range(2)])


def weights_of(bundle: DirBundle) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, data in bundle.files.items():
        if name.endswith(".safetensors") and "/" not in name:
            out.update(load(data))
    return out


def assert_trained_alike(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor], steps: int) -> None:
    """Weights after `steps` AdamW steps on one rank and on two agree within 1e-5, but for the rare
    element whose gradient was near Adam's eps (1e-8). Two ranks sum a gradient in another order, a
    difference of float rounding; Adam divides each element's moment by its own root mean square, so
    where the sum nearly cancels that rounding moves the element by up to lr per step (seen: one LoRA A
    element of 16k, 4e-5 apart, after step 2, the first step whose A gradient is not zero; every other
    element within 5e-6). A wrong shard, scale or reduction moves most elements, which this still fails."""
    lr = 1e-3  # STEPS
    apart = {n: (x[n] - y[n]).abs() for n in x}
    total = sum(d.numel() for d in apart.values())
    outliers = sum(int((d > 1e-5).sum()) for d in apart.values())
    assert outliers <= max(1, total // 10_000), f"{outliers} of {total} elements more than 1e-5 apart"
    assert max(float(d.max()) for d in apart.values()) <= 2 * lr * steps


def test_two_ranks_train_like_one_and_their_checkpoint_resumes_on_one(ray_cluster, policy):
    one, one_actors = start_trainer(str(policy), small_recipe(*STEPS), None, None)
    two, two_actors = start_trainer(str(policy), small_recipe(*STEPS, "train.ranks=2"), None, None)
    for k in range(2):
        m1, m2 = ray.get([one.train_step.remote(batch(k)), two.train_step.remote(batch(k))])
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=1e-5)
        assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-4)
        assert m2["train/tokens"] == m1["train/tokens"]
    ck1, ck2 = ray.get([one.checkpoint.remote({"step": 2}), two.checkpoint.remote({"step": 2})])
    w1, w2 = weights_of(ck1), weights_of(ck2)
    assert w1.keys() == w2.keys()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5
    shards = sorted(n for n in ck2.files if n.startswith("dcp/"))
    assert len([n for n in shards if n.endswith(".distcp")]) == 2 and "dcp/.metadata" in shards

    # the 2-rank checkpoint onto 1 rank (and the 1-rank one onto 2 ranks): the next step matches the original
    resumed_one, r1 = start_trainer(str(policy), small_recipe(*STEPS), None, None)
    resumed_two, r2 = start_trainer(str(policy), small_recipe(*STEPS, "train.ranks=2"), None, None)
    ray.get([resumed_one.load_checkpoint.remote(ck2), resumed_two.load_checkpoint.remote(ck1)])
    assert ray.get(resumed_one.version.remote()) == ray.get(resumed_two.version.remote()) == 2
    refs = [t.train_step.remote(batch(9)) for t in (one, resumed_one, resumed_two)]
    losses = [m["train/loss"] for m in ray.get(refs)]
    assert losses[1] == pytest.approx(losses[0], abs=1e-5) and losses[2] == pytest.approx(losses[0], abs=1e-5)
    after = [weights_of(b) for b in ray.get([t.checkpoint.remote({}) for t in (one, resumed_one, resumed_two)])]
    for other in after[1:]:
        assert max(float((after[0][k] - other[k]).abs().max()) for k in after[0]) < 1e-5
    for actor in one_actors + two_actors + r1 + r2:
        ray.kill(actor)


def test_lora_and_the_kl_reference_work_on_two_ranks(ray_cluster, policy):
    over = [*STEPS, "train.lora.enabled=true", "rollout.weight_sync=lora", "algorithm.kl_coef=0.1"]
    one, a1 = start_trainer(str(policy), small_recipe(*over), None, None)
    two, a2 = start_trainer(str(policy), small_recipe(*over, "train.ranks=2"), None, None)
    for k in range(2):
        m1, m2 = ray.get([one.train_step.remote(batch(k)), two.train_step.remote(batch(k))])
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=1e-5)
        assert m2["train/kl_ref"] == pytest.approx(m1["train/kl_ref"], abs=1e-6)
    assert k == 1 and m1["train/kl_ref"] > 0  # the policy moved away from the reference
    (lora1, _), (lora2, _) = ray.get([one.export_weights.remote("lora"), two.export_weights.remote("lora")])
    (full1, _), (full2, _) = ray.get([one.export_weights.remote("disk"), two.export_weights.remote("disk")])
    for x, y in ((weights_of(lora1), weights_of(lora2)), (weights_of(full1), weights_of(full2))):
        assert x.keys() == y.keys() and len(x) > 0
        assert_trained_alike(x, y, steps=2)
    for actor in a1 + a2:
        ray.kill(actor)


def test_a_run_with_two_trainer_ranks_trains_on_vllm_and_resumes_on_one(engine, tmp_path):
    common = ["train.checkpoint_every=2", "eval.before=false", "eval.heldout=16", "tracking.enabled=false"]
    first = tmp_path / f"{tmp_path.name}-two"
    results = run(small_recipe("train.ranks=2", "train.steps=2", *common), first, engines=[engine])
    assert results["samples_trained"] > 0 and results["after"]["n"] == 16
    steps = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["train/micro_batches"] >= 1 and 0 <= s["train/padding_share"] < 1 for s in steps)
    checkpoint = first / "checkpoints" / "step-000002"
    assert (checkpoint / "dcp" / ".metadata").is_file() and json.loads((checkpoint / "state.json").read_text())["ranks"] == 2
    second = tmp_path / f"{tmp_path.name}-one"
    results = run(small_recipe("train.ranks=1", "train.steps=3", *common), second, engines=[engine],
                  resume_from=checkpoint)
    steps = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [3] and steps[0]["train/version"] == 3


def test_two_ranks_train_the_mixture_of_experts_like_one(ray_cluster, tmp_path):
    """FSDP2 shards each Qwen3-MoE block whole, its fused experts ([E, 2I, H], [E, H, I]) split along the
    experts: two ranks, each routing its own share of the batch, train like one. The two-rank save is
    streamed with the experts fused, the one-rank save writes them per expert (transformers' format):
    transformers loads both to the same model."""
    from transformers import AutoModelForCausalLM

    from factory.training.base_policy import ensure_base_policy

    from .conftest import moe_recipe

    policy = ensure_base_policy(moe_recipe())  # test_qwen3.py's and the shipped recipe's smoke test's
    one, one_actors = start_trainer(str(policy), moe_recipe(*STEPS), None, None)
    two, two_actors = start_trainer(str(policy), moe_recipe(*STEPS, "train.ranks=2"), None, None)
    for k in range(2):
        m1, m2 = ray.get([one.train_step.remote(batch(k)), two.train_step.remote(batch(k))])
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=1e-5)
        assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-4)
    (b1, _), (b2, _) = ray.get([one.export_weights.remote("disk"), two.export_weights.remote("disk")])
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in weights_of(b1)
    assert "model.layers.0.mlp.experts.gate_up_proj" in weights_of(b2)
    x, y = ({n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(
        b.write(tmp_path / name), dtype=torch.float32).named_parameters()} for name, b in (("one", b1), ("two", b2)))
    assert x.keys() == y.keys() and "model.layers.3.mlp.experts.down_proj" in x
    assert_trained_alike(x, y, steps=2)
    for actor in one_actors + two_actors:
        ray.kill(actor)
