"""`SandboxPool`: bounds how many programs run at once on one sandbox, keeps its warm workers, and
reports `sandbox/…` metrics."""

from __future__ import annotations

import asyncio
from collections import Counter, deque

from factory.sandbox.base import REASONS, Limits, Program, Result, Sandbox, run_blocking


class SandboxPool:
    """At most `size` concurrent runs on `sandbox` (an asyncio.Semaphore; use one pool from one event
    loop — `run_sync` always uses the shared background loop). `start()` warms `size` workers where the
    backend has any (Docker containers); `close()` closes the sandbox."""

    def __init__(self, sandbox: Sandbox, size: int = 4, limits: Limits | None = None, window: int = 1000) -> None:
        if size < 1:
            raise ValueError(f"SandboxPool size must be >= 1, got {size}")
        self.sandbox = sandbox
        self.size = size
        self.limits = limits or sandbox.default_limits
        self._semaphore = asyncio.Semaphore(size)
        self._reasons: Counter[str] = Counter()
        self._walls: deque[float] = deque(maxlen=window)
        self._inflight = 0
        self._started = False

    async def start(self) -> SandboxPool:
        if not self._started:
            self._started = True
            await self.sandbox.warm(self.size, self.limits)
        return self

    async def run(self, program: Program, limits: Limits | None = None) -> Result:
        """Run one program once a slot is free."""
        async with self._semaphore:
            self._inflight += 1
            try:
                result = await self.sandbox.run(program, limits or self.limits)
            finally:
                self._inflight -= 1
        self._reasons[result.reason] += 1
        self._walls.append(result.wall_s)
        return result

    async def run_many(self, programs: list[Program], limits: Limits | None = None) -> list[Result]:
        """Run programs concurrently (at most `size` at a time); results in input order."""
        return list(await asyncio.gather(*(self.run(p, limits) for p in programs)))

    def run_sync(self, program: Program, limits: Limits | None = None) -> Result:
        return run_blocking(self.run(program, limits))

    def metrics(self) -> dict[str, float]:
        """Counts by reason since creation; wall-time percentiles over the last `window` runs."""
        walls = sorted(self._walls)
        pick = lambda q: walls[min(len(walls) - 1, int(q * len(walls)))] if walls else 0.0  # noqa: E731
        out = {"sandbox/runs": float(sum(self._reasons.values())), "sandbox/inflight": float(self._inflight),
               "sandbox/wall_p50_s": pick(0.5), "sandbox/wall_p99_s": pick(0.99)}
        out.update({f"sandbox/reason/{r}": float(self._reasons[r]) for r in REASONS})
        return out

    async def aclose(self) -> None:
        await self.sandbox.aclose()

    def close(self) -> None:
        self.sandbox.close()

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __enter__(self) -> SandboxPool:
        run_blocking(self.start())
        return self

    def __exit__(self, *exc) -> None:
        self.close()
