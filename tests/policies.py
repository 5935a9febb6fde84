"""Build the policies the suite's fixtures ask for (the small test recipe's, the Qwen2-style and the Qwen3
ones, tests/integration/conftest.py, ~17 s each on 2 cores; the GSM8K test's, warm-started further on its
files, ~55 s) into the user's state dir (FACTORY_HOME, else .state), where a test session links them
instead of building them in its own dir.

`make test` runs this in the background at the lowest priority (Makefile), on what the suite leaves
idle: a session links these policies before they exist, and a test that needs one before it is built
waits for this build (tests/conftest.py). Idempotent: a policy already built is left as it is.

The machine's cache of them: each policy built here is also kept in the user's cache dir
(~/.cache/factory/test-policies/, as the venvs and sandbox rootfs are: infra/uv.sh), keyed by its directory
name (its recipe's fingerprint) and a digest of the code and libraries that build it (`build_digest`), and a
fresh clone's state dir gets a copy of it instead of a build: in a fresh clone's CI the three warm starts
took ~3 min at nice 19 beside the suite's first tests, and the production test waited for the first.
FACTORY_POLICY_CACHE=0 turns it off.

    python -m tests.policies
"""

from __future__ import annotations


def base_policy_names() -> tuple[str, ...]:
    """The directory names of the suite's base policies (the small test recipe's, the Qwen2-style and Qwen3
    ones, the shipped recipes' short warm starts of their smoke test: the Qwen3-MoE's among them)."""
    from factory.model.policy_cache import cached_policy_dir
    from tests.integration.conftest import qwen2_recipe, qwen3_recipe, small_recipe

    names = [cached_policy_dir(recipe).name
             for recipe in (small_recipe(), qwen2_recipe(), qwen3_recipe(), *smoke_recipes())]
    return tuple(dict.fromkeys(names))


def smoke_recipes() -> list:
    """The shipped recipes as tests/integration/test_shipped_recipes.py runs them (those of one policy once)."""
    from factory.model.policy_cache import cached_policy_dir
    from tests.integration.test_shipped_recipes import RECIPES, smoke_recipe

    recipes = {}
    for name in RECIPES:
        recipe = smoke_recipe(name)
        recipes.setdefault(cached_policy_dir(recipe).name, recipe)
    return list(recipes.values())


# what builds the suite's policies: a change to any of it is a new digest (a build, not a copy)
BUILD_SOURCES = ("factory/model", "factory/data", "factory/envs", "factory/recipe", "factory/core/types.py",
                 "factory/core/registry.py", "factory/core/registries.py", "factory/paths.py", "recipes",
                 "tests/policies.py", "tests/integration/conftest.py", "tests/integration/test_gsm8k_format.py",
                 "tests/integration/test_shipped_recipes.py")


def build_digest() -> str:
    """A digest of `BUILD_SOURCES`' files and the versions of Python, torch, transformers and tokenizers."""
    import hashlib
    import sys
    from importlib.metadata import version

    from factory.paths import REPO_ROOT

    digest = hashlib.sha256(f"{sys.version} {[version(p) for p in ('torch', 'transformers', 'tokenizers')]}".encode())
    for name in BUILD_SOURCES:
        root = REPO_ROOT / name
        for path in sorted(root.rglob("*") if root.is_dir() else [root]):
            if path.is_file() and path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts:
                digest.update(f"{path.relative_to(REPO_ROOT)}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def machine_cache():
    """The machine's cache dir of the suite's policies, or None where FACTORY_POLICY_CACHE=0."""
    import os
    from pathlib import Path

    if os.environ.get("FACTORY_POLICY_CACHE", "1") == "0":
        return None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "factory" / "test-policies"


def from_machine_cache(out, digest: str) -> bool:
    """Publish the machine cache's copy of the policy `out` (a dir under models/) there, under the lock its
    builders take (`build_once`), unless it is built; whether `out` is built now."""
    import shutil

    from factory.training.base_policy import build_once

    cache = machine_cache()
    entry = None if cache is None else cache / f"{out.name}-{digest}"
    if (out / "sft.json").is_file() or entry is None or not (entry / "sft.json").is_file():
        return (out / "sft.json").is_file()

    def copy(tmp) -> None:  # sft.json last: a policy is complete once it holds it
        for path in sorted(entry.iterdir(), key=lambda p: p.name == "sft.json"):
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, tmp / path.name)

    build_once(out, copy)
    print(f"tests.policies: {out.name} from the machine's cache ({entry})", flush=True)
    return True


def to_machine_cache(out, digest: str) -> None:
    """Keep the built policy `out` in the machine's cache (written beside, then renamed), dropping older
    entries of the same name. Best effort: a full disk only costs the next clone a build."""
    import os
    import shutil

    cache = machine_cache()
    if cache is None or (cache / f"{out.name}-{digest}" / "sft.json").is_file():
        return
    partial = cache / f".{out.name}-{digest}.{os.getpid()}"
    try:
        shutil.copytree(out.resolve(), partial)
        partial.rename(cache / f"{out.name}-{digest}")
        for old in cache.glob(f"{out.name}-*"):
            if old.name != f"{out.name}-{digest}":
                shutil.rmtree(old, ignore_errors=True)
    except OSError as error:
        print(f"tests.policies: {out.name} not kept in the machine's cache: {error}", flush=True)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def main() -> None:
    import tempfile
    from pathlib import Path

    from factory.model.policy_cache import cached_policy_dir
    from factory.training.base_policy import ensure_base_policy
    from factory.paths import models_dir
    from tests.integration.conftest import qwen2_recipe, qwen3_recipe, small_recipe
    from tests.integration.test_gsm8k_format import ensure_forgetful_policy, forgetful_policy_key, write_easy_files

    from factory.support.progress import RunProgress

    digest = build_digest()

    def ensure(out: Path, build) -> Path:
        if not from_machine_cache(out, digest):
            build()
            to_machine_cache(out, digest)
        print(f"tests.policies: {out}", flush=True)
        return out

    # in the order the suite first needs them (tests/infra and most of tests/integration, then
    # test_gsm8k_format.py, then test_qwen2.py and test_qwen3.py); a bar per warm start (none for one already built)
    small = ensure(cached_policy_dir(small_recipe()),
                   lambda: ensure_base_policy(small_recipe(), RunProgress(0).on_sft_step))
    with tempfile.TemporaryDirectory() as files:  # the GSM8K test's policy, warm-started on these files
        ensure(models_dir() / forgetful_policy_key(small.name)[0],
               lambda: ensure_forgetful_policy(small, write_easy_files(Path(files)), RunProgress(0).on_sft_step))
    ensure(cached_policy_dir(qwen2_recipe()), lambda: ensure_base_policy(qwen2_recipe(), RunProgress(0).on_sft_step))
    ensure(cached_policy_dir(qwen3_recipe()), lambda: ensure_base_policy(qwen3_recipe(), RunProgress(0).on_sft_step))
    for recipe in smoke_recipes():  # test_shipped_recipes.py's, short warm starts of ~10 s each
        ensure(cached_policy_dir(recipe), lambda recipe=recipe: ensure_base_policy(recipe, RunProgress(0).on_sft_step))


if __name__ == "__main__":
    main()
