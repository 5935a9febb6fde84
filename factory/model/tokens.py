"""Turning chat messages into token ids: the one place the chat template is applied."""

from __future__ import annotations


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def end_token_id(tokenizer) -> int:
    return tokenizer.eos_token_id
