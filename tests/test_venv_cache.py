"""The venv cache of the set-up (infra/uv.sh): a venv kept in the user's cache dir is made into a clone's
venv by hard links, its scripts' #! lines and pyvenv.cfg naming the new path (the cache's files untouched);
a failed restore is undone without touching what others put beside the venv; FACTORY_VENV_CACHE=0 and an
existing venv are left alone. Shell functions, run by bash as the set-up runs them, on a small real venv."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sh(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source infra/uv.sh; {script}"], cwd=REPO,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env},
                          capture_output=True, text=True, timeout=120)


def small_venv(path: Path) -> None:
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    script = path / "bin" / "hello"
    script.write_text(f"#!{path}/bin/python\nimport sys\nprint(sys.prefix)\n")
    script.chmod(0o755)
    (path / "lib" / "module.py").write_text("X = 1\n")
    (path / "s3rver").mkdir()  # put beside the venv's parts by another installer
    (path / ".factory-installed").write_text("stamp\n")


def test_a_saved_venv_is_restored_by_links_at_another_path_and_the_cache_stays_as_it_was(tmp_path):
    first, second = tmp_path / "a" / "venv", tmp_path / "b" / "venv"
    small_venv(first)
    (tmp_path / "spec.txt").write_text("torch==2.13.0\n")
    entry = sh(f"venv_cache_entry test {tmp_path / 'spec.txt'}", tmp_path).stdout.strip()
    assert entry.startswith(str(tmp_path / "cache" / "factory" / "venvs" / "test-"))
    done = sh(f"venv_save {entry} {first} s3rver", tmp_path)
    assert done.returncode == 0, done.stderr
    kept = Path(entry)
    assert (kept / "origin").read_text().strip() == str(first)
    assert not (kept / "venv" / "s3rver").exists() and not (kept / "venv" / ".factory-installed").exists()

    (second / "s3rver").mkdir(parents=True)  # the system part may have begun beside it
    done = sh(f"venv_restore {entry} {second}", tmp_path)
    assert done.returncode == 0, done.stderr
    ran = subprocess.run([str(second / "bin" / "hello")], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.strip() == str(second), ran.stderr
    assert str(second) in (second / "pyvenv.cfg").read_text() and str(first) not in (second / "pyvenv.cfg").read_text()
    assert (kept / "venv" / "bin" / "hello").read_text().startswith(f"#!{first}/bin/python")  # the cache's own
    assert (second / "lib" / "module.py").stat().st_ino == (kept / "venv" / "lib" / "module.py").stat().st_ino

    # a venv already there is not replaced; the cache can be turned off
    assert sh(f"venv_restore {entry} {second}", tmp_path).returncode == 1
    assert sh(f"venv_restore {entry} {tmp_path / 'c' / 'venv'}", tmp_path, FACTORY_VENV_CACHE="0").returncode == 1
    assert not (tmp_path / "c").exists()

    # undoing a restore removes what came from the entry, and the entry; not what others put there
    assert sh(f"venv_drop {entry} {second}", tmp_path).returncode == 0
    assert not (second / "bin").exists() and not (second / "lib").exists() and (second / "s3rver").is_dir()
    assert not kept.exists()
    ran = subprocess.run([str(first / "bin" / "hello")], capture_output=True, text=True, timeout=60)
    assert ran.stdout.strip() == str(first)  # the venv it was saved from works as before


def test_a_new_entry_of_a_venv_replaces_the_older_one(tmp_path):
    venv = tmp_path / "venv"
    small_venv(venv)
    spec = tmp_path / "spec.txt"
    spec.write_text("one\n")
    old = sh(f"venv_cache_entry test {spec}", tmp_path).stdout.strip()
    assert sh(f"venv_save {old} {venv}", tmp_path).returncode == 0 and Path(old, "origin").is_file()
    spec.write_text("two\n")
    new = sh(f"venv_cache_entry test {spec}", tmp_path).stdout.strip()
    assert new != old
    assert sh(f"venv_save {new} {venv}", tmp_path).returncode == 0
    assert [p.name for p in (tmp_path / "cache" / "factory" / "venvs").iterdir()] == [Path(new).name]
    missing = sh(f"venv_cache_entry test {tmp_path / 'gone.txt'}", tmp_path)  # no key from what is not there
    assert missing.returncode != 0 and "no file" in missing.stderr and not missing.stdout.strip()
