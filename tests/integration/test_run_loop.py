"""The run loop end to end on the real stack (vLLM, Ray, gloo), synchronous and asynchronous."""

from __future__ import annotations

import json

import pytest
import torch

from factory.run import run
from factory.support.threads import DEFAULT_SHAPE, available_cores, thread_split

from .conftest import small_recipe


def trained_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("eta", [0, 2])
def test_no_trained_sample_is_older_than_eta(engine, tmp_path, eta):
    # η = 0 trains on one packed row (asked for: `auto` packs into one row only where attention is variable-length),
    # η = 2 at auto: on sdpa, rows as wide as the longest sample
    packing = "true" if eta == 0 else "auto"
    recipe = small_recipe(f"async.max_staleness={eta}", "train.steps=5", "eval.before=false", "train.threads=auto",
                          f"train.packing={packing}")
    results = run(recipe, tmp_path, engines=[engine])
    # the trainer's thread budget resolved on its node for this run's shape (η = 0: it trains alone)
    assert results["threads"]["trainer"] == thread_split(available_cores(), 1, eta)[0]
    assert results["threads"]["engines"] == [thread_split(available_cores(), **DEFAULT_SHAPE)[1]]  # built outside

    rows = trained_rows(tmp_path)
    assert results["samples_trained"] == len(rows) > 0
    steps = sorted({r["trained_step"] for r in rows})
    assert steps == [1, 2, 3, 4, 5]
    for r in rows:
        sampled = [v for v, m in zip(r["versions"], r["loss_mask"]) if m]
        assert sampled, r["sample_id"]
        # the trainer at step k holds version k-1; no sampled token may be more than η behind it
        assert r["trained_version"] - min(sampled) <= eta
        assert r["staleness"] == r["trained_version"] - min(sampled)
    assert len({r["sample_id"] for r in rows}) == len(rows)
    if eta == 0:
        assert {r["staleness"] for r in rows} == {0}
    assert 0.0 <= results["after"]["mean"] <= 1.0 and results["after"]["n"] == recipe.eval.heldout
    assert (tmp_path / "results.json").is_file()
    # where the run's time went: its phases in order (no evaluation before here), together its whole time
    spent = results["phase_seconds"]
    assert list(spent) == ["inputs", "start", "training", "stop", "evaluation_after", "shutdown"], spent
    assert min(spent.values()) >= 0 and spent["training"] > 0
    assert abs(sum(spent.values()) - results["total_seconds"]) < 0.1 * results["total_seconds"] + 0.5
    # the run says what the trainer's auto settings became: one packed row where asked, else rows and why
    chosen = {"packing": True if eta == 0 else "rows", "activation_checkpointing": False, "logprob_chunk_tokens": 512,
              "compile": False}
    assert {k: results["trainer"][k] for k in chosen} == chosen
    assert ("dense" in results["trainer"].get("packing_why", "")) == (eta != 0)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if eta == 0:
        assert [m["train/padding_share"] for m in metrics if "train/padding_share" in m] == [0.0] * 5
    state = json.loads((tmp_path / "checkpoints" / "step-000005" / "state.json").read_text())
    assert state["version"] == 5 and state["buffer"]["sampler"]["position"] > 0


def test_evaluate_checkpoint_scores_a_saved_policy(engine, tmp_path):
    from factory.data.tasks import ReasoningGymSource
    from factory.data.heldout import suite_tasks, tasks_digest
    from factory.runtime.evaluation import evaluate_checkpoint

    recipe = small_recipe("train.steps=2", "eval.heldout=48")
    results = run(recipe, tmp_path, engines=[engine])
    ckpt = tmp_path / "checkpoints" / "step-000002"
    result = evaluate_checkpoint(recipe, ckpt, "heldout", n=48, engines=[engine])
    assert result["n"] == 48 and 0.0 <= result["mean"] <= 1.0
    # before and after training, and a later `factory evaluate --n 48`, score one seeded sample
    subset = tasks_digest(suite_tasks(recipe, "heldout", n=48))
    assert results["before"]["tasks_digest"] == results["after"]["tasks_digest"] == result["tasks_digest"] == subset
    assert subset != tasks_digest(ReasoningGymSource.from_recipe(recipe.data).heldout[:48])
    assert set(result["by_family"]) == {"basic_arithmetic"}
    # rewards lie in [0, 1] (the verifier gives partial credit too): the sample sd is at most 1/2
    assert 0.0 <= result["stderr"] <= 0.5 / 47 ** 0.5 + 1e-12
    assert (result["stderr"] > 0) == (0.0 < result["mean"] < 1.0)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        evaluate_checkpoint(recipe, tmp_path, engines=[engine])

    # mean@3: three seeded episodes per task, each task's samples together; the score and its SE are over
    # the 48 tasks' means (a task's samples are not independent draws of the suite)
    k = 3
    tripled = evaluate_checkpoint(recipe, ckpt, "heldout", n=48, engines=[engine], samples=k, keep_episodes=True)
    episodes = tripled["episodes"]
    tasks = suite_tasks(recipe, "heldout", n=48)
    assert tripled["n"] == 48 and tripled["samples_per_task"] == k and len(episodes) == 48 * k
    assert [e.task_id for e in episodes] == [t.task_id for t in tasks for _ in range(k)]
    assert len({e.sample_id for e in episodes}) == 48 * k
    means = [sum(e.reward for e in episodes[i: i + k]) / k for i in range(0, len(episodes), k)]
    assert tripled["mean"] == pytest.approx(sum(means) / 48)
    spread = sum((m - tripled["mean"]) ** 2 for m in means) / 47
    assert tripled["stderr"] == pytest.approx((spread / 48) ** 0.5)
    assert tripled["tasks_digest"] == subset and result["samples_per_task"] == 1
    with pytest.raises(ValueError, match="samples: expected at least 1"):
        evaluate_checkpoint(recipe, ckpt, engines=[engine], samples=0)


