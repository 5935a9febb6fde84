"""vLLM's OpenAI-compatible server process, started and stopped by us (`VLLMServer`, its arguments and
environment, the zygote CPU servers are forked from), or one someone else runs (`AttachedServer`).
The client that sends it prompts and weights is `factory.rollout.vllm.VLLMEngine`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from factory.paths import REPO_ROOT, cache_dir
from factory.rollout.server import EngineStartError, ServerProcess, free_port
from factory.rollout.zygote import ForkedProcess
from factory.rollout.zygote import enabled as zygote_enabled

WARM_UP_TOKENS = 32  # a CPU server's first prompt, sent by `VLLMServer.wait_ready` (see there)


def server_env(device: str, *, uni: bool, kv_cache_gb: int = 2, threads: int = 1) -> dict[str, str]:
    """The environment of a vLLM server we start: this process's, with the settings below."""
    env = dict(os.environ)
    if device == "cpu":
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the cores with the trainer, don't pin
            # the model-class inspection in the server's process, not a fresh one (vllm_site/)
            "FACTORY_VLLM_INSPECT_IN_PROCESS": "1",
            # no torch.compile of vLLM's sampler helpers: on CPU their first call would compile them
            # (a one-off on the first sampled request) and eager sampling is no slower (bench/first_steps.py)
            "TORCHDYNAMO_DISABLE": "1",
        })
        if uni:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # only lets the CPU backend keep "uni" (above)
            env["FACTORY_VLLM_FORK_ENGINE_CORE"] = "1"  # fork the engine core, ~8 s less (vllm_site/)
    env.update({
        "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc and /reset_prefix_cache
        # idle connections outlive the client's keep-alive (30 s): with both at 5 s, the server
        # closed a connection as the client reused it (httpx.ReadError mid-evaluation, seen in CI)
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "3600",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        # vllm_site/sitecustomize.py stops vLLM's queue readers from spinning (see its docstring)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent / "vllm_site"), str(REPO_ROOT),
                                                    os.environ.get("PYTHONPATH")])),
    })
    return env


SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def prestart_zygote(*, detach: bool = False):
    """Start the zygote CPU servers with the default arguments are forked from (factory/rollout/zygote.py),
    so that the first such server is ready in seconds; None when the zygote is off. Not detached (the
    default), it is the caller's child: the test session starts it so, beside its first tests."""
    from factory.rollout.zygote import start_zygote

    env = server_env("cpu", uni=True)
    if not zygote_enabled(env):
        return None
    return start_zygote(SERVER_MODULE, env, cache_dir() / "vllm-zygote.log", detach=detach)


def stop_zygote() -> bool:
    """Tell the zygote `prestart_zygote` started to exit (servers it forked keep running)."""
    from factory.rollout.zygote import stop_zygote as stop

    return stop(SERVER_MODULE, server_env("cpu", uni=True))


