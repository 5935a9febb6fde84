"""The sandbox an environment runs code in (tool calls, unit tests), made on first use from the
recipe's `environment.sandbox` section."""

from __future__ import annotations

import asyncio
import weakref

from factory.sandbox import Limits, Program, Result, SandboxPool, make_sandbox


class EnvSandbox:
    """A lazily made sandbox with one bounded pool per event loop (a pool's semaphore belongs to the
    loop that first waits on it; tests run episodes under several loops). Without a section it uses
    the defaults: `auto` backend, the `python` image, 8 programs at once."""

    def __init__(self, section=None):
        self.backend = getattr(section, "backend", "auto")
        self.image = getattr(section, "image", "python")
        self.concurrency = getattr(section, "concurrency", 8)
        self.limits = Limits(wall_s=getattr(section, "wall_s", 10.0), memory_mb=getattr(section, "memory_mb", 256),
                             pids=16, output_bytes=64 * 1024)
        self._sandbox = None
        self._pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def pool(self) -> SandboxPool:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            # no await until the pool is stored: concurrent first episodes share one sandbox and pool
            if self._sandbox is None:
                self._sandbox = make_sandbox(self.backend, self.image, self.limits)
            pool = self._pools[loop] = SandboxPool(self._sandbox, self.concurrency, self.limits)
            await pool.start()
        return pool

    async def run(self, program: Program, limits: Limits | None = None) -> Result:
        return await (await self.pool()).run(program, limits)

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
            self._pools.clear()
