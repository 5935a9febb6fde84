"""How a vLLM server is launched: CPU-only flags only on CPU, the bind address as asked, and a plain
error when the model is not on this node."""

from __future__ import annotations

import sys

import pytest

from factory.rollout.vllm import AttachedServer, EngineStartError, VLLMServer


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_cpu_launch_carries_the_cpu_backend_settings_and_a_gpu_launch_drops_them(model_dir):
    cpu = VLLMServer(str(model_dir), device="cpu", port=1234)
    assert "--enforce-eager" in cpu.args and cpu.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert cpu.env["FACTORY_VLLM_INSPECT_IN_PROCESS"] == "1"
    assert cpu.env["TORCHDYNAMO_DISABLE"] == "1"  # vLLM's torch.compile'd sampler helpers run eagerly
    assert cpu.args[cpu.args.index("--host") + 1] == "127.0.0.1" and cpu.url == "http://127.0.0.1:1234"
    gpu = VLLMServer(str(model_dir), device="cuda", port=1234, host="10.0.0.5")
    assert "--enforce-eager" not in gpu.args
    assert "FACTORY_VLLM_INSPECT_IN_PROCESS" not in gpu.env  # with CUDA, vLLM's own subprocess inspection
    assert gpu.env.get("TORCHDYNAMO_DISABLE") == __import__("os").environ.get("TORCHDYNAMO_DISABLE")  # compiled
    assert not {k for k in gpu.env if k.startswith("VLLM_CPU_")} - {k for k in __import__("os").environ}
    assert gpu.args[gpu.args.index("--host") + 1] == "10.0.0.5" and gpu.url == "http://10.0.0.5:1234"
    # both keep what weight sync and partial rollouts need
    for server in (cpu, gpu):
        assert "factory.model.weightsync.WeightReceiverExtension" in server.args and "--enable-scale-out" in server.args


def test_a_model_missing_on_this_node_is_named_before_anything_starts(tmp_path):
    with pytest.raises(EngineStartError, match=f"vLLM: no model at {tmp_path / 'gone'} on this node"):
        VLLMServer(str(tmp_path / "gone"))


def test_attaching_where_nothing_answers_says_how_to_start_an_engine():
    with pytest.raises(EngineStartError, match=r"no vLLM server answers at http://127.0.0.1:9 .*factory serve"):
        AttachedServer("http://127.0.0.1:9/").check(timeout_s=2)


def test_a_cpu_server_inspects_model_classes_in_its_own_process_and_forks_its_engine_core(model_dir):
    """vllm_site/ makes the model registry's inspection run in the calling process for a CPU launch
    (vLLM runs it in a fresh Python process, which re-imports vLLM and torch: ~12 s of a first start),
    and starts the engine core by fork although vLLM-CPU asks for spawn (~8 s of every start). The
    environment is the one a CPU launch gets; unpatched, the pid printed would be another's and the
    start method "spawn". A CPU launch with several workers keeps vLLM's spawn."""
    import subprocess

    env = VLLMServer(str(model_dir), device="cpu", port=1234).env
    assert env["FACTORY_VLLM_FORK_ENGINE_CORE"] == "1"
    assert "FACTORY_VLLM_FORK_ENGINE_CORE" not in VLLMServer(str(model_dir), device="cpu", port=1234,
                                                            extra_args=["--tensor-parallel-size", "2"]).env
    code = ("import os; from vllm.model_executor.models import registry; "
            "print(registry._run_in_subprocess(lambda: os.getpid()) == os.getpid()); "
            "from vllm.v1.engine import utils; print(utils.get_mp_context().get_start_method()); "
            "import torch; from torch._dynamo.utils import counters; "
            "from vllm.v1.sample.ops.logprobs import batched_count_greater_than as count; "
            "x = torch.tensor([[0.5, 2.0, 1.0]]); print(count(x, x[:, :1]).tolist(), dict(counters['frames']))")
    out = subprocess.run([sys.executable, "-c", code], env={**env, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # and vLLM's torch.compile'd sampler helpers run eagerly: the right count, no frame traced (compiling
    # it was ~2 s of every CPU server's first sampled request)
    assert out.stdout.strip().splitlines()[-3:] == ["True", "fork", "[3] {}"]
