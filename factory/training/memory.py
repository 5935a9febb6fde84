"""The trainer's `auto` settings that depend on the device: output-layer chunk size, activation
checkpointing and compiled decoder blocks.

`choose_memory_settings` is pure (numbers in, a choice out) and unit-tested with made-up memory
figures; the trainer feeds it, on CUDA, the peak the warm-up pass measured under the safe settings
(checkpointing on, 512-token chunks) and the device's memory. On CPU the `auto` answers are today's
fixed ones (512-token chunks, no checkpointing, no compile). The CUDA path has not run here: no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

SAFE_CHUNK = 512  # the chunk the warm-up measures with, and the CPU's auto
CHUNKS = (2048, 1024, 512)  # fastest first (bench/results/trainer_scale_gpu_knobs.json: 8,192 was no faster)
# activations one decoder block keeps per token, per hidden unit and per byte of the compute dtype when not
# checkpointed. Calibrated on one H200 (bench/results/trainer_scale_gpu_knobs.json, 16 x 1,024 tokens, bf16
# autocast, 2,048-token chunks): turning checkpointing off added 23.7 GiB on the Qwen2.5-0.5B shape and
# 49.8 GiB on the 1.5B shape, 36 and 38 per token·hidden·byte·layer (the MLP's intermediate width and
# autocast's fp32 copies make it larger than the textbook ~17 of Korthikanti et al. 2022)
ACTIVATION_FACTOR = 39
MARGIN = 0.10  # of the memory available, left free: the allocator's fragmentation, a longer step than measured


@dataclass(frozen=True)
class MemorySettings:
    logprob_chunk_tokens: int
    activation_checkpointing: bool
    why: str


def logits_bytes(chunk_tokens: int, vocab: int) -> int:
    """What one output-layer chunk holds at its peak: fp32 logits, their log-softmax and its gradient."""
    return 3 * 4 * chunk_tokens * vocab


def activation_bytes(tokens: int, layers: int, hidden: int, dtype_bytes: int) -> int:
    """Activations kept by `layers` blocks over `tokens` positions without checkpointing, less the block
    inputs that checkpointing keeps anyway."""
    return (ACTIVATION_FACTOR - 1) * tokens * hidden * dtype_bytes * layers


def choose_memory_settings(available_bytes: int, measured_peak_bytes: int, tokens: int, layers: int, hidden: int,
                           vocab: int, dtype_bytes: int = 2, measured_chunk: int = SAFE_CHUNK,
                           want_checkpointing: bool | None = None, want_chunk: int | None = None) -> MemorySettings:
    """The fastest (checkpointing off first, then the largest chunk) of the settings whose predicted
    peak stays within `available_bytes` less a margin.

    `measured_peak_bytes`: the peak of one forward and backward pass of `tokens` positions (the largest
    micro-batch) with checkpointing on and `measured_chunk`-token chunks, weights, gradients and optimizer
    state included. A candidate's prediction adds the activations checkpointing no longer recomputes
    (`activation_bytes`) and the difference in one chunk's logits (`logits_bytes`). Where nothing fits the
    answer is the measured (safe) setting. `want_*`: what the recipe fixed (not auto), kept as given."""
    budget = int(available_bytes * (1 - MARGIN))
    base = measured_peak_bytes - logits_bytes(measured_chunk, vocab)
    ckpt_options = [want_checkpointing] if want_checkpointing is not None else [False, True]
    chunk_options = [want_chunk] if want_chunk is not None else list(CHUNKS)
    for ckpt in ckpt_options:
        for chunk in chunk_options:
            extra = 0 if ckpt else activation_bytes(tokens, layers, hidden, dtype_bytes)
            peak = base + extra + logits_bytes(chunk, vocab)
            if peak <= budget:
                return MemorySettings(chunk, ckpt, f"predicted peak {peak / 2**30:.1f} GiB of {budget / 2**30:.1f} "
                                      f"GiB usable (measured {measured_peak_bytes / 2**30:.1f} GiB with checkpointing, "
                                      f"{measured_chunk}-token chunks)")
    ckpt = True if want_checkpointing is None else want_checkpointing
    chunk = min(chunk_options)
    return MemorySettings(chunk, ckpt, f"nothing faster fits: measured {measured_peak_bytes / 2**30:.1f} GiB of "
                          f"{budget / 2**30:.1f} GiB usable; the leanest setting kept")


def resolve_compile(wanted: bool | str, device_type: str) -> bool:
    """auto -> on for CUDA, off on CPU (there inductor builds C++ kernels at every trainer start; `true`
    asks for it anyway)."""
    if wanted == "auto":
        return device_type == "cuda"
    return bool(wanted)
