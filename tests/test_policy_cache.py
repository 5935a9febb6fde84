"""The machine's cache of the suite's policies (tests/policies.py): a built policy is kept there under its
name and build digest, and a fresh state dir gets a copy of it, published as a build is (sft.json last,
one rename); another digest is a miss, and keeping a new one drops the old."""

from __future__ import annotations

from pathlib import Path

from tests.policies import build_digest, from_machine_cache, machine_cache, to_machine_cache


def built_policy(models: Path, name: str = "tiny-abc") -> Path:
    out = models / name
    out.mkdir(parents=True)
    (out / "config.json").write_text('{"n": 1}')
    (out / "model.safetensors").write_bytes(b"\x00weights")
    (out / "sft.json").write_text('{"fingerprint": "abc"}')
    return out


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_a_kept_policy_is_copied_into_a_fresh_state_dir_and_only_for_its_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("FACTORY_POLICY_CACHE", raising=False)
    built = built_policy(tmp_path / "first" / "models")
    to_machine_cache(built, "d1")
    assert files_of(machine_cache() / "tiny-abc-d1") == files_of(built)

    fresh = tmp_path / "second" / "models" / "tiny-abc"
    assert not from_machine_cache(fresh, "d2") and not fresh.exists()  # another build digest: a build, not a copy
    assert from_machine_cache(fresh, "d1")
    assert files_of(fresh) == files_of(built)
    assert not list(fresh.parent.glob("*.tmp"))  # published by one rename

    to_machine_cache(built, "d2")  # the code changed: the new build replaces the old entry
    assert sorted(p.name for p in machine_cache().iterdir()) == ["tiny-abc-d2"]


def test_a_built_policy_is_left_as_it_is_and_the_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kept = built_policy(tmp_path / "kept" / "models")
    to_machine_cache(kept, "d1")
    own = built_policy(tmp_path / "own" / "models")
    (own / "config.json").write_text('{"n": 2}')
    assert from_machine_cache(own, "d1") and (own / "config.json").read_text() == '{"n": 2}'

    monkeypatch.setenv("FACTORY_POLICY_CACHE", "0")
    assert machine_cache() is None
    assert not from_machine_cache(tmp_path / "off" / "models" / "tiny-abc", "d1")


def test_the_build_digest_is_stable_and_names_the_code_that_builds():
    digest = build_digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert build_digest() == digest
