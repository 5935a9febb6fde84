"""Code sandboxes: run untrusted programs with time, CPU, memory, process, output and network limits.

    sandbox = make_sandbox("auto")                      # Docker if an engine answers, else bubblewrap
    result = sandbox.run_sync(Program.python("print(1 + 1)"), Limits(wall_s=2))
    async with SandboxPool(sandbox, size=8) as pool:    # bounded concurrency, warm containers
        results = await pool.run_many(programs)

Backends: `BubblewrapSandbox` (daemon-less default), `DockerSandbox` (warm containers). Images:
`sandboxes/<name>/spec.yaml`, built by `build_image(name)` / `factory sandbox build`.
"""

from __future__ import annotations

from factory.sandbox.base import (
    REASONS, Limits, Program, Reason, Result, Sandbox, SandboxUnavailable,
)
from factory.sandbox.images import build_image
from factory.sandbox.pool import SandboxPool
from factory.core.registry import Registry



def _docker(image: str, limits: Limits) -> Sandbox:
    """Warm containers of image `image` (raises SandboxUnavailable when no Docker engine answers in 2 s)."""
    from factory.sandbox.docker import DockerSandbox, docker_client

    return DockerSandbox(image, default_limits=limits, client=docker_client(ping_timeout=2.0))


def _bubblewrap(image: str, limits: Limits) -> Sandbox:
    """bwrap over the image's built rootfs (no daemon)."""
    from factory.sandbox.bubblewrap import BubblewrapSandbox
    from factory.sandbox.images import built_rootfs

    return BubblewrapSandbox(rootfs=built_rootfs(image), default_limits=limits)


# A backend: (image, limits) -> Sandbox, raising SandboxUnavailable when it cannot run here. `auto` tries
# them in AUTO_ORDER. A new backend is one function registered here (and a module beside docker.py).
SANDBOX_BACKENDS: Registry = Registry("sandbox backend")
SANDBOX_BACKENDS.register("docker", _docker)
SANDBOX_BACKENDS.register("bubblewrap", _bubblewrap)
AUTO_ORDER = ("docker", "bubblewrap")
BACKENDS = ("auto", *SANDBOX_BACKENDS.names())

__all__ = ["BACKENDS", "REASONS", "SANDBOX_BACKENDS", "Limits", "Program", "Reason", "Result", "Sandbox",
           "SandboxPool", "SandboxUnavailable", "build_image", "make_sandbox"]


def make_sandbox(backend: str = "auto", image: str = "python", limits: Limits | None = None) -> Sandbox:
    """A sandbox for image `image` (`sandboxes/<image>/spec.yaml`, whose limits are the defaults unless
    `limits` is given). `auto`: the first of AUTO_ORDER that runs here (Docker if an engine answers a
    ping within 2 s, else bubblewrap). Raises SandboxUnavailable with a one-line fix when the backend or
    image is missing."""
    from factory.sandbox.images import load_spec

    if backend not in BACKENDS:
        raise SandboxUnavailable(f"sandbox backend {backend!r} unknown: choose one of {', '.join(BACKENDS)}")
    spec = load_spec(image)  # an unknown image says so first, whatever the backend
    limits = limits or spec.limits
    if backend != "auto":
        return SANDBOX_BACKENDS[backend](image, limits)
    for name in AUTO_ORDER[:-1]:
        try:
            return SANDBOX_BACKENDS[name](image, limits)
        except SandboxUnavailable:
            continue
    return SANDBOX_BACKENDS[AUTO_ORDER[-1]](image, limits)
