"""The base policy a run starts from: built once per recipe key (the SFT warm start of the tiny model on
the run's own tasks and environment prompt) and cached under the state dir, or `model.path` as it is."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from factory.model.policy_cache import (
    base_policy_path, cached_policies, cached_policy_dir, policy_fingerprint, policy_key,
)
from factory.model.sft import tokenizer_texts, warm_start
from factory.paths import exclusive

SFT_SECONDS_PER_STEP = 0.25  # a build's seconds per warm-start update, setup included: the suite's Llama, 2 cores
KEY_FIELDS = {"system_prompt": "environment.system_prompt", "version": "the warm start's procedure (its version)"}


def key_differences(key: dict, other: dict) -> list[str]:
    """The recipe fields, dotted, whose values differ between two `policy_key`s (a field one key
    lacks differs: a key leaves out some fields at their defaults)."""
    def flat(value, path: str) -> dict[str, object]:
        if isinstance(value, dict) and value:
            items = [(f"{path}.{name}" if path else name, item) for name, item in value.items()]
        elif isinstance(value, list) and value:
            items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
        else:
            return {path: value}
        return {k: v for sub, item in items for k, v in flat(item, sub).items()}

    a, b = flat(key, ""), flat(other, "")
    missing = object()
    changed = [k for k in sorted(a.keys() | b.keys()) if a.get(k, missing) != b.get(k, missing)]
    return [KEY_FIELDS.get(k, k) for k in changed]


def base_policy_plan(recipe) -> str:
    """The line before the base policy is made ready: where it comes from, or that a new warm start is
    built, why (the fields that differ from the nearest cached policy of the architecture) and about how
    long it takes (that policy's seconds per update, else the median of the cached ones', else
    SFT_SECONDS_PER_STEP, times `model.sft_steps`)."""
    if recipe.model.path:
        return f"base policy (model.path: {recipe.model.path})"
    built = base_policy_path(recipe)
    if built is not None:
        return f"base policy (cached: {built.name})"
    arch = recipe.model.architecture
    cached = cached_policies(arch)
    key = policy_key(recipe)
    keyed = [(key_differences(key, other), path, meta) for path, meta, other in cached if other is not None]
    if keyed:
        fields, nearest, meta = min(keyed, key=lambda k: (len(k[0]), k[1].name))
        why = f"{', '.join(fields)} differ{'s' if len(fields) == 1 else ''} from the cached policy {nearest.name}"
        rates = [_seconds_per_step(meta)]
    else:
        why = f"no cached policy of this architecture ({arch})"
        if cached:
            why += f" holds a key.json to compare with ({len(cached)} cached)"
        rates = [_seconds_per_step(meta) for _, meta, _ in cached]
    known = sorted(r for r in rates if r)
    rate = known[len(known) // 2] if known else SFT_SECONDS_PER_STEP
    steps = recipe.model.sft_steps
    sooner = ", model.sft_stop_loss may end it sooner" if recipe.model.sft_stop_loss is not None else ""
    return (f"base policy: building a new SFT warm start into {cached_policy_dir(recipe).name} ({why}); "
            f"model.sft_steps={steps} at ~{rate:.2f} s each: about {_duration(steps * rate)}{sooner}")


def _seconds_per_step(meta: dict) -> float | None:
    steps = meta.get("sft_steps_run") or meta.get("sft_steps")
    return meta["seconds"] / steps if steps and meta.get("seconds") else None


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def ensure_base_policy(recipe, progress=None) -> Path:
    """The warm-started policy for `recipe`, built once and cached under the state dir.

    With `model.path` set, that directory is used as it is.
    """
    if recipe.model.path:
        path = Path(recipe.model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {path} holds no config.json (not a Hugging Face model dir)")
        return path
    return build_once(cached_policy_dir(recipe), lambda tmp: _build_base_policy(recipe, tmp, progress))


def build_once(out: Path, build) -> Path:
    """`out` (a policy dir, complete once it holds sft.json), made by `build(tmp)` unless it exists.
    One build at a time per dir: processes that need it together (a sweep's runs, two test sessions)
    wait for the first, then find it published. `build` writes into a dir of this process's own,
    sft.json last, published by one rename: a crash mid-build leaves no half-made policy, and builders
    the lock cannot reach (another machine, a filesystem without flock) cannot mix their files (seen
    before the lock: a shared dir got mixed files); the first to finish publishes.

    `out` may be a link to where the policy is shared (a test session links the user's state dir's
    policies, even one still being built there): the lock, the build and the publish then happen at the
    link's target, so this waits for a builder there instead of building a second copy."""
    if (out / "sft.json").is_file():
        return out
    target = out.resolve()

    def waiting(holder: str) -> None:
        print(f"waiting for pid {holder}, which is building the policy {target.name}", file=sys.stderr, flush=True)

    with exclusive(target.with_name(f".{target.name}.lock"), on_wait=waiting):
        if not (target / "sft.json").is_file():
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            build(tmp)
            try:
                tmp.rename(target)  # atomic publish
            except OSError:  # another process published the same policy first (the same inputs, the same result)
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _build_base_policy(recipe, tmp: Path, progress) -> None:
    """The warm start of `recipe`'s tiny model, written to `tmp` (sft.json last)."""
    import torch

    from factory.data.tasks import ReasoningGymSource
    from factory.envs.base import make_environment
    from factory.model.tiny import build_model, build_tokenizer

    t0 = time.time()
    source = ReasoningGymSource.from_recipe(recipe.data)
    env = make_environment(recipe.environment)
    train = source.train[: recipe.model.sft_examples]
    tokenizer = build_tokenizer(tokenizer_texts(env.prompt_messages, train), recipe.model.bpe_vocab_size, tmp,
                                recipe.model.architecture)
    model = build_model(tokenizer, recipe.model, tmp)
    torch.manual_seed(recipe.model.seed)
    losses = warm_start(model, tokenizer, env, train, recipe.model, progress)
    model.save_pretrained(tmp)
    meta = {
        "fingerprint": policy_fingerprint(recipe),
        "architecture": recipe.model.architecture,
        "sft_steps": recipe.model.sft_steps,
        "sft_steps_run": len(losses),
        "final_loss": losses[-1] if losses else None,
        "loss_curve": losses,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": time.time() - t0,
    }
    (tmp / "key.json").write_text(json.dumps(policy_key(recipe), indent=1, sort_keys=True))
    (tmp / "sft.json").write_text(json.dumps(meta))
