"""The trainer's device-dependent `auto` settings: the choice of output-layer chunk and activation
checkpointing from memory figures (made up here: the function is pure), and compile's default."""

from __future__ import annotations

from factory.training.memory import (
    SAFE_CHUNK,
    activation_bytes,
    choose_memory_settings,
    logits_bytes,
    resolve_compile,
)

GIB = 2**30
SHAPE = dict(tokens=16384, layers=28, hidden=1536, vocab=151_936)  # the 1.5B shape, a 16k-token micro-batch


def test_plenty_of_memory_turns_checkpointing_off_with_the_largest_chunk():
    pick = choose_memory_settings(140 * GIB, 25 * GIB, **SHAPE)
    assert (pick.logprob_chunk_tokens, pick.activation_checkpointing) == (2048, False)
    assert pick.why.startswith("predicted peak ")


def test_room_for_larger_chunks_but_not_for_the_activations_keeps_checkpointing():
    acts = activation_bytes(SHAPE["tokens"], SHAPE["layers"], SHAPE["hidden"], 2)
    # the 1.5B shape at 16k tokens: measured 75.3 GiB peak without checkpointing, 25.5 with (one H200)
    assert 45 * GIB < 25.5 * GIB + acts < 80 * GIB
    pick = choose_memory_settings(40 * GIB, 25 * GIB, **SHAPE)
    assert (pick.logprob_chunk_tokens, pick.activation_checkpointing) == (2048, True)


def test_a_tight_device_gets_a_smaller_chunk_and_nothing_fitting_keeps_the_safe_setting():
    base = 30 * GIB
    measured = base + logits_bytes(SAFE_CHUNK, SHAPE["vocab"])
    # room for 1,024-token chunks, not 2,048 (usable = 90% of what is available)
    available = int((base + logits_bytes(1024, SHAPE["vocab"]) + 1) / 0.9) + 1
    pick = choose_memory_settings(available, measured, **SHAPE)
    assert (pick.logprob_chunk_tokens, pick.activation_checkpointing) == (1024, True)
    none = choose_memory_settings(measured, measured, **SHAPE)  # already at the margin
    assert (none.logprob_chunk_tokens, none.activation_checkpointing) == (SAFE_CHUNK, True)
    assert none.why.startswith("nothing faster fits")


def test_what_the_recipe_fixed_is_kept():
    fixed_off = choose_memory_settings(40 * GIB, 25 * GIB, **SHAPE, want_checkpointing=False)
    assert fixed_off.activation_checkpointing is False  # nothing fits; the recipe's word stands
    fixed_chunk = choose_memory_settings(140 * GIB, 25 * GIB, **SHAPE, want_chunk=256)
    assert (fixed_chunk.logprob_chunk_tokens, fixed_chunk.activation_checkpointing) == (256, False)


def test_compile_auto_is_on_for_cuda_only():
    assert resolve_compile("auto", "cuda") and not resolve_compile("auto", "cpu")
    assert resolve_compile(True, "cpu") and not resolve_compile(False, "cuda")
