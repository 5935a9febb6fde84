"""Session-wide real stack for integration tests: one tiny warm-started policy, one local Ray,
one vLLM server (as an EngineActor) shared by every test that needs an engine. The Qwen2-style
policy (recipes/qwen2_tiny.yaml) has its own server, for the module that tests it; so do the Qwen3 and
Qwen3-MoE policies (test_qwen3.py)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from factory.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]

# Small enough for 2 cores: a short warm start, 4 prompts x 4 completions per step. Every group is
# trained: this policy rarely gets a sum right, so nearly every group's rewards are all equal, and with
# the zero-variance filter (the default recipe's) a run generated ~20 groups per group it trained (449
# filtered for 20 trained, measured). The test of every sample's fate, the resume tests, the seeded
# reproducibility runs, the attached-engine stall, the default-recipe SGLang run and the production test
# turn it back on (FILTER_ON).
TEST_OVERRIDES = [
    "model.sft_steps=120", "data.train_size=2000", "data.heldout_size=300",
    "train.groups_per_step=4", "rollout.group_size=4", "train.steps=4", "train.checkpoint_every=2",
    "eval.heldout=64", "train.threads=1", "algorithm.filter_zero_variance=false",
    # 262k tokens of KV cache (2 GB: 524k), far more than a test uses; 1 GB less to zero at each vLLM
    # start (~0.5 s), and less memory with two test lanes
    "rollout.kv_cache_gb=1",
]
FILTER_ON = "algorithm.filter_zero_variance=true"


def small_recipe(*extra: str):
    return load_recipe(REPO / "recipes" / "default.yaml", TEST_OVERRIDES + list(extra))


def qwen2_recipe(*extra: str):
    """recipes/qwen2_tiny.yaml at the same small size (warm start, batch shape) as `small_recipe`."""
    return load_recipe(REPO / "recipes" / "qwen2_tiny.yaml", TEST_OVERRIDES + list(extra))


def qwen3_recipe(*extra: str):
    """The dense Qwen3 (q/k RMSNorm, no biases, tied): recipes/qwen2_tiny.yaml's shapes and sizes as
    `qwen2_recipe`, built as architecture qwen3."""
    return qwen2_recipe("model.architecture=qwen3", *extra)


# The MoE policy is the one test_shipped_recipes.py warm-starts for recipes/moe_tiny.yaml (its own
# model and data, 30 SFT updates): one build for both (~25 s on 2 cores; the MoE's warm start costs
# ~3x the dense one's per update). Batch shape and engine settings as TEST_OVERRIDES.
MOE_OVERRIDES = ["model.sft_steps=30", *[o for o in TEST_OVERRIDES if not o.startswith(("model.", "data."))]]


def moe_recipe(*extra: str):
    """recipes/moe_tiny.yaml (Qwen3-MoE: 8 experts, top-2) with test_shipped_recipes.py's warm start."""
    return load_recipe(REPO / "recipes" / "moe_tiny.yaml", MOE_OVERRIDES + list(extra))


@pytest.fixture(scope="session")
def recipe():
    return small_recipe()


@pytest.fixture(scope="session")
def policy(recipe):
    from factory.training.base_policy import ensure_base_policy

    return ensure_base_policy(recipe)


@pytest.fixture(scope="session")
def ray_cluster():
    from factory.runtime.cluster import local_ray

    with local_ray():
        yield


@contextmanager
def served(policy, rollout, log: Path):
    """A vLLM server for `policy`, behind the same actor the run loop uses."""
    import ray

    from factory.runtime.actors import EngineActor

    actor = EngineActor.remote("vllm", str(policy), rollout, str(log))
    ray.get(actor.start.remote())
    try:
        yield actor
    finally:
        ray.get(actor.stop.remote())


@pytest.fixture(scope="session")
def engine(ray_cluster, recipe, policy, tmp_path_factory):
    """One vLLM server for the session."""
    with served(policy, recipe.rollout, tmp_path_factory.mktemp("engine") / "vllm.log") as actor:
        yield actor


@pytest.fixture(scope="session")
def qwen2_policy():
    from factory.training.base_policy import ensure_base_policy

    return ensure_base_policy(qwen2_recipe())


@pytest.fixture(scope="module")
def qwen2_engine(ray_cluster, qwen2_policy, tmp_path_factory):
    """The Qwen2-style policy's server, stopped after the module that uses it (~4 GB beside the session's)."""
    with served(qwen2_policy, qwen2_recipe().rollout, tmp_path_factory.mktemp("qwen2-engine") / "vllm.log") as actor:
        yield actor


@pytest.fixture(autouse=True, scope="session")
def _offline():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def actor_pids(class_name: str) -> list[int]:
    """The pids of the live Ray actor processes of `class_name` (Ray titles them `ray::<class>...`) in
    this test process's own local Ray (its raylet is our child, the actors its children): the suite runs
    one run at a time, so these are the running run's. Other Ray clusters on the machine (another test
    session, a user's run) are not counted, nor killed by the tests that kill what this returns."""
    import psutil

    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if cmd.startswith(f"ray::{class_name}") and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except psutil.Error:  # gone meanwhile
            continue
    return pids


def one_fate_per_group(run_id: str, group_size: int) -> list[dict]:
    """The lake's rows of run `run_id` (the lake of FACTORY_HOME): each sample once, each group whole,
    every status a final one."""
    from factory.lake.query import sql

    rows = sql(f"SELECT sample_id, group_id, status FROM samples WHERE run_id = '{run_id}'").to_pylist()
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)) > 0
    per_group: dict[str, set] = {}
    for r in rows:
        per_group.setdefault(r["group_id"], set()).add(r["sample_id"])
    assert all(len(s) == group_size for s in per_group.values()), per_group
    assert {r["status"] for r in rows} <= {"trained", "filtered", "rejected", "unused"}
    return rows
