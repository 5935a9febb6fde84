"""Row builders shared by the lake tests (and by the worker processes they spawn)."""

from __future__ import annotations

from datetime import datetime, UTC


def sample_row(run_id: str, sample_id: str, step: int = 1, version: int = 3, **overrides) -> dict:
    """A samples row: 2 prompt tokens, 4 completion tokens of which 3 sampled (mask 1, 0, 1, 1)."""
    row = {
        "run_id": run_id, "sample_id": sample_id, "group_id": f"g-{sample_id}", "task_id": "t-1",
        "prompt_ids": [5, 6], "completion_ids": [7, 8, 9, 10], "logprobs": [-0.5, 0.0, -0.25, -1.5],
        "versions": [version - 1, -1, version, version], "loss_mask": [1, 0, 1, 1], "reward": 1.0,
        "turns": 2, "env": "arith", "finish_reason": "stop", "timings": {"generate_s": 0.25},
        "info": None, "trained_step": step, "trained_version": version, "staleness": 1,
        "written_at": datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC), "status": "trained", "step": step,
    }
    row.update(overrides)
    return row


def step_row(run_id: str, step: int) -> dict:
    return {"run_id": run_id, "step": step, "metrics": {"train/loss": 1.0 / step, "rollout/reward_mean": 0.1 * step}}
