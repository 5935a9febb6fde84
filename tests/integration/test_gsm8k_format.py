"""recipes/gsm8k_format.yaml on the real stack: tasks from its JSONL file source, replies scored by the
GSM8K extractor and the numeric verifier inside the env workers, trained, evaluated before and after,
and the run's lineage naming the file's content fingerprint.

What a short run here can show and what it cannot: the shared engine serves the session policy's
shapes (its tokenizer has 271 tokens; one built on this recipe's texts has 274), so the policy is the
session's, warm-started 80 more steps on the GSM8K layout (it writes `a + b = c` then `#### c`). Four
GRPO steps do not move its held-out accuracy beyond 2 SE (seen: 0.000 -> 0.016 ± 0.016, n = 64; two-digit
sums after 200 SFT steps in all are almost never right), and no short run here could: the default
recipe needs ~75 steps of 64 episodes from a 0.66 start to gain 0.05 (README). So this test checks
what a short run does show: every reward is the verifier's, the replies keep the layout, the run
trains and evaluates, and its lineage names the data.
"""

from __future__ import annotations

import json

import pytest

from factory.recipe import ModelSection, load_recipe
from factory.run import run

from .conftest import REPO

pytestmark = pytest.mark.integration

RECIPE = REPO / "recipes" / "gsm8k_format.yaml"
SHORT = ["train.steps=4", "train.groups_per_step=4", "rollout.group_size=4", "train.checkpoint_every=2",
         "eval.heldout=64", "train.threads=1", "algorithm.filter_zero_variance=false"]


@pytest.fixture(scope="module")
def gsm8k_policy(policy, tmp_path_factory):
    """The session policy, warm-started further on the recipe's training file (same tokenizer and shapes,
    so the shared engine takes its weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.data.tasks import ReasoningGymSource
    from factory.envs.base import make_environment
    from factory.model.sft import warm_start

    recipe = load_recipe(RECIPE)
    out = tmp_path_factory.mktemp("gsm8k-policy")
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    torch.manual_seed(0)
    tasks = ReasoningGymSource.from_recipe(recipe.data).train
    warm_start(model, tokenizer, make_environment(recipe.environment), tasks, ModelSection(sft_steps=80))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_the_gsm8k_layout_recipe_trains_on_its_file_source(engine, gsm8k_policy, tmp_path):
    from factory import lineage
    from factory.data.tasks import ReasoningGymSource, dataset_fingerprint
    from factory.rewards.extract import gsm8k_final
    from factory.rewards.verifiers import numeric_match

    recipe = load_recipe(RECIPE, [*SHORT, f"model.path={gsm8k_policy}"])
    results = run(recipe, tmp_path, engines=[engine])
    tasks = {t.task_id: t for t in ReasoningGymSource.from_recipe(recipe.data).train}

    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert results["samples_trained"] == len(rows) == 4 * 16
    for r in rows:  # each reward is the verifier's: the number after the reply's `####` against the reference
        reply = gsm8k_final(r["info"]["answer"] or "")
        reference = tasks[r["task_id"]].metadata["reference"]
        assert r["reward"] == (numeric_match(reply, reference) if reply is not None else 0.0), r["info"]
    with_format = sum(gsm8k_final(r["info"]["answer"] or "") is not None for r in rows) / len(rows)
    assert with_format >= 0.5, with_format  # the warm start taught the layout (seen: 89%; the session policy: 0%)

    before, after = results["before"], results["after"]
    assert before["n"] == after["n"] == 64 and before["tasks_digest"] == after["tasks_digest"]
    print(f"\nheld-out: {before['mean']:.3f} ± {before['stderr']:.3f} -> {after['mean']:.3f} ± {after['stderr']:.3f}"
          f" (replies with '#### N': {with_format:.0%})")

    # lineage: the checkpoint names the dataset by the file's content fingerprint
    manifest = lineage.read_manifest(tmp_path / "checkpoints" / "step-000002")
    assert manifest["dataset"] == dataset_fingerprint(recipe.data)
