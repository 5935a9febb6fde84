"""Prompts longer than the engines' context on the real stack: with `data.overlong: drop` a run leaves
them out (the engine, which would refuse them, never sees one), finishes, and records each in the lake."""

from __future__ import annotations

import json

from factory.run import run
from tests.data.test_lengths import long_source

from .conftest import small_recipe


def test_a_run_drops_prompts_longer_than_the_context_and_records_them(engine, policy, tmp_path):
    from factory.lake.query import sql

    spec = long_source(tmp_path)  # 40 sums, 10 of them behind ~300 tokens of letters: over 256 - 8
    recipe = small_recipe(f"model.path={policy}", "data.families=[]", f"data.sources={json.dumps([spec])}",
                          "data.overlong=drop", "train.steps=2", "eval.before=false", "eval.heldout=8")
    results = run(recipe, tmp_path / "run", engines=[engine])

    rows = sql("SELECT task_id, status, step, error FROM samples WHERE run_id = 'run'").to_pylist()
    dropped = {r["task_id"] for r in rows if r["status"] == "dropped"}
    assert len(dropped) == 10 and {r["step"] for r in rows if r["status"] == "dropped"} == {0}
    assert all(r["error"].endswith("longer than rollout.max_model_len - rollout.max_new_tokens = 248")
               for r in rows if r["status"] == "dropped")
    played = {r["task_id"] for r in rows if r["status"] != "dropped"}
    assert played and not played & dropped  # trained and evaluated tasks are all short ones
    assert results["samples_trained"] > 0 and 0 < results["after"]["n"] < 8
