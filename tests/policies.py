"""Build the policies the suite's fixtures ask for (the small test recipe's and the Qwen2-style one's,
tests/integration/conftest.py, ~17 s each on 2 cores; the GSM8K test's, warm-started further on its
files, ~55 s) into the user's state dir (FACTORY_HOME, else .state), where a test session links them
instead of building them in its own dir.

`make test` runs this in the background at the lowest priority (Makefile), on what the suite leaves
idle: a session links these policies before they exist, and a test that needs one before it is built
waits for this build (tests/conftest.py). Idempotent: a policy already built is left as it is.

    python -m tests.policies
"""

from __future__ import annotations


def base_policy_names() -> tuple[str, ...]:
    """The directory names of the suite's base policies (the small test recipe's, the Qwen2-style one's)."""
    from factory.model.sft import cached_policy_dir
    from tests.integration.conftest import qwen2_recipe, small_recipe

    return tuple(cached_policy_dir(recipe).name for recipe in (small_recipe(), qwen2_recipe()))


def main() -> None:
    import tempfile
    from pathlib import Path

    from factory.model.sft import ensure_base_policy
    from tests.integration.conftest import qwen2_recipe, small_recipe
    from tests.integration.test_gsm8k_format import ensure_forgetful_policy, write_easy_files

    from factory.progress import RunProgress

    # in the order the suite first needs them (tests/infra and most of tests/integration, then
    # test_gsm8k_format.py, then test_qwen2.py); a bar per warm start (none for one already built)
    small = ensure_base_policy(small_recipe(), RunProgress(0).on_sft_step)
    print(f"tests.policies: {small}", flush=True)
    with tempfile.TemporaryDirectory() as files:  # the GSM8K test's policy, warm-started on these files
        policy = ensure_forgetful_policy(small, write_easy_files(Path(files)), RunProgress(0).on_sft_step)
    print(f"tests.policies: {policy}", flush=True)
    print(f"tests.policies: {ensure_base_policy(qwen2_recipe(), RunProgress(0).on_sft_step)}", flush=True)


if __name__ == "__main__":
    main()
