"""A local Ray bound to loopback, or an existing cluster: RAY_ADDRESS, or the production profile's."""

from __future__ import annotations

import contextlib
import logging
import os


@contextlib.contextmanager
def local_ray(num_cpus: int = 8):
    """Start (and afterwards stop) Ray for one run, unless this process has it running already; yields
    whether it started it. Logical CPUs only gate actor placement."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # inherited by raylet, GCS and workers
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # Ray runs workers at nice 15, where any other busy process starves the engines and trainer
    os.environ.setdefault("RAY_worker_niceness", "0")
    started = False
    if not ray.is_initialized():
        from factory.support import profile

        address = profile.ray_address()
        # Ray reads that variable once, at `import ray` (usually before this runs): without this,
        # it binds to the machine's address instead of loopback, and turns a
        # cluster address of 127.0.0.1 into the machine's address, where nothing listens
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = bool(address and not is_loopback(address))
        if address:  # a cluster someone started (`ray start` on each node; infra/cluster/, infra/stack.py)
            check_reachable(address)
            ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING,
                     runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
        else:
            ray.init(
                address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                log_to_driver=True, configure_logging=True, logging_level=logging.WARNING,
                runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
            )
        started = True
    try:
        yield started
    finally:
        if started:
            ray.shutdown()


class ClusterUnreachable(RuntimeError):
    """No Ray cluster answers at the configured address (a user error, one line)."""


def is_loopback(address: str) -> bool:
    import ipaddress

    host = address.removeprefix("ray://").rpartition(":")[0] or address
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds, naming the address, where `ray.init` would retry for minutes without a word."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as error:
        raise ClusterUnreachable(f"RAY_ADDRESS={address}: no Ray cluster answers there ({error}); start one "
                                 f"(`ray start --head`, infra/stack.py) or unset RAY_ADDRESS for a local Ray") from None


class PlacementError(RuntimeError):
    """The recipe's placement cannot be satisfied by this Ray cluster (a user error, one line)."""


def check_placement(placement, engines: int, env_workers: int, scorer: bool, trainer_ranks: int = 1) -> None:
    """Fail at once, naming the field, when the recipe's placement asks for more of a resource than the
    Ray cluster has in all: Ray would otherwise keep the actor pending forever (a silent hang)."""
    import ray

    wanted: dict[str, list[tuple[str, float]]] = {}
    counts = {"trainer": trainer_ranks, "buffer": 1, "engine": engines, "env_worker": env_workers, "scorer": int(scorer)}
    for role, n in counts.items():
        for name, amount in getattr(placement, role).items():
            wanted.setdefault(name, []).append((role, amount * n))
    have = ray.cluster_resources()
    for name, asks in wanted.items():
        total = sum(a for _, a in asks)
        if total > have.get(name, 0.0) + 1e-9:
            roles = ", ".join(f"placement.{role} ({a:g})" for role, a in asks if a)
            nodes = sorted({k for k in have if k.startswith("node:") and k != "node:__internal_head__"})
            raise PlacementError(f"{roles}: ask for {total:g} of Ray resource {name!r} in all, but the cluster offers "
                               f"{have.get(name, 0.0):g} (nodes {', '.join(n[5:] for n in nodes)}); start a node "
                               f"with `ray start --resources '{{\"{name}\": N}}'` or change the recipe")
