"""The warm start's early stop (`model.sft_stop_loss`) and the cache key it must not disturb."""

from __future__ import annotations

import pytest

from factory.recipe import ModelSection, recipe_from_dict


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from factory.envs.base import make_environment
    from factory.model.tiny import build_tokenizer
    from factory.core.types import Task

    recipe = recipe_from_dict({})
    env = make_environment(recipe.environment)
    tasks = [Task(f"t{i}", "f", f"Calculate {i} + {i}.", str(2 * i)) for i in range(20)]
    out = tmp_path_factory.mktemp("sft")
    texts = [m["content"] for t in tasks for m in env.prompt_messages(t)] + [t.answer for t in tasks]
    tok = build_tokenizer(texts, 270, out)
    return tok, env, tasks, out


def _warm(tiny, progress=None, **section):
    import torch

    from factory.model.sft import warm_start
    from factory.model.tiny import build_model

    tok, env, tasks, out = tiny
    shape = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, sft_batch_size=8)
    model = build_model(tok, ModelSection(**shape, **section), out)
    torch.manual_seed(0)
    return warm_start(model, tok, env, tasks, ModelSection(**shape, **section), progress)


def test_the_warm_start_stops_once_its_recent_mean_loss_reaches_the_target(tiny):
    from factory.model.sft import STOP_WINDOW

    full = _warm(tiny, sft_steps=120)
    assert len(full) == 120
    # a target above every loss stops at the first full window; one below every loss never stops
    seen = []
    assert len(_warm(tiny, sft_steps=120, sft_stop_loss=1e6, progress=lambda *a: seen.append(a[:2]))) == STOP_WINDOW
    assert seen[-2:] == [(STOP_WINDOW, 120), (STOP_WINDOW, STOP_WINDOW)]  # the progress bar ends where it stopped
    assert len(_warm(tiny, sft_steps=120, sft_stop_loss=1e-9)) == 120
    # a target the curve reaches midway: stops at the first update whose window mean is at or below it
    target = sum(full[60 - STOP_WINDOW:60]) / STOP_WINDOW
    stopped = _warm(tiny, sft_steps=120, sft_stop_loss=target)
    assert stopped == full[: len(stopped)]  # the same updates, cut short
    means = [sum(full[i - STOP_WINDOW:i]) / STOP_WINDOW for i in range(STOP_WINDOW, 121)]
    assert len(stopped) == STOP_WINDOW + next(i for i, m in enumerate(means) if m <= target) <= 60


def test_the_warm_start_uses_every_core_then_gives_the_thread_count_back(tiny):
    """A process left on one thread (a trainer in it set one) still warm-starts on all its cores."""
    import os

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        during: list[int] = []
        _warm(tiny, sft_steps=3, progress=lambda *_: during.append(torch.get_num_threads()))
        assert during == [len(os.sched_getaffinity(0))] * 3
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_stop_target_keys_the_cached_policy_only_when_set():
    from factory.model.policy_cache import policy_fingerprint

    plain = recipe_from_dict({})
    assert policy_fingerprint(plain) == policy_fingerprint(recipe_from_dict({}, overrides=["model.sft_stop_loss=null"]))
    assert policy_fingerprint(plain) != policy_fingerprint(recipe_from_dict({}, overrides=["model.sft_stop_loss=0.2"]))


# ---- announcing a new warm start ----------------------------------------------------------

TINY = ["model.sft_steps=2", "data.train_size=40", "data.heldout_size=10", "model.sft_examples=40",
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
        "model.sft_batch_size=4"]


def test_a_build_keeps_its_key_beside_the_policy_and_the_fingerprint_is_its_digest(tmp_path):
    import hashlib
    import json

    from factory.model.policy_cache import policy_fingerprint, policy_key
    from factory.training.base_policy import _build_base_policy

    recipe = recipe_from_dict({}, overrides=TINY)
    _build_base_policy(recipe, tmp_path, None)
    key = json.loads((tmp_path / "key.json").read_text())
    assert key == policy_key(recipe)
    assert hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12] == policy_fingerprint(recipe)
    assert json.loads((tmp_path / "sft.json").read_text())["fingerprint"] == policy_fingerprint(recipe)


