"""What every Ray actor of the run shares: its placement (`placed`), where it runs (`Placed`), its logs."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from factory.paths import cache_dir
from factory.runtime.transfer import node_ip


def placed(actor_class, resources: dict[str, float] | None = None, **options):
    """`actor_class.options(...)` asking for `resources` (the recipe's `placement.<role>`): CPU and GPU
    become num_cpus / num_gpus, every other name a custom Ray resource (or `node:<ip>`)."""
    resources = dict(resources or {})
    if "CPU" in resources:
        options["num_cpus"] = resources.pop("CPU")
    if "GPU" in resources:
        options["num_gpus"] = resources.pop("GPU")
    if resources:
        options["resources"] = resources
    return actor_class.options(**options) if options else actor_class



class Placed:
    """What every actor tells about where it runs."""

    def node_ip(self) -> str:
        return node_ip()

    def pid(self) -> int:
        return os.getpid()


def stderr_logger(name: str) -> logging.Logger:
    """A logger writing to this process's stderr, which Ray forwards to the driver's terminal."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)
    return logger


def node_log_path(path: str | None) -> Path | None:
    """The log file asked for, or one in this node's cache when its directory is not on this node."""
    if path is None:
        return None
    p = Path(path)
    return p if p.parent.is_dir() else cache_dir() / "logs" / p.name
