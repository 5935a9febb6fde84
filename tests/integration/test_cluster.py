"""Every socket a run opens stays on loopback (tests and runs may only use 127.0.0.0/8), and nothing
listens on a wildcard address: Ray, the trainer's weight-sync rendezvous, the engines, the gateway,
and the Dagster and MLflow UIs as the README and docs/getting-started.md start them."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time

import httpx
import psutil
import ray

from factory.rollout.server import owned_servers
from factory.run import run

from .conftest import small_recipe


def listening(root_pid: int) -> set[tuple[str, int, str]]:
    """(address, port, process) of every listening TCP socket of `root_pid` and its descendants."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return set()
    out = set()
    for proc in procs:
        try:
            # the executable's own name first: a cmdline cut at 80 characters can lose it under a
            # long install path (CI's raylet showed as ".../ray/rayle")
            name = f"{proc.name()} {' '.join(proc.cmdline())[:80]}"
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    out.add((conn.laddr.ip, conn.laddr.port, name))
        except psutil.Error:
            continue
    return out


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)  # gRPC listens on ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def beyond_loopback(sockets) -> list:
    return sorted(s for s in sockets if not is_loopback(s[0]))


def test_local_ray_binds_to_loopback_only(ray_cluster):

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    ray_sockets = {s for s in listening(os.getpid()) if "ray" in s[2] and "vllm" not in s[2]}
    assert ray_sockets, "no Ray process is listening: the check would pass vacuously"
    assert not beyond_loopback(ray_sockets)


def test_every_socket_of_a_run_is_on_loopback(engine, tmp_path):
    seen: set = set()
    recipe = small_recipe("train.steps=2", "eval.before=false", "eval.after=false", "lake.enabled=false",
                          "tracking.enabled=false")
    # the engine's vLLM server: forked by the zygote, which may be another process's child than ours
    roots = [os.getpid(), *owned_servers(ray.get(engine.pid.remote()))]
    results = run(recipe, tmp_path, engines=[engine],
                  on_step=lambda _: seen.update(*(listening(root) for root in roots)))
    assert results["samples_trained"] > 0
    names = " ".join(s[2] for s in seen)
    # the roles whose sockets the check must have seen, or it would pass vacuously
    for role in ("TrainerActor", "EnvWorkerActor", "vllm.entrypoints", "raylet"):
        assert role in names, f"no listening socket of {role} was seen"
    assert not beyond_loopback(seen), f"sockets beyond loopback: {beyond_loopback(seen)}"


def test_mlflow_ui_as_the_readme_starts_it_listens_on_loopback(tmp_path):
    port = 45000 + os.getpid() % 5000
    ui = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri",
                           f"sqlite:///{tmp_path}/mlflow.db", "--port", str(port)],
                          env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                               "MLFLOW_DISABLE_TELEMETRY": "true"},
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert ui.poll() is None and time.monotonic() < deadline, "mlflow ui did not come up"
            time.sleep(0.5)
        sockets = listening(ui.pid)
        assert any(s[1] == port for s in sockets)
        assert not beyond_loopback(sockets)
    finally:
        os.killpg(ui.pid, 15)
        ui.wait(timeout=30)
