"""A second architecture through the real stack: the Qwen2-style tiny model of recipes/qwen2_tiny.yaml
(q/k/v biases, grouped-query attention, tied embeddings, ChatML with <|im_end|> as EOS) on its own
vLLM server: generation stops on <|im_end|>, broadcast and disk weight sync land exactly, the run
loop trains and evaluates it in the single-turn and tool-agent environments, and `factory replay`
retrains a run bitwise."""

from __future__ import annotations

import json

import ray
import torch

from factory.cli import main
from factory.rollout.engine import SamplingParams
from factory.run import connect_broadcast, publish_weights, run
from factory.runtime.actors import TrainerActor
from factory.core.types import Batch, Group, Task

from .conftest import qwen2_recipe
from .test_weight_sync import UNPACKED, check_against_bf16, check_weights_exact, sample_engine

QUIET = ["eval.before=false"]


def engine_holds(engine, checkpoint) -> None:
    """The engine serves exactly the weights of `checkpoint` (rounded to bf16), the tied head as the embedding."""
    from safetensors.torch import load_file

    saved = load_file(str(checkpoint / "model.safetensors"))
    assert "lm_head.weight" not in saved  # tied: saved once, as model.embed_tokens.weight
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a float sum's order depends on the threads: sum as the one-thread engine does
    try:
        for name in UNPACKED:
            want = float(saved[name].to(torch.bfloat16).float().sum())
            assert ray.get(engine.weight_checksum.remote(name)) == want, name
    finally:
        torch.set_num_threads(threads)


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_built_as_qwen2_stops_on_im_end_and_syncs_exactly(qwen2_engine, qwen2_policy):
    from transformers import AutoConfig, AutoTokenizer

    from factory.model.tokens import encode_chat

    config = AutoConfig.from_pretrained(qwen2_policy)
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.num_key_value_heads < config.num_attention_heads
    tokenizer = AutoTokenizer.from_pretrained(qwen2_policy)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == config.eos_token_id == end
    prompt = encode_chat(tokenizer, [{"role": "user", "content": "Calculate 12 + 34."}])
    assert tokenizer.decode(prompt) == "<|im_start|>user\nCalculate 12 + 34.<|im_end|>\n<|im_start|>assistant\n"

    # no stop ids given: vLLM stops on the EOS the model dir declares
    gens = ray.get([qwen2_engine.generate.remote(prompt, SamplingParams(max_new_tokens=8), f"eos-{i}")
                    for i in range(16)])
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert len(stopped) >= 12, [tokenizer.decode(g.token_ids) for g in gens]
    assert all(g.token_ids[-1] == end and end not in g.token_ids[:-1] for g in stopped)

    # broadcast (the tied head travels once, as the embedding), then a disk reload, each exact
    recipe = qwen2_recipe("train.lr=1e-2")  # big steps, so old and new weights differ clearly
    trainer = TrainerActor.remote(str(qwen2_policy), recipe.algorithm, recipe.train, recipe.rollout)
    connect_broadcast([qwen2_engine], trainer)
    publish_weights([qwen2_engine], trainer, 0, "broadcast")
    check_weights_exact(qwen2_engine, trainer)
    for version, mode in [(1, "broadcast"), (2, "disk")]:
        samples = sample_engine(qwen2_engine, tokenizer, "Calculate 12 + 34.", 16, f"{mode}-{version}")
        check_against_bf16(samples, trainer)  # biases, shared kv heads and the tied head computed alike
        for i, s in enumerate(samples):
            s.reward = float(i % 2)
        ray.get(trainer.train_step.remote(Batch(version - 1, [Group("g", Task("t", "basic_arithmetic", "q", "46"),
                                                                        samples)])))
        publish_weights([qwen2_engine], trainer, version, mode)
        check_weights_exact(qwen2_engine, trainer)
    after = sample_engine(qwen2_engine, tokenizer, "Calculate 12 + 34.", 16, "after")
    assert all(v == 2 for s in after for v in s.versions)
    check_against_bf16(after, trainer)
    ray.kill(trainer)


def test_rl_run_evaluates_and_replays_bitwise(qwen2_engine, tmp_path, capsys):
    recipe = qwen2_recipe("async.max_staleness=1", "train.steps=3", "eval.heldout=32", *QUIET)
    run_dir = tmp_path / f"{tmp_path.name}-run"
    results = run(recipe, run_dir, engines=[qwen2_engine])
    assert results["after"]["n"] == 32 and 0.0 <= results["after"]["mean"] <= 1.0
    rows = rows_of(run_dir)
    assert results["samples_trained"] == len(rows) > 0
    for r in rows:
        assert r["prompt_text"].startswith("<|im_start|>user\n") and r["prompt_text"].endswith("<|im_start|>assistant\n")
        # a reply ends on <|im_end|> (sampled, or appended by the gateway after a length cut-off), once
        assert r["completion_text"].endswith("<|im_end|>") and r["completion_text"].count("<|im_end|>") == 1
    engine_holds(qwen2_engine, run_dir / "checkpoints" / "step-000003")  # the broadcast of the last step

    assert main(["replay", run_dir.name]) == 0
    out = capsys.readouterr().out
    assert "replayed 3 steps" in out and "weights: bitwise identical to" in out, out


def test_tool_agent_episodes_with_disk_sync(qwen2_engine, tmp_path):
    # the policy was warm-started without tools: most episodes answer at once; what is checked is that
    # the loop, the ChatML tool turns and a disk reload of the tied model all work with this model
    recipe = qwen2_recipe("environment.name=tool_agent", "environment.sandbox.backend=bubblewrap",
                          "rollout.weight_sync=disk", "train.steps=2", "async.max_staleness=0",
                          "rollout.max_new_tokens=48", "eval.after=false", *QUIET)
    results = run(recipe, tmp_path, engines=[qwen2_engine])
    rows = rows_of(tmp_path)
    assert results["samples_trained"] == len(rows) > 0 and {r["env"] for r in rows} == {"tool_agent"}
    for r in rows:
        assert r["prompt_text"].startswith("<|im_start|>system\n")
        assert 1 <= r["turns"] <= recipe.environment.max_turns
        assert r["completion_text"].endswith("<|im_end|>") and r["completion_text"].count("<|im_end|>") >= r["turns"]
        # a later turn follows the template: the newline after <|im_end|>, then the tool result's message
        assert (r["turns"] > 1) == ("<|im_end|>\n<|im_start|>tool\n" in r["completion_text"])
        assert "<|im_end|><|im_start|>" not in r["prompt_text"] + r["completion_text"]
    engine_holds(qwen2_engine, tmp_path / "checkpoints" / "step-000002")
