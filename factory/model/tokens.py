"""Turning chat messages into token ids: the one place the chat template is applied.

The gateway and the SFT warm start both build multi-turn ids here, the same way: a conversation's
ids are the first prompt's ids, then each reply's ids, then only the *new* messages' ids
(`encode_continuation`), never a re-tokenization of the whole conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

# Tokenizer classes that are the tokenizers library's tokenizer.json and nothing more (no model-specific
# Python): transformers 5's backend and its v4 name. Our built policies and e.g. Llama 3 save these.
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of `model_dir`, as AutoTokenizer would load it, without importing torch when it can.

    AutoTokenizer imports transformers' configuration and generation modules, which import torch:
    ~5 CPU-s in a process that only tokenizes (an env worker, started for every run). A directory whose
    tokenizer_config names a generic class loads through that class directly (~1 s, no torch); any other
    (a model-specific class, remote code, no config) goes through AutoTokenizer, unchanged."""
    config = Path(model_dir) / "tokenizer_config.json"
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    if cfg.get("tokenizer_class") in GENERIC_TOKENIZERS and "auto_map" not in cfg:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list | None = None) -> list[int]:
    text = render_chat(tokenizer, messages, add_generation_prompt, tools)
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_chats(tokenizer, conversations: list[list[dict]], tools: list | None = None) -> list[list[int]]:
    """`encode_chat` of many conversations at once (their prompts: a generation prompt added): one
    template call and one batch encode, ~1 s for 9,000 tasks where one call each takes several."""
    if not conversations:
        return []
    texts = tokenizer.apply_chat_template(conversations, tools=tools or None, add_generation_prompt=True,
                                          tokenize=False)
    return tokenizer(texts, add_special_tokens=False).input_ids


def _known_end(tokenizer, text: str) -> int:
    """Where the ids known for a conversation ending in a reply stop in its rendered `text`: just past
    the reply's end token, which is where sampling stopped. A template may write more after it (ChatML's
    newline after <|im_end|>); that text belongs to what comes next."""
    end = tokenizer.eos_token
    cut = text.rfind(end) if end else -1
    return len(text) if cut < 0 else cut + len(end)


def encode_continuation(tokenizer, old: list[dict], new: list[dict], tools: list | None = None) -> list[int]:
    """Ids of messages `new` (and the generation prompt) appended to a conversation `old` whose ids
    are already known up to its last end token: the template rendered for old + new, minus the
    template rendered for old alone up to that token (what the template puts after it is sent here).
    Raises ValueError if the template does not render the longer conversation as an extension."""
    old_text = render_chat(tokenizer, old, add_generation_prompt=False, tools=tools)
    full_text = render_chat(tokenizer, old + new, add_generation_prompt=True, tools=tools)
    if not full_text.startswith(old_text):
        raise ValueError("the chat template does not render the conversation as a prefix extension")
    return tokenizer(full_text[_known_end(tokenizer, old_text):], add_special_tokens=False).input_ids


def encode_reply(tokenizer, context: list[dict], reply: dict, tools: list | None = None) -> list[int]:
    """Ids of assistant message `reply` after `context` as the template renders it, up to and including
    its end token: what a model must sample for that reply (the SFT target of a demonstration turn)."""
    prompt = render_chat(tokenizer, context, add_generation_prompt=True, tools=tools)
    full = render_chat(tokenizer, context + [reply], add_generation_prompt=False, tools=tools)
    if not full.startswith(prompt):
        raise ValueError("the chat template does not render a reply after its generation prompt")
    end = _known_end(tokenizer, full)
    return tokenizer(full[len(prompt):end if end > len(prompt) else len(full)], add_special_tokens=False).input_ids


def end_token_id(tokenizer) -> int:
    return tokenizer.eos_token_id
