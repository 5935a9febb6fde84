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

BACKENDS = ("auto", "bubblewrap", "docker")

__all__ = ["BACKENDS", "REASONS", "Limits", "Program", "Reason", "Result", "Sandbox", "SandboxPool",
           "SandboxUnavailable", "build_image", "make_sandbox"]


def make_sandbox(backend: str = "auto", image: str = "python", limits: Limits | None = None) -> Sandbox:
    """A sandbox for image `image` (`sandboxes/<image>/spec.yaml`, whose limits are the defaults unless
    `limits` is given). `auto`: Docker if an engine answers a ping within 2 s, else bubblewrap.
    Raises SandboxUnavailable with a one-line fix when the backend or image is missing."""
    from factory.sandbox.images import built_rootfs, load_spec

    if backend not in BACKENDS:
        raise SandboxUnavailable(f"sandbox backend {backend!r} unknown: choose one of {', '.join(BACKENDS)}")
    spec = load_spec(image)
    limits = limits or spec.limits
    if backend in ("auto", "docker"):
        from factory.sandbox.docker import DockerSandbox, docker_client

        try:
            client = docker_client(ping_timeout=2.0)
        except SandboxUnavailable:
            if backend == "docker":
                raise
        else:
            return DockerSandbox(image, default_limits=limits, client=client)
    from factory.sandbox.bubblewrap import BubblewrapSandbox

    return BubblewrapSandbox(rootfs=built_rootfs(image), default_limits=limits)