@pytest.fixture
def engine_back_to_wait(engine):
    """Tests that switch the shared engine's partial-rollout mode leave it as they found it."""
    import ray

    yield engine
    ray.get(engine.set_partial_rollout.remote("wait"))


def logprobs_under(weights_dir, rows, banned: int, bf16: bool = False):
    """Each row's completion logprobs under the weights in `weights_dir`, over the support the sampler
    had: `min_new_tokens` kept token `banned` (end of turn) out of it, so it is left out here too.
    `bf16`: the model held wholly in bf16, as the engine serves it (how far bf16 moves each logprob)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.bfloat16 if bf16 else torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            logits = model(input_ids=ids).logits[0].float()
            p, t = len(r["prompt_ids"]), len(r["completion_ids"])
            step_logits = logits[p - 1: p - 1 + t]
            step_logits[:, banned] = float("-inf")
            logp = torch.log_softmax(step_logits, dim=-1)
            out.append(logp.gather(1, torch.tensor(r["completion_ids"])[:, None])[:, 0].tolist())
    return out


@pytest.mark.parametrize("mode", ["abort_resume", "inflight"])
def test_partial_rollouts_carry_exact_per_token_versions(engine_back_to_wait, policy, tmp_path, mode):
    """η = 2 with long completions, so weight updates land mid-generation: samples hold tokens of two
    versions, versions never decrease along a sample, and each token's recorded behaviour logprob is
    the one its own version's weights give (checked against the checkpoint of that version).

    One group in flight at a time keeps generation the bottleneck, so the engine is busy whenever an
    update lands: with more, it could finish everything the staleness bound admits before the
    trainer's step ended, and on a loaded machine no update landed mid-generation (seen in CI)."""
    recipe = small_recipe("async.max_staleness=2", "async.max_inflight_groups=1",
                          f"rollout.partial_rollout={mode}", "train.steps=5",
                          "train.checkpoint_every=1", "rollout.max_new_tokens=96", "rollout.min_new_tokens=96",
                          "algorithm.filter_zero_variance=false", "eval.before=false", "eval.after=false",
                          "rollout.seed=null")  # seeded, these modes send one request per seed: no coalescing
    results = run(recipe, tmp_path, engines=[engine_back_to_wait])
    rows = trained_rows(tmp_path)
    assert results["samples_trained"] == len(rows) > 0
    mixed = []
    for r in rows:
        sampled = [v for v, m in zip(r["versions"], r["loss_mask"]) if m]
        assert len(sampled) == 96 and sampled == sorted(sampled), r["sample_id"]
        assert r["trained_version"] - sampled[0] <= 2
        if sampled[0] != sampled[-1]:
            mixed.append(r)
    assert mixed, f"no sample of {len(rows)} spans a weight update"
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sent = {k: steps[-1][f"rollout/engine_{k}"] - steps[0][f"rollout/engine_{k}"] for k in ("requests", "http_batches")}
    assert 0 < sent["http_batches"] < sent["requests"], f"prompts were not coalesced into HTTP requests: {sent}"

    from transformers import AutoTokenizer

    from .test_weight_sync import check_bf16_gap, moves

    eos = AutoTokenizer.from_pretrained(policy).eos_token_id
    checked = 0
    for version in sorted({v for r in mixed for v in r["versions"] if v >= 0}):
        weights = policy if version == 0 else tmp_path / "checkpoints" / f"step-{version:06d}"
        # inflight keeps the old KV under new weights: only the first segment is a pure-version recomputation
        sel = [r for r in mixed if (r["versions"][0] == version if mode == "inflight" else version in r["versions"])]
        if not sel:
            continue
        ref, ref_bf16 = logprobs_under(weights, sel, eos), logprobs_under(weights, sel, eos, bf16=True)
        # only the tokens `version` sampled: the behaviour logprob against this version's recomputation
        at = [[v == version for v in r["versions"]] for r in sel]
        d = torch.tensor([abs(a - b) for r, lp, keep in zip(sel, ref, at) for a, b, k in zip(r["logprobs"], lp, keep) if k])
        move = moves([[x for x, k in zip(lp, keep) if k] for lp, keep in zip(ref, at)],
                     [[x for x, k in zip(lp, keep) if k] for lp, keep in zip(ref_bf16, at)])
        # a resumed chunk's earlier tokens are re-prefilled by vLLM, a kernel path the bf16 copy does not
        # model: one token in ~1,000 lands past the per-token bound (0.29 against 0.28, seen in CI)
        check_bf16_gap(d, move, f"{mode} v{version}", outlier_share=0.005)
        checked += d.numel()
    assert checked > 0
