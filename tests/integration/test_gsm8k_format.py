"""recipes/gsm8k_format.yaml on the real stack: tasks from its JSONL file source, replies scored by the
GSM8K extractor and the numeric verifier inside the env workers, trained, evaluated before and after,
and the run's lineage naming the file's content fingerprint; and a short run raises held-out accuracy
beyond 2 SE.

The policy, and why: the shared engine serves the session policy's shapes (its tokenizer has 271
tokens; one built on this recipe's texts has 274), so the policy is the session's, warm-started further
here. That policy cannot add (120 SFT steps; sampled, it gets 1% of one-digit sums right), and no
short run teaches a tiny model sums it has not seen (warm-started on half of the 121 sums of two numbers
up to 10, it gets ~10% of the other half right). So the test builds what a short RL run on GSM8K fixes
first: a policy that knows its arithmetic but seldom writes the final `#### N` line. The files are the
recipe's layout on the 242 sums and differences of two one-digit numbers (`gsm8k_rows` of an easy
family, written here; train and held-out disjoint). The warm start trains on all of them, held-out
questions included (the policy must know the facts it is asked, as a pretrained model knows
arithmetic): each question once with its `#### N` line and twice cut after the worked line (`a + b =
c`), so every question's replies write the line about one time in three (cut on some questions
instead, the policy learns per question whether to write it, and a group's replies all agree: no GRPO
signal). RL sees only the training file and rewards a reply only for the number after `####`, so the
held-out gain is format (the line written, its number the worked line's), not new arithmetic.
Held-out accuracy is read near-greedily (`eval.temperature` 0.1), as GSM8K accuracy usually is, so a
question counts once its `####` line is the likelier choice, and compared with 2 SE of the difference
(the two evaluations sample independently). Measured here (n = 120, 8 steps of 8 x 8): seeds 0 / 1 / 2
(the warm start's and the run's) went 0.000 -> 0.675 / 0.650 / 0.550, 2 SE 0.086-0.091; 5 steps after a
300-update warm start gained only 0.25 (seed 2): fewer steps would eat the margin.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from factory.data.tasks import TaskFamilySpec
from factory.recipe import ModelSection, load_recipe
from factory.run import run

from .conftest import REPO

pytestmark = pytest.mark.integration

RECIPE = REPO / "recipes" / "gsm8k_format.yaml"
# sums and differences of two one-digit numbers: 242 questions, split into two disjoint files
EASY = TaskFamilySpec("basic_arithmetic", {
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
    "allow_parentheses": False, "allow_negation": False})
TRAIN, HELDOUT = 122, 120
SFT_STEPS, CUTS = 400, 2  # each question's demonstrations: one with `#### N`, CUTS without
STEPS, GROUPS, G = 8, 8, 8
SHORT = [f"train.steps={STEPS}", f"train.groups_per_step={GROUPS}", f"rollout.group_size={G}", "train.lr=1e-4",
         "train.checkpoint_every=2", f"eval.heldout={HELDOUT}", "eval.temperature=0.1", "train.threads=1",
         "algorithm.filter_zero_variance=false"]


@pytest.fixture(scope="module")
def easy_files(tmp_path_factory):
    return write_easy_files(tmp_path_factory.mktemp("gsm8k-easy"))


def write_easy_files(out: Path) -> list[str]:
    """The recipe's overrides that point it at train.jsonl and test.jsonl of the easy family, written to `out`."""
    from factory.data.gsm8k_format import gsm8k_rows, jsonl

    for split, rows in gsm8k_rows(TRAIN, HELDOUT, family=EASY).items():
        (out / f"{split}.jsonl").write_text(jsonl(rows), encoding="utf-8")
    return [f"data.sources[0].path={out / 'train.jsonl'}", f"data.sources[0].heldout.path={out / 'test.jsonl'}"]


@pytest.fixture(scope="module")
def forgetful_policy(policy, easy_files):
    return ensure_forgetful_policy(policy, easy_files)


def ensure_forgetful_policy(policy: Path, easy_files: list[str], progress=None) -> Path:
    """`build_forgetful_policy` on `policy`, cached in the state dir's models/ as tiny-gsm8k-forgetful-<key>
    (the key: the base policy's directory name, which holds its fingerprint, the files' rows and the
    warm start's settings). A test session links the user's, built or not (`python -m tests.policies`,
    which `make test` runs in the background, builds it there: ~55 s on 2 cores): it waits for that build,
    or builds it there itself."""
    from factory.training.base_policy import build_once
    from factory.paths import models_dir

    from tests.conftest import link_user_policy

    name, key = forgetful_policy_key(Path(policy).name)
    link_user_policy(models_dir() / name)  # in a session: the user's, which `make test` may be building now

    def build(tmp: Path) -> None:
        build_forgetful_policy(policy, easy_files, tmp, progress=progress)
        (tmp / "sft.json").write_text(json.dumps({k: v for k, v in key.items() if k != "rows"}))  # complete

    return build_once(models_dir() / name, build)


