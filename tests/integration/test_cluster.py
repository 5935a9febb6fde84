"""The local Ray cluster stays on loopback (tests and runs may only use 127.0.0.0/8)."""

from __future__ import annotations

import ipaddress

import psutil


def ray_listening_addresses() -> set[str]:
    """Addresses that Ray's own processes (raylet, GCS, workers, agents) listen on."""
    addrs = set()
    for conn in psutil.net_connections(kind="inet"):
        if conn.status != psutil.CONN_LISTEN or conn.pid is None:
            continue
        try:
            cmd = " ".join(psutil.Process(conn.pid).cmdline())
        except psutil.Error:
            continue
        if "ray" in cmd and "vllm" not in cmd:
            addrs.add(conn.laddr.ip)
    return addrs


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)  # gRPC listens on ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def test_local_ray_binds_to_loopback_only(ray_cluster):
    import ray

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    addrs = ray_listening_addresses()
    assert addrs, "no Ray process is listening: the check would pass vacuously"
    wild_or_external = {a for a in addrs if not is_loopback(a)}
    assert not wild_or_external, f"Ray listens beyond loopback on {sorted(wild_or_external)}"
