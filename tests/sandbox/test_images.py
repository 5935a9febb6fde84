"""The sandbox rootfs's build cache (factory/sandbox/images.py): a clone on a machine that built the same
spec before unpacks that rootfs instead of running debootstrap, owners and modes kept; a cache file that
does not unpack is dropped and the build goes on without it. (A real debootstrap runs in the set-up,
`.ci/sandbox-setup.sh`, and fills the cache.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from factory.sandbox import SandboxUnavailable
from factory.sandbox import images
from factory.sandbox.images import build_cache, build_rootfs, load_spec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="building a rootfs needs root (as CI runs)")


@pytest.fixture
def homes(tmp_path, monkeypatch):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_a_cached_rootfs_is_unpacked_instead_of_debootstrapped_with_owners_and_modes(homes):
    spec = load_spec("python")
    tree = homes / "tree"
    (tree / "usr/bin").mkdir(parents=True)
    marker = tree / "usr/bin/made-by-this-test"
    marker.write_text("not from debootstrap")
    os.chown(marker, 1234, 1234)
    marker.chmod(0o751)
    cached = build_cache(spec)
    assert cached is not None and spec.digest[:24] in cached.name
    cached.parent.mkdir(parents=True)
    subprocess.run(["tar", "-C", str(tree), "--numeric-owner", "-cf", str(cached), "."], check=True)

    said: list[str] = []
    root = build_rootfs(spec, log=said.append)
    assert root.is_relative_to(homes / "state")  # this test's state dir, not the session's
    got = root / "usr/bin/made-by-this-test"
    assert got.read_text() == "not from debootstrap"
    assert (got.stat().st_uid, got.stat().st_mode & 0o777) == (1234, 0o751)
    assert any("from the build cache" in line for line in said) and not any("debootstrap bookworm" in line for line in said)
    assert json.loads((root.parent / "rootfs.json").read_text())["source"] == "cache"
    assert build_rootfs(spec, log=said.append) == root  # current now: nothing more is done
    assert build_cache(spec).is_file()


def test_a_cache_file_that_does_not_unpack_is_dropped_and_the_build_goes_on_without_it(homes, monkeypatch):
    spec = load_spec("python")
    cached = build_cache(spec)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not a tar")
    real_which = shutil.which
    monkeypatch.setattr(images.shutil, "which", lambda cmd, **kw: None if cmd == "debootstrap" else real_which(cmd, **kw))
    said: list[str] = []
    with pytest.raises(SandboxUnavailable, match="debootstrap not found"):  # where the build went on to
        build_rootfs(spec, log=said.append)
    assert not cached.exists() and any("did not unpack" in line for line in said)


def test_the_cache_is_off_with_factory_sandbox_cache_0(homes, monkeypatch):
    monkeypatch.setenv("FACTORY_SANDBOX_CACHE", "0")
    assert build_cache(load_spec("python")) is None