def forgetful_policy_key(base: str) -> tuple[str, dict]:
    """The forgetful policy's directory name on the base policy named `base`, and the key it is hashed from."""
    from factory.data.gsm8k_format import gsm8k_rows

    key = {"base": base, "rows": gsm8k_rows(TRAIN, HELDOUT, family=EASY), "sft_steps": SFT_STEPS, "cuts": CUTS,
           "seed": 0, "version": 1}
    return f"tiny-gsm8k-forgetful-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}", key


def build_forgetful_policy(policy, easy_files, out, seed: int = 0, sft_steps: int = SFT_STEPS, cuts: int = CUTS,
                           progress=None):
    """The session policy warm-started on every question of both files, each once with its `#### N` line
    and `cuts` times cut after the worked line (same tokenizer and shapes, so the shared engine takes its
    weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.data.tasks import ReasoningGymSource
    from factory.envs.base import make_environment
    from factory.model.sft import warm_start

    source = ReasoningGymSource.from_recipe(load_recipe(RECIPE, easy_files).data)
    tasks = source.train + source.heldout
    # every question both ways, so each one's replies vary in format and GRPO's groups carry a signal
    demos = tasks + [replace(t, answer=t.answer.splitlines()[0]) for t in tasks] * cuts
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    torch.manual_seed(seed)
    warm_start(model, tokenizer, make_environment(load_recipe(RECIPE).environment), demos,
               ModelSection(sft_steps=sft_steps, seed=seed), progress)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_the_gsm8k_layout_recipe_trains_on_its_file_source_and_raises_heldout_accuracy(
        engine, easy_files, forgetful_policy, tmp_path):
    from factory.recording import lineage
    from factory.data.tasks import ReasoningGymSource, dataset_fingerprint
    from factory.rewards.extract import gsm8k_final
    from factory.rewards.verifiers import numeric_match

    recipe = load_recipe(RECIPE, [*SHORT, *easy_files, f"model.path={forgetful_policy}"])
    results = run(recipe, tmp_path, engines=[engine])
    source = ReasoningGymSource.from_recipe(recipe.data)
    tasks = {t.task_id: t for t in source.train}
    assert not {t.question for t in source.train} & {t.question for t in source.heldout}  # RL never sees one

    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert results["samples_trained"] == len(rows) == STEPS * GROUPS * G
    for r in rows:  # each reward is the verifier's: the number after the reply's `####` against the reference
        reply = gsm8k_final(r["info"]["answer"] or "")
        reference = tasks[r["task_id"]].metadata["reference"]
        assert r["reward"] == (numeric_match(reply, reference) if reply is not None else 0.0), r["info"]
    with_format = [sum(gsm8k_final(r["info"]["answer"] or "") is not None for r in rows if r["trained_step"] == s)
                   / (GROUPS * G) for s in (1, STEPS)]

    before, after = results["before"], results["after"]
    assert before["n"] == after["n"] == HELDOUT and before["tasks_digest"] == after["tasks_digest"]
    se = math.hypot(before["stderr"], after["stderr"])  # of the difference: two evaluations, sampled independently
    print(f"\nheld-out: {before['mean']:.3f} ± {before['stderr']:.3f} -> {after['mean']:.3f} ± {after['stderr']:.3f}"
          f" (n = {before['n']}; gain {after['mean'] - before['mean']:+.3f}, 2 SE = {2 * se:.3f}); training replies"
          f" with '#### N': {with_format[0]:.0%} at step 1, {with_format[1]:.0%} at step {STEPS}")
    assert after["mean"] - before["mean"] > 2 * se
    assert with_format[1] > with_format[0]  # how: RL made the line likelier on the questions it trained on
    assert results["improved_beyond_2se"] and math.isclose(results["delta_stderr"], se)  # the run's own verdict agrees

    # lineage: the checkpoint names the dataset by the file's content fingerprint
    manifest = lineage.read_manifest(tmp_path / "checkpoints" / "step-000002")
    assert manifest["dataset"] == dataset_fingerprint(recipe.data)
