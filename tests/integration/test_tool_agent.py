"""The tool agent environment in the real run loop: env workers (Ray) run episodes with a sandbox,
vLLM samples, the trainer trains on the recorded episodes."""

from __future__ import annotations

import json

from factory.run import run

from .conftest import small_recipe


def test_tool_agent_trains_in_the_run_loop(engine, tmp_path):
    # the session policy was warm-started without tools, so most episodes answer directly; what is
    # checked here is the plumbing (the gateway's tool path is covered by tests/envs and tests/rollout)
    recipe = small_recipe("environment.name=tool_agent", "environment.sandbox.backend=bubblewrap",
                          "train.steps=2", "eval.before=false", "eval.after=false", "async.max_staleness=0")
    results = run(recipe, tmp_path, engines=[engine])
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert results["samples_trained"] == len(rows) > 0
    assert {r["env"] for r in rows} == {"tool_agent"}
    for r in rows:
        assert 1 <= r["turns"] <= recipe.environment.max_turns
        assert len(r["loss_mask"]) == len(r["completion_ids"]) and any(r["loss_mask"])