def test_key_differences_name_the_recipe_fields_that_changed():
    from factory.model.policy_cache import policy_key
    from factory.training.base_policy import key_differences

    base = policy_key(recipe_from_dict({}))
    assert key_differences(base, base) == []
    prompt = policy_key(recipe_from_dict({}, overrides=["environment.system_prompt=Answer with a number."]))
    assert key_differences(prompt, base) == ["environment.system_prompt"]
    data = policy_key(recipe_from_dict({}, overrides=["data.families[0].config.max_digits=3", "model.sft_steps=10"]))
    assert key_differences(data, base) == ["data.families[0].config.max_digits", "model.sft_steps"]
    # a field a key leaves out at its default differs from the same field set
    stop = policy_key(recipe_from_dict({}, overrides=["model.sft_stop_loss=0.2"]))
    assert key_differences(stop, base) == key_differences(base, stop) == ["model.sft_stop_loss"]
    assert key_differences({**base, "version": 2}, base) == ["the warm start's procedure (its version)"]


def cache(models, name: str, recipe=None, architecture: str = "llama", seconds: float = 60.0, steps: int = 120):
    """A fabricated cached policy: sft.json, and key.json when `recipe` is given."""
    import json

    from factory.model.policy_cache import policy_key

    out = models / name
    out.mkdir(parents=True)
    (out / "sft.json").write_text(json.dumps({"fingerprint": name, "architecture": architecture, "sft_steps": steps,
                                              "sft_steps_run": steps, "seconds": seconds}))
    if recipe is not None:
        (out / "key.json").write_text(json.dumps(policy_key(recipe)))
    return out


def test_the_plan_names_a_cached_policy_or_why_and_how_long_a_build_takes(tmp_path, monkeypatch):
    from factory.model.policy_cache import cached_policy_dir
    from factory.training.base_policy import SFT_SECONDS_PER_STEP, base_policy_plan

    monkeypatch.setenv("FACTORY_HOME", str(tmp_path))
    models = tmp_path / "models"
    recipe = recipe_from_dict({}, overrides=["model.sft_steps=2400"])
    assert base_policy_plan(recipe).endswith(
        f"(no cached policy of this architecture (llama)); model.sft_steps=2400 at ~{SFT_SECONDS_PER_STEP:.2f} s "
        "each: about 10 min")
    assert base_policy_plan(recipe).startswith(f"base policy: building a new SFT warm start into "
                                               f"{cached_policy_dir(recipe).name} (")
    cache(models, "tiny-old", seconds=120, steps=400)  # built before keys were kept: 0.3 s an update
    cache(models, "tiny-qwen2-other", recipe_from_dict({}, overrides=["model.architecture=qwen2"]), "qwen2")
    cache(models, "tiny-gsm8k-x").joinpath("sft.json").write_text('{"base": "tiny-old", "sft_steps": 400}')
    assert "(no cached policy of this architecture (llama) holds a key.json to compare with (1 cached)); " \
        "model.sft_steps=2400 at ~0.30 s each: about 12 min" in base_policy_plan(recipe)

    cache(models, "tiny-far", recipe_from_dict({}, overrides=["model.sft_steps=10", "model.seed=3"]))
    cache(models, "tiny-near", recipe_from_dict({}, overrides=["environment.system_prompt=Be brief."]), seconds=20)
    assert "(environment.system_prompt differs from the cached policy tiny-near); model.sft_steps=2400 at ~0.17 s " \
        "each: about 7 min" in base_policy_plan(recipe)
    stopping = recipe_from_dict({}, overrides=["model.sft_steps=100", "model.sft_stop_loss=0.2", "model.seed=3"])
    assert base_policy_plan(stopping).endswith(
        "(model.sft_steps, model.sft_stop_loss differ from the cached policy tiny-far); model.sft_steps=100 at "
        "~0.50 s each: about 50 s, model.sft_stop_loss may end it sooner")

    built = cache(models, cached_policy_dir(recipe).name, recipe)
    assert base_policy_plan(recipe) == f"base policy (cached: {built.name})"
    assert base_policy_plan(recipe_from_dict({}, overrides=["model.path=/m"])) == "base policy (model.path: /m)"
