"""The tiny architectures' chat formats (factory/model/tiny.py) through everything that turns
messages into ids: the template, the gateway's multi-turn ids, the SFT targets and the trainer's
weight export. ChatML writes a newline after each <|im_end|>, which the engine never samples (it stops
on <|im_end|>): the next turn's ids must carry it, so an episode's ids are the whole rendered
conversation, token for token, in both formats."""

from __future__ import annotations

import asyncio

import pytest

from factory.model.tiny import build_model, build_tokenizer
from factory.model.tokens import encode_chat, encode_continuation, encode_reply, render_chat
from factory.recipe import ModelSection
from factory.rollout.engine import SamplingParams
from factory.rollout.gateway import Gateway

from ..rollout.test_gateway import ScriptedEngine, ids_of

TOOLS = [{"type": "function", "function": {"name": "run_python", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "run_python", "arguments": {"code": "print(12 * 34)"}}</tool_call>'
TEXTS = ["Calculate 12 * 34.", "408", CALL, "The answer is 408."] * 20


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tokenizer(request, tmp_path_factory):
    return build_tokenizer(TEXTS, 320, tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return build_tokenizer(TEXTS, 320, tmp_path_factory.mktemp("chatml"), "qwen2")


def test_chatml_renders_as_qwen2_models_do(chatml):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Calculate 12 * 34."},
                {"role": "assistant", "content": "408"}]
    assert render_chat(chatml, messages[:2]) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                                 "<|im_start|>user\nCalculate 12 * 34.<|im_end|>\n"
                                                 "<|im_start|>assistant\n")
    assert render_chat(chatml, messages, add_generation_prompt=False).endswith("<|im_start|>assistant\n408<|im_end|>\n")
    assert chatml.eos_token == "<|im_end|>" and chatml.pad_token == "<|endoftext|>"
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):  # one id each, never split by BPE
        assert len(ids_of(chatml, special)) == 1
    # the reply a model must sample ends at <|im_end|>: the newline after it belongs to the next turn
    assert encode_reply(chatml, messages[:2], messages[2]) == ids_of(chatml, "408") + [chatml.eos_token_id]
    assert chatml.decode(encode_continuation(chatml, messages, [{"role": "user", "content": "Thanks."}])) == \
        "\n<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n"


def test_tool_episode_ids_are_the_rendered_conversation(tokenizer):
    """Gateway, two turns with a tool result between: the ids the engine saw, plus the last reply, are
    exactly the template's rendering of the whole conversation up to its last end token."""
    end = tokenizer.eos_token_id
    call_ids, answer_ids = ids_of(tokenizer, CALL) + [end], ids_of(tokenizer, "408") + [end]
    engine = ScriptedEngine([call_ids, answer_ids])
    gw = Gateway(tokenizer, [engine], SamplingParams(max_new_tokens=128))
    convo = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "Calculate 12 * 34."}]
    first = asyncio.run(gw.chat("s", {"messages": convo, "tools": TOOLS}))
    call = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    convo += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "408"}]
    second = asyncio.run(gw.chat("s", {"messages": convo, "tools": TOOLS}))
    convo.append(second["choices"][0]["message"])
    sample = gw.finish("s", sample_id="s", group_id="g", task_id="t", reward=1.0, env="tool_agent")

    everything = sample.prompt_ids + sample.completion_ids
    assert everything == engine.seen[1] + answer_ids
    rendered = render_chat(tokenizer, convo, add_generation_prompt=False)
    assert tokenizer.decode(everything) == rendered[: rendered.rfind(tokenizer.eos_token) + len(tokenizer.eos_token)]
    between = everything[len(engine.seen[0]) + len(call_ids): len(engine.seen[1])]  # the tool turn, not sampled
    assert sample.loss_mask == [1] * len(call_ids) + [0] * len(between) + [1] * len(answer_ids)


def test_sft_demonstration_is_what_the_gateway_would_build(tokenizer):
    """The warm start's example for a second turn has the same ids the gateway sends before that turn."""
    from factory.model.sft import sft_examples

    episode = [{"role": "user", "content": "Calculate 12 * 34."},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"type": "function", "function": {"name": "run_python", "arguments": {"code": "print(12 * 34)"}}}]},
               {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}]

    class Demo:
        def demonstration(self, task):
            return episode

    (p1, r1), (p2, r2) = sft_examples(tokenizer, Demo(), [None])
    assert r1[-1] == r2[-1] == tokenizer.eos_token_id and r2 == ids_of(tokenizer, "408") + [tokenizer.eos_token_id]
    assert p2 == p1 + r1 + encode_continuation(tokenizer, episode[:2], episode[2:3])
    rendered = render_chat(tokenizer, episode, add_generation_prompt=False)
    assert tokenizer.decode(p2 + r2) == rendered[: rendered.rfind(tokenizer.eos_token) + len(tokenizer.eos_token)]
    assert p1 == encode_chat(tokenizer, episode[:1])


