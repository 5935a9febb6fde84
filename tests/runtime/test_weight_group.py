"""The weight-sync group without Ray or vLLM: rendezvous on one address only, gloo through the same
code path the NCCL one takes (bucketed, on the backend's device)."""

from __future__ import annotations

import threading

import psutil
import pytest
import torch

from factory.model.weightsync import BucketPlan, WeightBroadcaster, WeightReceiver, sync_device


def test_the_rendezvous_listens_on_the_given_address_only_and_buckets_arrive_intact():
    plan = BucketPlan.for_state([("a", [64, 64]), ("b", [100]), ("c", [3, 5])], "float32", 64 * 64 * 4)
    assert len(plan.buckets) == 2  # a fills one bucket; b and c share the next
    weights = {"a": torch.randn(64, 64), "b": torch.arange(100.0), "c": torch.ones(3, 5)}
    sender = WeightBroadcaster("127.0.0.1", 3)
    got: dict[int, dict] = {}

    def receive(rank):
        r = WeightReceiver("127.0.0.1", sender.port, rank, 3, plan.to_json())
        got[rank] = dict(r.receive())

    threads = [threading.Thread(target=receive, args=(rank,)) for rank in (1, 2)]
    for t in threads:
        t.start()
    sender.connect()
    listens = [c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert any(a.port == sender.port for a in listens)
    # a self-bound TCPStore would listen on * (gloo's own pairs may show as ::ffff:127.0.0.1)
    assert all(a.ip in ("127.0.0.1", "::ffff:127.0.0.1") for a in listens), listens
    sent = sender.broadcast(plan, weights)
    for t in threads:
        t.join(timeout=60)
    assert sent == plan.total_bytes
    for rank in (1, 2):
        assert set(got[rank]) == set(weights)
        for name, tensor in weights.items():
            assert torch.equal(got[rank][name], tensor), name


def test_backends_pick_their_device_and_an_unknown_backend_is_refused():
    assert sync_device("gloo") == "cpu" and sync_device("nccl") == "cuda"
    with pytest.raises(ValueError, match="rollout.sync_backend: unknown 'mpi'"):
        from factory.model.weightsync import make_weight_group

        make_weight_group("127.0.0.1", 1, 0, 1, backend="mpi", store=object())
