"""A bubblewrap sandbox for the tests that run code (skipped where bubblewrap cannot run, failed in CI)."""

import os

import pytest

from factory.sandbox import SandboxUnavailable, make_sandbox


@pytest.fixture(scope="module")
def sandbox():
    try:
        box = make_sandbox("bubblewrap")
    except SandboxUnavailable as err:
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(f"bubblewrap sandbox unavailable in CI: {err}")
        pytest.skip(f"bubblewrap sandbox unavailable here: {err}")
    yield box
    box.close()
