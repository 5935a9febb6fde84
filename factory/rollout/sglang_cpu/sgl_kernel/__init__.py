"""A stand-in `sgl_kernel` for serving SGLang on CPU in TESTS ONLY. It computes nothing.

Why it exists: SGLang's supported CPU path needs its CPU kernels (`sgl_kernel` built from a git
checkout of SGLang); they are on no package registry, and the PyPI kernel wheels are CUDA-only,
so a plain install dies at import (`from sgl_kernel import copy_all_layer_kv_cache_cpu`). With
`--attention-backend torch_native` and no AMX, SGLang 0.5.23's CPU path computes a dense model
with plain torch and only *imports* the kernel names below at module level; each stand-in raises
NotImplementedError naming itself if it is ever called (none is, serving a dense Llama).
Anything else (`sgl_kernel.<submodule>`, other names) stays an ImportError, so SGLang's own
fallbacks for a missing kernel package still apply.

`factory.rollout.sglang.SGLangServer` puts this directory on PYTHONPATH only when it launches a
server on CPU — the test set-up (a tiny model against a real SGLang server). It is never used on
GPU, where the real `sgl_kernel` (PyPI `sglang-kernel`) comes with SGLang.
"""

STAND_IN = True  # tells this package from the real one (tests and server logs)

# imported at module level by SGLang 0.5.23 when SGLANG_USE_CPU_ENGINE=1 (found by serving with a
# package that recorded every name asked of it)
NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


def _stand_in(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: SGLang called a CPU kernel, but this is the CPU test stand-in "
            "(factory/rollout/sglang_cpu/sgl_kernel), which has none"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


globals().update({name: _stand_in(name) for name in NAMES})
__all__ = list(NAMES)