def test_qwen2_is_built_with_biases_gqa_and_tied_embeddings_and_exports_each_weight_once(chatml, tmp_path):
    from factory.recipe import load_recipe
    from factory.training.trainer import Trainer
    from factory.paths import REPO_ROOT

    section = ModelSection(architecture="qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=64)
    model = build_model(chatml, section, tmp_path)
    chatml.save_pretrained(tmp_path)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings and cfg.num_key_value_heads == 2
    assert cfg.eos_token_id == chatml.convert_tokens_to_ids("<|im_end|>")
    names = dict(model.named_parameters())
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.self_attn.v_proj.bias"} <= set(names)
    assert names["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32 // 4, 32)
    assert model.get_output_embeddings().weight is names["model.embed_tokens.weight"]

    recipe = load_recipe(REPO_ROOT / "recipes" / "qwen2_tiny.yaml", ["train.threads=1"])
    trainer = Trainer(str(tmp_path), recipe.algorithm, recipe.train, recipe.rollout)
    shapes = trainer.weight_shapes()
    # the tied head travels once, as the embedding: what a saved model holds and vLLM loads
    assert [n for n, _ in shapes] == [n for n, _ in trainer.weight_items()] == list(names)
    assert "lm_head.weight" not in dict(shapes)
    from safetensors.torch import load_file

    saved = load_file(str(trainer.save_hf(tmp_path / "out") / "model.safetensors"))
    assert set(saved) == set(names)


def test_qwen3_is_built_with_qk_norms_no_biases_and_tied_embeddings(chatml, tmp_path):
    section = ModelSection(architecture="qwen3", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                           intermediate_size=128)
    model = build_model(chatml, section, tmp_path)
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.tie_word_embeddings and cfg.head_dim == 32
    names = dict(model.named_parameters())
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= set(names)
    assert not any(n.endswith(".bias") for n in names)
    assert model.get_output_embeddings().weight is names["model.embed_tokens.weight"]


def test_qwen3_moe_keeps_experts_fused_saves_them_per_expert_and_loads_either(chatml, tmp_path):
    """transformers trains the experts fused ([E, 2I, H] and [E, H, I]); save_pretrained writes them per
    expert, the trainer's streamed save (ranks > 1, LoRA) fused: transformers loads both back alike."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from factory.training.trainer import save_hf_streaming

    section = ModelSection(architecture="qwen3_moe", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                           intermediate_size=128, num_experts=4, experts_per_token=2)
    assert section.expert_width == 64
    model = build_model(chatml, section, tmp_path / "built")
    cfg = model.config
    assert cfg.model_type == "qwen3_moe" and not cfg.tie_word_embeddings and not cfg.output_router_logits
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 64)
    assert cfg.norm_topk_prob and cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == []
    names = dict(model.named_parameters())
    assert names["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 64)
    assert names["model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 64)
    assert names["model.layers.0.mlp.gate.weight"].shape == (4, 64)
    saved = load_file(str(tmp_path / "built" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved and not any(".experts.gate_up" in n for n in saved)
    assert torch.equal(saved["model.layers.1.mlp.experts.3.up_proj.weight"],
                       names["model.layers.1.mlp.experts.gate_up_proj"][3, 64:])
    save_hf_streaming(model.state_dict().items(), tmp_path / "fused", model.config)
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(tmp_path / "fused" / "model.safetensors"))
    for where in ("built", "fused"):
        back = dict(AutoModelForCausalLM.from_pretrained(tmp_path / where, dtype=torch.float32).named_parameters())
        assert back.keys() == names.keys() and all(torch.equal(back[n], names[n]) for n in names), where


@pytest.mark.parametrize("fields, error", [
    (dict(architecture="qwen3_moe", num_experts=2, experts_per_token=4), "experts_per_token: 4 must not exceed"),
    (dict(architecture="qwen3", num_experts=4), "num_experts: only meaningful for architecture qwen3_moe"),
])
def test_expert_fields_are_checked(fields, error):
    with pytest.raises(ValueError, match=error):
        ModelSection(**fields)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_load_tokenizer_reads_a_generic_tokenizer_as_autotokenizer_does(architecture, tmp_path):
    """The env worker's lean loader (no torch) gives the ids, specials and template AutoTokenizer gives."""
    import json

    from transformers import AutoTokenizer

    from factory.model.tokens import load_tokenizer

    build_tokenizer(TEXTS, 320, tmp_path, architecture)
    lean, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert type(lean) is type(auto)
    assert (lean.eos_token_id, lean.pad_token_id, lean.all_special_ids) == (auto.eos_token_id, auto.pad_token_id,
                                                                            auto.all_special_ids)
    first = [{"role": "user", "content": "Calculate 12 * 34."}]
    turn = [{"role": "assistant", "content": CALL}]
    more = [{"role": "tool", "content": "408"}]
    for tok in (lean, auto):
        assert encode_chat(tok, first, tools=TOOLS) == encode_chat(auto, first, tools=TOOLS)
        assert encode_continuation(tok, first + turn, more, TOOLS) == encode_continuation(auto, first + turn, more, TOOLS)
    ids = encode_chat(auto, first + turn, add_generation_prompt=False)
    assert lean.decode(ids) == auto.decode(ids)


def test_load_tokenizer_needs_no_torch_and_leaves_other_classes_to_autotokenizer(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from factory.model.tokens import load_tokenizer

    build_tokenizer(TEXTS, 320, tmp_path, "qwen2")
    code = ("import sys; from factory.model.tokens import load_tokenizer; "
            f"t = load_tokenizer({str(tmp_path)!r}); print(t.eos_token_id, 'torch' in sys.modules)")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, cwd=repo)
    assert out.stdout.split()[-1] == "False", out.stdout  # the tokenizer loaded without importing torch
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_tokenizer(tmp_path)).__name__ == "Qwen2Tokenizer"  # a model's own class: AutoTokenizer's
