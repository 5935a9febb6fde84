"""DirBundle: a directory's bytes, written whole or not at all on the receiving node."""

from __future__ import annotations

import pytest

from factory.runtime.transfer import DirBundle, local_dir


def make_dir(root, files):
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_a_bundle_round_trips_a_directory_and_names_its_content(tmp_path):
    src = make_dir(tmp_path / "model", {"config.json": b"{}", "w/a.bin": b"\x00" * 10, "trainer.pt": b"opt"})
    bundle = DirBundle.of(src, exclude=("trainer.pt",))
    assert set(bundle.files) == {"config.json", "w/a.bin"} and bundle.nbytes == 12
    out = bundle.write(tmp_path / "copy")
    assert (out / "w" / "a.bin").read_bytes() == b"\x00" * 10 and not (out / "trainer.pt").exists()
    same = DirBundle.of(out)
    assert same.digest == bundle.digest
    (out / "config.json").write_bytes(b"{ }")
    assert DirBundle.of(out).digest != bundle.digest


def test_writing_over_a_directory_replaces_it_whole(tmp_path):
    dest = make_dir(tmp_path / "dest", {"old.bin": b"1", "config.json": b"old"})
    DirBundle("x", {"config.json": b"new"}).write(dest)
    assert sorted(p.name for p in dest.iterdir()) == ["config.json"]
    assert (dest / "config.json").read_bytes() == b"new"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".old"))]


def test_materialize_writes_once_per_content_under_the_nodes_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    bundle = DirBundle("policy", {"config.json": b"{}"})
    first = bundle.materialize()
    assert first.parent == tmp_path / "home" / "cache" / "shipped" and first.name.startswith("policy-")
    (first / "marker").write_bytes(b"")  # a second materialize must not rewrite it
    assert bundle.materialize() == first and (first / "marker").exists()


def test_a_path_missing_on_this_node_is_a_plain_one_line_error(tmp_path):
    with pytest.raises(FileNotFoundError) as caught:
        local_dir(str(tmp_path / "nope"), "rollout engine model")
    message = str(caught.value)
    assert message.startswith(f"rollout engine model: {tmp_path / 'nope'} is not on node ") and "\n" not in message
    with pytest.raises(FileNotFoundError, match="no such directory on this node"):
        DirBundle.of(tmp_path / "nope")
