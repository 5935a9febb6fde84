"""Build a tiny policy and a byte-level BPE tokenizer with a chat template, locally.

No hub is reachable, so the tokenizer is trained on the task text itself and the model starts
from random weights (see sft.py for the warm start). Both are saved in Hugging Face format, which
transformers and vLLM load offline. Four architectures (`model.architecture`), each with the chat
format its family uses:

* **llama**: role tags (`<|user|>...<|end|>`), `<|end|>` as EOS, untied input and output embeddings.
* **qwen2**: ChatML (`<|im_start|>user\n...<|im_end|>\n`), `<|im_end|>` as EOS, biases on q/k/v,
  grouped-query attention (`model.num_kv_heads`) and tied embeddings, as Qwen2/Qwen2.5 models have.
* **qwen3**: Qwen2's ChatML, no attention biases, RMSNorm on each head's queries and keys, tied
  embeddings (as the small Qwen3 models have).
* **qwen3_moe**: Qwen3's attention with a mixture-of-experts MLP in every block (`model.num_experts`
  experts of `model.expert_intermediate_size`, `model.experts_per_token` routed per token, their
  weights renormalised), untied embeddings (as Qwen3-30B-A3B has); the router's auxiliary loss is off.
  transformers keeps each block's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H],
  `mlp.experts.down_proj` [E, H, I]) and `save_pretrained` writes them per expert
  (`mlp.experts.{i}.gate_proj.weight`, …); vLLM loads either.

Nothing outside this file knows either format: the rest of Factory reads the chat template, the
EOS token and the parameter names from what transformers loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

END = "<|end|>"
PAD = "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
SPECIAL_TOKENS = [PAD, END, *ROLE_TOKENS]

# One role tag, the content, then <|end|>; <|end|> is also EOS, so a reply stops on it. An
# assistant message's tool calls follow its content as <tool_call>{"name": ..., "arguments": ...}</tool_call>
# (what the gateway parses out of sampled text); tool results are <|tool|> messages. Tool schemas
# are not rendered: environments describe their tools in the system prompt. A plain chat renders
# exactly as before tool calls existed, so cached models stay valid.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|{{ m['role'] }}|>"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- endif -%}"
    "{%- for call in m['tool_calls'] or [] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "<tool_call>{\"name\": {{ f['name'] | tojson }}, \"arguments\": "
    "{%- if f['arguments'] is string %} {{ f['arguments'] }}{% else %} {{ f['arguments'] | tojson }}{% endif -%}"
    "}</tool_call>"
    "{%- endfor -%}"
    "<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


# ChatML as Qwen2 models render it, without their default system message (a recipe's
# environment.system_prompt gives one); tool calls in the same <tool_call> syntax as above, tool
# results as `tool` messages. Text after each <|im_end|> (the newline) is part of the next turn's
# ids: the engine stops on <|im_end|> (factory/model/tokens.py).
CHATML_TEMPLATE = (  # no whitespace control ({%- -%}): it would eat the newlines ChatML keeps
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% for call in m['tool_calls'] or [] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "<tool_call>{\"name\": {{ f['name'] | tojson }}, \"arguments\": "
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ChatFormat:
    """A tokenizer's special tokens and chat template."""

    eos: str
    pad: str
    special: tuple[str, ...]  # in vocabulary order, from id 0
    extra: tuple[str, ...]  # special tokens beyond eos and pad
    template: str
    sample_text: str  # what the template adds around messages, so BPE learns merges for it


CHAT_FORMATS = {
    "llama": ChatFormat(END, PAD, tuple(SPECIAL_TOKENS), tuple(ROLE_TOKENS), CHAT_TEMPLATE, ""),
    "qwen2": ChatFormat("<|im_end|>", "<|endoftext|>", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                        ("<|im_start|>",), CHATML_TEMPLATE, "system\nuser\nassistant\ntool\n"),
}
CHAT_FORMATS["qwen3"] = CHAT_FORMATS["qwen3_moe"] = CHAT_FORMATS["qwen2"]  # Qwen3 keeps Qwen2's ChatML


def build_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, architecture: str = "llama"):
    """Byte-level BPE trained on `texts`; digits are split one per token (arithmetic needs it); the
    special tokens and chat template of `architecture`'s format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fmt = CHAT_FORMATS[architecture]
    if fmt.sample_text:
        texts = [*texts, *[fmt.sample_text] * 100]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fmt.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=fmt.eos, pad_token=fmt.pad, additional_special_tokens=list(fmt.extra)
    )
    fast.chat_template = fmt.template
    fast.save_pretrained(out_dir)
    return fast


def build_model(tokenizer, section, out_dir: Path):
    """A randomly initialised model of `section.architecture` sized by the recipe's model section,
    saved as float32."""
    import torch
    from transformers import (
        LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(section.seed)
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=section.hidden_size,
        intermediate_size=section.intermediate_size,
        num_hidden_layers=section.num_layers,
        num_attention_heads=section.num_heads,
        num_key_value_heads=section.num_kv_heads or section.num_heads,
        max_position_embeddings=section.max_position,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model: torch.nn.Module
    qwen3 = dict(head_dim=section.hidden_size // section.num_heads, attention_bias=False, use_sliding_window=False)
    if section.architecture == "qwen2":  # Qwen2's attention always has q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True, use_sliding_window=False))
    elif section.architecture == "qwen3":  # head_dim named: Qwen3Config's default (128) is not hidden / heads
        model = Qwen3ForCausalLM(Qwen3Config(**shape, **qwen3, tie_word_embeddings=True))
    elif section.architecture == "qwen3_moe":  # every block sparse; router logits (and their aux loss) off
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **shape, **qwen3, tie_word_embeddings=False, num_experts=section.num_experts,
            num_experts_per_tok=section.experts_per_token, moe_intermediate_size=section.expert_width,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    model.save_pretrained(out_dir)
    return model
