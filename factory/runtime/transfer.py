"""Moving directories (models, checkpoints, adapters) between the roles of a run over the network.

A node of a Ray cluster owns none of another node's disk, so nothing that one role writes is a path
another role may read. A `DirBundle` is a directory's files as bytes: the sender packs it, Ray's
object store carries it (`ray.put`, or an actor method's return value passed on as an ObjectRef,
which the receiving node pulls straight from the sender's), and the receiver writes it to a
directory of its own node. On one machine this costs a copy; on a cluster it is what makes the run
work at all. Bundles are held in memory whole: right for models up to a few GB; beyond that, a
filesystem every node mounts is the better road (and the paths then exist everywhere).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from factory.paths import cache_dir


def node_ip() -> str:
    """This process's node address as Ray knows it (127.0.0.1 for the local default)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


@dataclass
class DirBundle:
    name: str  # what it is, for directory names and messages: "policy", "step-000004"
    files: dict[str, bytes]  # relative path -> content
    digest: str = field(default="")

    def __post_init__(self):
        if not self.digest:
            h = hashlib.sha256()
            for rel in sorted(self.files):
                h.update(rel.encode() + b"\0" + hashlib.sha256(self.files[rel]).digest())
            self.digest = h.hexdigest()

    @classmethod
    def of(cls, path: str | Path, name: str | None = None, exclude: tuple[str, ...] = ()) -> DirBundle:
        """The files under `path`, except those whose relative path is in `exclude`."""
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: no such directory on this node ({node_ip()}); nothing to send")
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                 if p.is_file() and str(p.relative_to(root)) not in exclude}
        return cls(name or root.name, files)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())

    def write(self, dest: str | Path) -> Path:
        """The files under `dest` (replacing what was there), written beside it and renamed into place,
        so a reader never sees half a directory."""
        dest = Path(dest)
        tmp = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        for rel, data in self.files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        if dest.exists():
            old = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:8]}.old")
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, dest)
        return dest

    def materialize(self) -> Path:
        """This bundle as a directory of this node's cache, written once per content digest."""
        dest = cache_dir() / "shipped" / f"{self.name}-{self.digest[:16]}"
        if not dest.is_dir():
            self.write(dest)
        return dest


def local_dir(source: str | Path | DirBundle, what: str) -> str:
    """A directory on this node holding `source`: a bundle is written out; a path must exist here.

    The one-line error names the node, so a run on a cluster says plainly that a node lacks a file
    (instead of, say, transformers reading a missing path as a hub repo id)."""
    if isinstance(source, DirBundle):
        return str(source.materialize())
    path = Path(source)
    if not path.is_dir():
        raise FileNotFoundError(f"{what}: {path} is not on node {node_ip()}; ship it (runs send models, "
                                "checkpoints and adapters over the network) or put it on a filesystem every node mounts")
    return str(path)
