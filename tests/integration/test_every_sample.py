"""Every sample a run generates reaches the lake with its fate: trained (each once, as the trainer saw
it), filtered, rejected, unused, failed, and the evaluation episodes; with the decoded text."""

from __future__ import annotations

import json

from factory.lake.checks import run_checks
from factory.lake.query import sql
from factory.run import run

from .conftest import FILTER_ON, small_recipe


def test_the_lake_holds_every_generated_sample_with_its_status(engine, policy, tmp_path):
    from transformers import AutoTokenizer

    recipe = small_recipe("train.steps=3", "eval.heldout=32", "async.max_staleness=1", FILTER_ON)
    results = run(recipe, tmp_path, engines=[engine])
    run_id = tmp_path.name
    rows = sql(f"SELECT * FROM samples WHERE run_id = '{run_id}'").to_pylist()
    by_status: dict[str, list[dict]] = {}
    for r in rows:
        by_status.setdefault(r["status"], []).append(r)

    # trained: exactly the samples the trainer consumed (samples.jsonl), each once, at its step
    trained = {json.loads(line)["sample_id"]: json.loads(line) for line in
               (tmp_path / "samples.jsonl").read_text().splitlines()}
    lake_trained = by_status["trained"]
    assert sorted(r["sample_id"] for r in lake_trained) == sorted(trained) and len(trained) == results["samples_trained"]
    assert all(r["step"] == r["trained_step"] == trained[r["sample_id"]]["trained_step"] for r in lake_trained)
    # in the order the trainer saw them: batch_position orders each step's batch as samples.jsonl does
    in_lake_order = [r["sample_id"] for r in sorted(lake_trained, key=lambda r: (r["trained_step"], r["batch_position"]))]
    assert in_lake_order == list(trained)

    # every generated sample has one fate: the buffer's own counts add up to the lake's rows
    counts = results["buffer"]
    G = recipe.rollout.group_size
    generated = sum(len(by_status.get(s, [])) for s in ("trained", "filtered", "rejected", "unused"))
    assert generated == counts["buffer/finished_samples"] > len(trained)  # more generated than trained
    assert len(by_status.get("filtered", [])) == G * counts["buffer/filtered"]
    assert len(by_status.get("failed", [])) == counts["buffer/failed"] == 0
    assert len({r["sample_id"] for r in rows}) == len(rows)
    for r in by_status.get("filtered", []) + by_status.get("rejected", []) + by_status.get("unused", []):
        assert r["trained_step"] is None and json.loads(r["info"])["reason"]
        assert 1 <= r["step"] <= recipe.train.steps

    # the evaluation episodes: before (step 0) and after, in the lake; their mean is the reported one
    episodes = by_status["evaluation"]
    for tag, step in (("before", 0), ("after", 3)):
        mine = [r for r in episodes if json.loads(r["info"])["tag"] == tag]
        assert len(mine) == 32 and {r["step"] for r in mine} == {step}
        assert abs(sum(r["reward"] for r in mine) / 32 - results[tag]["mean"]) < 1e-9

    # what the model read and wrote, decoded; no sampling mask or teacher in this recipe
    tokenizer = AutoTokenizer.from_pretrained(policy)
    for r in lake_trained[:8] + episodes[:8]:
        assert r["prompt_text"] == tokenizer.decode(r["prompt_ids"], skip_special_tokens=False)
        assert r["completion_text"] == tokenizer.decode(r["completion_ids"], skip_special_tokens=False)
        assert r["completion_text"] and r["support"] is None and r["teacher_logprobs"] is None

    assert all(c.passed for c in run_checks(run_id, recipe.async_.max_staleness).values())
    by_query = {r["status"]: r["samples"] for r in sql(
        f"SELECT status, count(*) AS samples FROM samples WHERE run_id = '{run_id}' GROUP BY 1").to_pylist()}
    assert by_query == {s: len(v) for s, v in by_status.items()}
