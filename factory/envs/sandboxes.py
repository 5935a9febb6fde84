"""The sandbox an environment runs code in (tool calls, unit tests), made on first use from the
recipe's `environment.sandbox` section."""

from __future__ import annotations

import asyncio
import weakref

from factory.recipe import SandboxSection
from factory.sandbox import Limits, Program, Result, Sandbox, SandboxPool, make_sandbox


class EnvSandbox:
    """A lazily made sandbox with one bounded pool per event loop (a pool's semaphore belongs to the
    loop that first waits on it; tests run episodes under several loops). Without a section it uses
    the recipe's defaults (`SandboxSection()`)."""

    def __init__(self, section: SandboxSection | None = None):
        section = section or SandboxSection()
        self.backend, self.image, self.concurrency = section.backend, section.image, section.concurrency
        self.limits = Limits(wall_s=section.wall_s, memory_mb=section.memory_mb, pids=16, output_bytes=64 * 1024)
        self._sandbox: Sandbox | None = None
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