class VLLMServer(ServerProcess):
    """One `vllm.entrypoints.openai.api_server` process bound to `host` (loopback unless told otherwise),
    in its own process group.

    `device="cpu"` (vllm-cpu, tested here) adds eager mode and the CPU backend's settings; `"cuda"`
    leaves them out (CUDA vLLM from the `gpu` extra; no machine of this project has a GPU, so that
    launch is untested here)."""

    name = "vLLM"
    dead_status = 503  # its /health once the engine core died (the API server stays up)

    def __init__(self, model: str, *, dtype: str = "bfloat16", max_model_len: int = 256,
                 kv_cache_gb: int = 2, threads: int = 1, log_path: Path | None = None,
                 port: int | None = None, extra_args: Sequence[str] = (), host: str = "127.0.0.1",
                 device: str = "cpu"):
        if not (Path(model) / "config.json").is_file():
            raise EngineStartError(f"vLLM: no model at {model} on this node (no config.json); a model must be "
                                   "shipped to the engine's node or live on a filesystem every node mounts")
        self.model = model
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path or (cache_dir() / f"vllm-{self.port}.log")
        # CPU-only settings: eager mode (no CUDA graphs to capture) and the CPU backend's own knobs. One
        # worker runs inside the engine-core process ("uni"), saving a process's imports and handshake. vLLM-CPU
        # forces its multiprocess executor unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (set below), so that
        # it can pin OpenMP threads; we never pin (nobind) and set OMP_NUM_THREADS ourselves.
        uni = device == "cpu" and not any(a.startswith(("--distributed-executor-backend", "--tensor-parallel-size",
                                                         "-tp", "--pipeline-parallel-size", "-pp"))
                                          for a in extra_args)
        cpu_args = ["--enforce-eager"] if device == "cpu" else []
        cpu_args += ["--distributed-executor-backend", "uni"] if uni else []
        self.args = [
            sys.executable, "-m", SERVER_MODULE,
            "--model", model, "--host", host, "--port", str(self.port),
            "--dtype", dtype, *cpu_args, "--max-model-len", str(max_model_len),
            "--worker-extension-cls", "factory.model.weightsync.WeightReceiverExtension",
            # no access-log line per request: tens a step, for days, in the server's log
            "--disable-log-stats", "--disable-uvicorn-access-log", "--logprobs-mode", "processed_logprobs",
            "--enable-scale-out",  # /inference/v1/generate with per-token weight versions (inflight mode)
            *extra_args,
        ]
        self.env = server_env(device, uni=uni, kv_cache_gb=kv_cache_gb, threads=threads)
        self.proc: subprocess.Popen | ForkedProcess | None = None
        self.device = device
        self.zygote = device == "cpu" and zygote_enabled(self.env)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Ready, and on CPU warmed up: one prompt of WARM_UP_TOKENS tokens, sampled (temperature 1,
        logprobs) for a few tokens. Why:
        - on an AMX machine a CPU server whose first request was a prompt of a few tokens
          died in vLLM's CPU attention kernel (SIGILL in `cpu_attention_with_kv_cache`, the engine core
          gone, every request after it answered 500); after one longer prompt, short ones are served.
          Our runs never met it, but a server anyone attaches to (`factory serve`) may get any prompt;
        - the first sampled request cost vLLM-CPU ~1.7 s once (64 sampled 12-token prompts took 2.0 s
          first, 0.3 s after): torch.compile of vLLM's sampler helpers, now off on CPU (see
          `TORCHDYNAMO_DISABLE` above; this request then takes ~0.1 s). Anything else a first request
          pays is paid here, off a run's first batch (the pipeline fill, on every run's critical path)."""
        super().wait_ready(timeout_s)
        if self.device != "cpu":
            return
        resp = httpx.post(f"{self.url}/v1/completions", timeout=60, json={
            "model": self.model, "prompt": list(range(WARM_UP_TOKENS)), "max_tokens": 4, "temperature": 1.0,
            "logprobs": 0})
        if resp.status_code != 200:
            self.stop()
            raise EngineStartError(f"vLLM server at {self.url}: its warm-up request failed (HTTP {resp.status_code}); "
                                   f"see {self.log_path}:\n" + self.log_tail())


class AttachedServer:
    """A vLLM server someone else started and keeps running (`factory serve`, or a team's own fleet).

    The run attaches to it, syncs weights into it and leaves it running. Weight broadcast needs the
    server to have been started with our worker extension and `VLLM_SERVER_DEV_MODE=1`, which
    `factory serve` does; `inflight` needs our batch route (the vllm_site hook), which it also adds."""

    dead_status = 503  # as VLLMServer's

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.proc = None

    def check(self, timeout_s: float = 10.0) -> str:
        """The name the server serves its model under; a one-line error if nothing answers there."""
        try:
            models = httpx.get(f"{self.url}/v1/models", timeout=timeout_s)
            models.raise_for_status()
            return models.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
            raise EngineStartError(f"rollout.urls: no vLLM server answers at {self.url} ({type(err).__name__}: "
                                   f"{err}); start one with `factory serve MODEL_DIR --port PORT`") from None

    def has_batch_route(self, timeout_s: float = 10.0) -> bool:
        """Whether the server serves our batch route with its token endpoint on (`factory serve` starts
        it so; a plain `vllm serve` answers 404): an empty batch costs the server nothing."""
        try:
            return httpx.post(f"{self.url}/factory/v1/generate_batch", json={"requests": []},
                              timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:  # not ours to stop
        pass
