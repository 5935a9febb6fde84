"""Sandbox images: `sandboxes/<name>/spec.yaml` → a Debian rootfs (debootstrap) → a Docker image
(`docker import`, no registry needed). The same rootfs is the read-only root of the bubblewrap backend.

Standard library only (plus PyYAML, imported when a spec is read) and the docker CLI, so that
`.ci/sandbox-setup.sh` can build images before the project's venv exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

from factory.paths import REPO_ROOT, state_dir
from factory.sandbox.base import SANDBOX_ENV, SANDBOX_UID, WORKDIR, Limits, SandboxUnavailable

SPECS_DIR = REPO_ROOT / "sandboxes"
BUILDER_VERSION = "1"  # bump when the build steps below change what an image contains
LABEL = "factory.sandbox"


@dataclass(frozen=True)
class ImageSpec:
    """A sandbox image definition (one `sandboxes/<name>/spec.yaml`)."""

    name: str
    language: str
    description: str = ""
    suite: str = "bookworm"
    variant: str = "minbase"
    mirror: str = "http://deb.debian.org/debian"
    packages: tuple[str, ...] = ("python3",)
    command: tuple[str, ...] = ("python3", "main.py")
    limits: Limits = field(default_factory=Limits)
    digest: str = ""  # sha256 of the spec file and the builder version: an image is current iff it matches

    @property
    def tag(self) -> str:
        return docker_tag(self.name)


def docker_tag(name: str) -> str:
    return f"factory-sandbox-{name}:latest"


def available_specs() -> list[str]:
    return sorted(p.parent.name for p in SPECS_DIR.glob("*/spec.yaml"))


def load_spec(name: str) -> ImageSpec:
    """Read `sandboxes/<name>/spec.yaml`; a missing or malformed spec is a one-line error."""
    path = SPECS_DIR / name / "spec.yaml"
    if not path.is_file():
        raise SandboxUnavailable(f"no sandbox image named {name!r}: expected {path} "
                                 f"(have: {', '.join(available_specs()) or 'none'})")
    import yaml  # only here: the rest of this module runs on a bare system python

    raw_text = path.read_text()
    raw = yaml.safe_load(raw_text) or {}
    base = raw.get("base", {})
    try:
        return ImageSpec(
            name=raw.get("name", name), language=raw["language"], description=raw.get("description", ""),
            suite=base.get("suite", "bookworm"), variant=base.get("variant", "minbase"),
            mirror=os.environ.get("FACTORY_DEBIAN_MIRROR", base.get("mirror", "http://deb.debian.org/debian")),
            packages=tuple(raw.get("packages", ["python3"])), command=tuple(raw.get("command", ["python3", "main.py"])),
            limits=Limits(**raw.get("limits", {})),
            digest=hashlib.sha256((BUILDER_VERSION + raw_text).encode()).hexdigest(),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise SandboxUnavailable(f"{path}: invalid spec ({err})") from None


# -- rootfs ------------------------------------------------------------------------------------------
def image_dir(name: str) -> Path:
    return state_dir() / "sandboxes" / name


def rootfs_dir(name: str) -> Path:
    return image_dir(name) / "rootfs"


def built_rootfs(name: str) -> Path | None:
    """The rootfs of image `name` if it has been built (from any version of its spec), else None."""
    return rootfs_dir(name) if (image_dir(name) / "rootfs.json").is_file() else None


def _rootfs_record(name: str) -> dict:
    try:
        return json.loads((image_dir(name) / "rootfs.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _stderr_log(line: str) -> None:
    print(f"[sandbox build] {line}", file=sys.stderr, flush=True)


def build_rootfs(spec: ImageSpec, force: bool = False, log: Callable[[str], None] = _stderr_log) -> Path:
    """Debootstrap the spec's packages into `<state>/sandboxes/<name>/rootfs` (~1–2 min; needs root and
    a Debian mirror), trim docs and apt caches, add the /work mount point; or unpack the same rootfs
    from this machine's build cache (`build_cache`), which a debootstrap fills. Skips if already
    current; `force` debootstraps anew."""
    target = rootfs_dir(spec.name)
    if not force and _rootfs_record(spec.name).get("digest") == spec.digest and target.is_dir():
        return target
    if os.geteuid() != 0:
        raise SandboxUnavailable("building a sandbox rootfs needs root (debootstrap): run as root or in CI")
    scratch = target.with_name("rootfs.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cached = build_cache(spec)
    if not force and cached is not None and cached.is_file():
        scratch.mkdir()
        untar = subprocess.run(["tar", "-C", str(scratch), "--numeric-owner", "-xpf", str(cached)],
                               capture_output=True, text=True)
        if untar.returncode == 0:
            log(f"rootfs from the build cache ({cached}), not debootstrap")
            return _install_rootfs(spec, scratch, target, started, "cache", log)
        log(f"the build cache's {cached} did not unpack ({untar.stderr.strip()[:200]}); debootstrap instead")
        shutil.rmtree(scratch, ignore_errors=True)
        cached.unlink(missing_ok=True)
    debootstrap = shutil.which("debootstrap", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if debootstrap is None:
        raise SandboxUnavailable("debootstrap not found: apt-get install -y debootstrap")
    cmd = [debootstrap, f"--variant={spec.variant}", f"--include={','.join(spec.packages)}", spec.suite,
           str(scratch), spec.mirror]
    log(f"debootstrap {spec.suite} ({spec.variant}) + {', '.join(spec.packages)} from {spec.mirror}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    tail: list[str] = []
    phases: set[str] = set()
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        words = line.split()
        if len(words) >= 2 and words[0] == "I:" and words[1] not in phases:  # one line per phase, not per package
            phases.add(words[1])
            log(f"{time.monotonic() - started:5.1f}s {line.strip()[3:]}")
    if proc.wait() != 0:
        raise SandboxUnavailable(f"debootstrap failed (exit {proc.returncode}); last lines: " + " | ".join(tail[-5:]))
    _trim(scratch)
    (scratch / WORKDIR.lstrip("/")).mkdir(mode=0o755, exist_ok=True)
    if cached is not None:  # for the next clone on this machine (written beside, then renamed: never half a tar)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".partial-{os.getpid()}")
        if subprocess.run(["tar", "-C", str(scratch), "--numeric-owner", "-cf", str(partial), "."],
                          capture_output=True).returncode == 0:
            partial.rename(cached)
        else:
            partial.unlink(missing_ok=True)
    return _install_rootfs(spec, scratch, target, started, "debootstrap", log)


def build_cache(spec: ImageSpec) -> Path | None:
    """Where a built rootfs of `spec` is kept for other clones on this machine, as pip keeps wheels: the
    user's cache dir, keyed by the spec's digest (its file and the builder's version), so a changed spec
    is built anew. None when FACTORY_SANDBOX_CACHE=0. Why: debootstrap took 113 s of a fresh clone's
    set-up here (CI's critical path: the venv is ready sooner); unpacking the tar takes seconds."""
    if os.environ.get("FACTORY_SANDBOX_CACHE", "1") == "0":
        return None
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "factory" / "sandboxes"
    return root / f"{spec.name}-{spec.digest[:24]}.tar"


def _install_rootfs(spec: ImageSpec, scratch: Path, target: Path, started: float, source: str,
                    log: Callable[[str], None]) -> Path:
    shutil.rmtree(target, ignore_errors=True)
    scratch.rename(target)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file() and not f.is_symlink())
    record = {"digest": spec.digest, "built_at": time.time(), "bytes": size, "packages": list(spec.packages),
              "source": source}
    (image_dir(spec.name) / "rootfs.json").write_text(json.dumps(record))
    log(f"rootfs ready: {target} ({size / 2**20:.0f} MiB, {time.monotonic() - started:.0f}s, from {source})")
    return target


def _trim(root: Path) -> None:
    """Drop what a sandbox never reads: apt caches and lists, man pages, docs (keeping copyright), locales."""
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*",
                    "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*"):
        for path in root.glob(pattern):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for path in (root / "usr/share/doc").glob("*/*"):
        if path.name != "copyright":
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


