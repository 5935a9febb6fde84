"""The warm start's early stop (`model.sft_stop_loss`) and the cache key it must not disturb."""

from __future__ import annotations

import pytest

from factory.recipe import ModelSection, recipe_from_dict


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from factory.envs.base import make_environment
    from factory.model.tiny import build_tokenizer
    from factory.types import Task

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
    from factory.model.sft import policy_fingerprint

    plain = recipe_from_dict({})
    assert policy_fingerprint(plain) == policy_fingerprint(recipe_from_dict({}, overrides=["model.sft_stop_loss=null"]))
    assert policy_fingerprint(plain) != policy_fingerprint(recipe_from_dict({}, overrides=["model.sft_stop_loss=0.2"]))
