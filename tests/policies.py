"""Build the policies the suite's fixtures ask for (the small test recipe's and the Qwen2-style one's,
tests/integration/conftest.py, ~17 s each on 2 cores; the GSM8K test's, warm-started further on its
files, ~55 s) into the user's state dir (FACTORY_HOME, else .state), where a test session links them
instead of building them in its own dir.

`make test` runs this first; `.ci/run` runs it beside `make lint`, which keeps one core busy, so that
a fresh clone's suite does not start with the warm starts. Idempotent: a policy already built is left
as it is.

    python -m tests.policies
"""

from __future__ import annotations


def main() -> None:
    import tempfile
    from pathlib import Path

    from factory.model.sft import ensure_base_policy
    from tests.integration.conftest import qwen2_recipe, small_recipe
    from tests.integration.test_gsm8k_format import ensure_forgetful_policy, write_easy_files

    from factory.progress import RunProgress

    for recipe in (small_recipe(), qwen2_recipe()):  # a bar per warm start (none for one already built)
        print(f"tests.policies: {ensure_base_policy(recipe, RunProgress(0).on_sft_step)}", flush=True)
    with tempfile.TemporaryDirectory() as files:  # the GSM8K test's policy, warm-started on these files
        policy = ensure_forgetful_policy(ensure_base_policy(small_recipe()), write_easy_files(Path(files)),
                                         RunProgress(0).on_sft_step)
    print(f"tests.policies: {policy}")


if __name__ == "__main__":
    main()
