"""The recipe's `environment` and `rollout` sections: where episodes run and how engines generate."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from factory.core import registries
from factory.recipe.base import Section, registered
from factory.support.threads import Threads


class LatencySection(Section):
    """Synthetic environment latency: most episodes fast, a fraction much slower (benchmarks)."""

    fast_s: float = Field(0.0, ge=0, description="seconds a fast episode waits (simulated think or tool time)")
    slow_s: float = Field(0.0, ge=0, description="seconds a slow episode waits")
    slow_fraction: float = Field(0.0, ge=0, le=1, description="share of episodes (per_task: of tasks) that are "
                                 "slow; 0: none")
    per_task: bool = Field(False, description="slowness is a property of the task (a hash of its id), not a "
                           "coin flip per episode — as when some prompts need long tool use")


class SandboxSection(Section):
    """Where environments run untrusted code (tool calls, unit tests of code tasks): factory/sandbox."""

    backend: Literal["auto", "bubblewrap", "docker"] = Field(
        "auto", description="auto: Docker if an engine answers, else bubblewrap")
    image: str = Field("python", description="a sandboxes/<name>/spec.yaml image")
    concurrency: int = Field(8, gt=0, description="programs running at once per env worker")
    wall_s: float = Field(10.0, gt=0, description="wall-time limit per program")
    memory_mb: int = Field(256, gt=0, description="memory limit per program in MiB: its processes and its /tmp, "
                           "no swap")


class EnvironmentSection(Section):
    name: str = Field("single_turn", description="a registered environment (factory/envs/), or package.module:attr "
                      "of your own", examples=["single_turn", "tool_agent", "my_package.envs:MyEnvironment"])
    system_prompt: str | None = Field(None, description="the system message before each task (also the warm "
                                      "start's); unset: none, or the environment's own (tool_agent)")
    workers: int = Field(1, gt=0, description="env worker actors, each hosting a gateway")
    latency: LatencySection = Field(default_factory=LatencySection, description="synthetic latency of "
                                    "single_turn episodes (benchmarks); all 0: none")
    max_turns: int = Field(3, gt=0, description="tool_agent: model calls per episode; a tool call on the "
                           "last one ends the episode unanswered")
    sandbox: SandboxSection = Field(default_factory=SandboxSection, description="where tool calls and code "
                                    "tasks' unit tests run")
    direct: bool = Field(True, description="play environments whose episode is one tool-less call (those with "
                         "score_reply, e.g. single_turn) in-process: no OpenAI client or HTTP hop, the prompt "
                         "rendered once per task, the same tokens recorded; false: every call goes through "
                         "the gateway's OpenAI endpoint")


class HealthSection(Section):
    """How a run watches the engines it started (attached ones, `rollout.urls`, are waited for, never
    restarted): a probe every `interval_s`; a server whose process exited is dead at once, one that
    misses `misses` probes in a row (hung, e.g. stopped) is killed; either is restarted."""

    interval_s: float = Field(10, gt=0, description="seconds between probes of each engine")
    timeout_s: float = Field(5, gt=0, description="a probe unanswered after this is a miss")
    misses: int = Field(2, ge=1, description="missed probes in a row that declare an engine hung")
    first_wait_s: float = Field(30, ge=0, description="no probe this long after an engine (re)starts")


class RolloutSection(Section):
    engine: str = Field("vllm", description="a registered rollout engine (factory/rollout/engines.py)",
                        **registered(registries.ENGINES))
    num_engines: int = Field(1, gt=0, description="engines to start (with `urls`: one per URL)")
    urls: list[str] = Field(
        default_factory=list, description="attach to these running engines (e.g. `factory serve`) instead of "
        "starting any; the run syncs its weights into them and leaves them running")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where started engines serve: auto = cuda when the engine's node has a GPU")
    sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="weight_sync=broadcast: the collective; auto = nccl when the trainer is on cuda, "
        "else gloo (nccl is untested here: no GPU)")
    group_size: int = Field(8, gt=1, description="G completions per prompt")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of training rollouts (the trainer's "
                               "logprobs divide the logits by it too)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens holding this "
                         "much probability; 1 disables it")
    top_k: int = Field(-1, description="-1 disables top-k")
    max_new_tokens: int = Field(8, gt=0, description="most tokens generated per model call")
    min_new_tokens: int = Field(0, ge=0, description="end-of-turn is suppressed before this many tokens "
                                "(benchmarks and tests use it to force long generations)")
    max_model_len: int = Field(256, gt=16, description="prompt + completion tokens an engine accepts")
    dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="the dtype engines serve the weights "
                                                 "in (and weight syncs send them in)")
    weight_sync: Literal["broadcast", "disk", "lora"] = Field(
        "broadcast", description="broadcast: gloo buckets into the vLLM worker; disk: reload a saved "
        "checkpoint; lora: load the trained adapter in place (needs train.lora.enabled)")
    bucket_mb: int = Field(16, gt=0, description="weight_sync=broadcast: MiB of weights per bucket sent")
    kv_cache_gb: int = Field(2, gt=0, description="GiB of KV cache per engine: vLLM on cpu and SGLang; vLLM on "
                             "cuda sizes its own")
    cpus: Threads = Field("auto", description="CPU threads for each engine; auto: this node's share by the "
                          "measured rule in factory/support/threads.py")
    coalesce_ms: float = Field(5.0, ge=0, description="vLLM: prompts arriving this close share one HTTP request")
    keep_sampling_mask: bool = Field(
        False, description="record the sampler's candidate set per token (top-k/top-p survivors) and "
        "renormalise the trainer's policy over it, so both policies share a support")
    support_cap: int = Field(64, gt=0, description="with top-p only: candidates asked for per token; a set "
                             "that fills it is treated as unknown")
    overlap_sync: bool = Field(
        True, description="the weight update after a step runs while the driver records it and the trainer takes "
        "the next (new requests wait for the new weights either way); false: the loop waits for the engines to reopen")
    partial_rollout: Literal["wait", "abort_resume", "inflight"] = Field(
        "wait", description="at a weight update: wait = drain in-flight requests first; abort_resume = abort "
        "them and continue prompt + tokens so far under the new weights; inflight = pause with the KV cache "
        "kept, swap weights, resume (vllm only for the last two)")
    startup_timeout_s: float = Field(300, gt=0, description="seconds a started engine may take to become "
                                     "ready; longer fails that start (it is tried again once)")
    health: HealthSection = Field(default_factory=HealthSection, description="how started engines are probed, "
                                  "and when one is restarted")
    max_engine_restarts: int = Field(
        3, ge=0, description="engines restarted within one run (dead or hung; each is given the current "
        "weights, its in-flight groups re-queued); one more failure stops the run")
    seed: int | None = Field(
        0, description="each request's sampling seed derives from it, the episode's session id and turn, so "
        "generation repeats: two runs at η = 0, or a run and its resume, sample the same tokens. null: the engine "
        "draws. vLLM sends seeded prompts through the batch route Factory's servers add (an attached server "
        "without it, e.g. a plain `vllm serve`, takes one call per seed; so does partial_rollout=abort_resume); "
        "SGLang honours seeds only with deterministic inference, and otherwise samples unseeded")

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"expected http(s)://HOST:PORT addresses of running engines, got {bad}")
        return [u.rstrip("/") for u in urls]
