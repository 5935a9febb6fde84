"""Shared by the trainer tests: a tiny Llama and its tokenizer, built once per module that asks."""

from __future__ import annotations

from factory.recipe import ModelSection


def tiny_model_dir(tmp_path_factory, name: str, **shape) -> str:
    """A locally built tiny Llama (`shape`: ModelSection fields) with a byte-level BPE tokenizer."""
    from factory.model.tiny import build_model, build_tokenizer

    out = tmp_path_factory.mktemp(name)
    tok = build_tokenizer(["12+34=46", "7+8=15", "the answer is 9"] * 4, 270, out)
    build_model(tok, ModelSection(**shape), out)
    return str(out)