# -- docker image ------------------------------------------------------------------------------------
def _docker_cli() -> str:
    docker = shutil.which("docker")
    if docker is None:
        raise SandboxUnavailable("docker CLI not found: apt-get install -y docker.io")
    return docker


def docker_ready() -> bool:
    """True if a docker CLI is installed and its engine answers."""
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        return subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def image_info(name: str) -> dict | None:
    """Id, content digest, size and spec digest of the Docker image for `name`, or None if absent."""
    result = subprocess.run([_docker_cli(), "image", "inspect", docker_tag(name)], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    data = json.loads(result.stdout)[0]
    layers = data.get("RootFS", {}).get("Layers") or [None]
    return {
        "name": name, "tag": docker_tag(name), "id": data["Id"],
        "digest": layers[0],  # sha256 of the imported rootfs tar: a content address for the image
        "size": data.get("Size"), "spec_digest": (data.get("Config", {}).get("Labels") or {}).get(f"{LABEL}.spec"),
    }


def import_image(spec: ImageSpec, rootfs: Path, log: Callable[[str], None] = _stderr_log) -> dict:
    """`docker import` the rootfs as `factory-sandbox-<name>:latest`, labelled with the spec digest."""
    changes = [f"ENV {k}={v}" for k, v in SANDBOX_ENV.items()] + [
        f"WORKDIR {WORKDIR}", f"USER {SANDBOX_UID}:{SANDBOX_UID}", 'CMD ["sleep", "infinity"]',
        f"LABEL {LABEL}.name={spec.name}", f"LABEL {LABEL}.spec={spec.digest}", f"LABEL {LABEL}.language={spec.language}",
    ]
    log(f"docker import {rootfs} -> {spec.tag}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", "-", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None  # stdout=PIPE
    args = [_docker_cli(), "import"] + [a for c in changes for a in ("--change", c)] + ["-", spec.tag]
    result = subprocess.run(args, stdin=tar.stdout, capture_output=True, text=True)
    tar.stdout.close()
    if tar.wait() != 0 or result.returncode != 0:
        raise SandboxUnavailable(f"docker import failed: {result.stderr.strip() or 'tar of the rootfs failed'}")
    info = image_info(spec.name)
    if info is None:
        raise SandboxUnavailable(f"docker import reported success but {spec.tag} is not there")
    return info


def build_image(name: str = "python", force: bool = False, docker: bool | None = None,
                log: Callable[[str], None] = _stderr_log) -> dict:
    """Build sandbox image `name`: its rootfs, then (if `docker`, default: when an engine answers) the
    Docker image. Idempotent: nothing is rebuilt while the spec is unchanged, unless `force`.

    Returns name, tag, id, digest (of the rootfs layer), size (bytes), rootfs, spec_digest, and
    rebuilt (whether anything was built now); id/digest/size are None when Docker was skipped."""
    spec = load_spec(name)
    before = _rootfs_record(name).get("built_at")
    rootfs = build_rootfs(spec, force=force, log=log)
    rebuilt = _rootfs_record(name).get("built_at") != before
    info: dict = {"name": name, "tag": spec.tag, "id": None, "digest": None, "size": None}
    if docker is None:
        docker = docker_ready()
    if docker:
        current = image_info(name)
        # a rootfs unpacked from the build cache is the one the image of the same spec was imported from
        # on this machine: that image stays
        fresh = rebuilt and not (_rootfs_record(name).get("source") == "cache" and current is not None)
        if force or fresh or current is None or current["spec_digest"] != spec.digest:
            current = import_image(spec, rootfs, log=log)
            rebuilt = True
        info.update(current)
    info.update(rootfs=str(rootfs), spec_digest=spec.digest, rebuilt=rebuilt)
    return info
