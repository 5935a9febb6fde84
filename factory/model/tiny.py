"""Build a tiny Llama-style policy and a byte-level BPE tokenizer with a chat template, locally.

No hub is reachable, so the tokenizer is trained on the task text itself and the model starts
from random weights (see sft.py for the warm start). Both are saved in Hugging Face format, which
transformers and vLLM load offline.
"""

from __future__ import annotations

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


def build_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE trained on `texts`; digits are split one per token (arithmetic needs it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=END, pad_token=PAD, additional_special_tokens=ROLE_TOKENS
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_model(tokenizer, section, out_dir: Path):
    """A randomly initialised Llama sized by the recipe's model section, saved as float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(section.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=section.hidden_size,
        intermediate_size=section.intermediate_size,
        num_hidden_layers=section.num_layers,
        num_attention_heads=section.num_heads,
        num_key_value_heads=section.num_heads,
        max_position_embeddings=section.max_position,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    return model
