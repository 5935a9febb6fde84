"""Where a recipe's base policy is cached: its key (what it depends on), fingerprint and directory,
and the policies already built in the state dir."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from factory.paths import models_dir


def policy_key(recipe) -> dict:
    """Everything the base policy depends on: the model and data sections and the environment prompt
    (kept beside each new policy as key.json, so the next build can say what changed)."""
    model = recipe.model.model_dump(mode="json")
    # added later: at their defaults, cached policies keep their key
    for name in ("architecture", "num_kv_heads", "sft_stop_loss", "num_experts", "experts_per_token",
                 "expert_intermediate_size"):
        if model[name] == type(recipe.model).model_fields[name].default:
            del model[name]
    key = {
        "model": model,
        # data.overlong decides which tasks a run keeps, not what the warm start trains on
        "data": {k: v for k, v in recipe.data.model_dump(mode="json").items() if k != "overlong"},
        "system_prompt": recipe.environment.system_prompt,
        "version": 3,  # bump when the warm start's procedure changes
    }
    return key


def policy_fingerprint(recipe) -> str:
    """The cache key of `recipe`'s base policy: a digest of `policy_key`."""
    return hashlib.sha256(json.dumps(policy_key(recipe), sort_keys=True).encode()).hexdigest()[:12]


def base_policy_path(recipe) -> Path | None:
    """Where `recipe`'s base policy is (model.path, or the cached warm start), or None if not built yet."""
    if recipe.model.path:
        return Path(recipe.model.path)
    out = cached_policy_dir(recipe)
    return out if (out / "sft.json").is_file() else None


def cached_policy_dir(recipe) -> Path:
    """Where the warm start of `recipe`'s tiny model is cached: tiny-<fingerprint> (the Llama, as
    always) or tiny-<architecture>-<fingerprint>."""
    arch = recipe.model.architecture
    return models_dir() / f"tiny-{'' if arch == 'llama' else arch + '-'}{policy_fingerprint(recipe)}"


def cached_policies(architecture: str) -> list[tuple[Path, dict, dict | None]]:
    """The built warm starts of `architecture` in the state dir: (dir, its sft.json, its key.json or None)."""
    out = []
    for path in sorted(models_dir().glob("tiny-*")):
        try:
            meta = json.loads((path / "sft.json").read_text())
            key = json.loads((path / "key.json").read_text()) if (path / "key.json").is_file() else None
        except (OSError, ValueError):  # not a built policy (a lock, a build under way)
            continue
        if "fingerprint" in meta and meta.get("architecture", "llama") == architecture:  # not a policy built on one
            out.append((path, meta, key))
    return out
