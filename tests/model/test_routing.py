"""Routing replay on a tiny random Qwen3-MoE in transformers: recorded experts are what the forward uses,
the router keeps its gradient, and the metrics measure what they say."""

from __future__ import annotations

import pytest
import torch

from factory.core.types import Sample
from factory.model.logprobs import completion_logprobs, pad_samples
from factory.model.routing import UNKNOWN, RoutingReplay, load_balancing_loss, moe_routers, routing_tensor

LAYERS, EXPERTS, K = 2, 8, 2


@pytest.fixture(scope="module")
def moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=EXPERTS, num_experts_per_tok=K, norm_topk_prob=True, pad_token_id=0)
    model = Qwen3MoeForCausalLM(config).float()
    for router in moe_routers(model):  # a sharper router than the init's, so a swapped expert shows
        torch.nn.init.normal_(router.weight, std=1.0)
    return model


def samples(n: int = 3, seed: int = 1) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, t = 4 + i, 6 + 2 * i
        ids = torch.randint(1, 64, (p + t,), generator=g).tolist()
        out.append(Sample(sample_id=f"s{i}", group_id="g", task_id="t", prompt_ids=ids[:p], completion_ids=ids[p:],
                          logprobs=[0.0] * t, loss_mask=[1] * t, versions=[0] * t))
    return out


def own_routing(model, batch: list[Sample]) -> list[list[list[list[int]]]]:
    """Per sample, per completion token, the experts the model's own router picks at the producing position."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [r.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[2])) for i, r in enumerate(moe_routers(model))]
    tensors = pad_samples(batch, 0)
    with torch.no_grad():
        model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"])
    for h in hooks:
        h.remove()
    width = tensors["input_ids"].shape[1]
    out = []
    for b, s in enumerate(batch):
        p = len(s.prompt_ids)
        out.append([[seen[layer][b * width + p + j - 1].tolist() for layer in range(LAYERS)]
                    for j in range(len(s.completion_ids))])
    return out


def logprobs(model, batch, replay: RoutingReplay | None, use_routing: bool = True) -> torch.Tensor:
    tensors = pad_samples(batch, 0)
    if replay is not None:
        replay.set(tensors.get("routing") if use_routing else None, tensors["attention_mask"])
    return completion_logprobs(model, tensors)


def test_the_routing_tensor_puts_each_tokens_experts_at_the_position_that_produced_it():
    s = samples(1)[0]
    s.routed_experts = [[[j, j + 1], [7, 6]] for j in range(len(s.completion_ids))]
    s.routed_experts[2] = []  # a token the engine did not sample
    t = routing_tensor([s], 20)
    p = len(s.prompt_ids)
    assert t.shape == (1, 20, LAYERS, K)
    assert t[0, p - 1].tolist() == [[0, 1], [7, 6]] and t[0, p + 2].tolist() == [[3, 4], [7, 6]]
    assert (t[0, p + 1] == UNKNOWN).all() and (t[0, : p - 1] == UNKNOWN).all()
    assert routing_tensor(samples(2), 20) is None
    s.routed_experts[1] = [[1, 2]]
    with pytest.raises(ValueError, match="token 1's routing is not 2 layers x 2 experts"):
        routing_tensor([s], 20)


def test_replaying_the_routers_own_choice_changes_nothing_and_another_choice_changes_the_logprobs(moe):
    batch = samples()
    plain = logprobs(moe, batch, None)
    replay = RoutingReplay.install(moe)
    try:
        for s, r in zip(batch, own_routing(moe, batch)):
            s.routed_experts = r
        same = logprobs(moe, batch, replay)
        assert torch.allclose(same, plain, atol=1e-6)
        assert replay.metrics()["train/router_agreement"] == 1.0
        for s in batch:  # every sampled token routed through two other experts in every layer
            s.routed_experts = [[[(e + 3) % EXPERTS for e in layer] for layer in tok] for tok in s.routed_experts]
        moved = logprobs(moe, batch, replay)
        assert replay.metrics()["train/router_agreement"] < 0.2
        assert (moved - plain).abs().max() > 1e-2
        # the same recorded routes without replay: the trainer's router again (measures only)
        replay.replay = False
        assert torch.allclose(logprobs(moe, batch, replay), plain, atol=1e-6)
    finally:
        replay.remove()


def test_packed_rows_replay_the_recorded_routes_as_the_padded_batch_does(moe):
    """Routing is position-aligned with input_ids: packed the same way, a packed row replays the very
    experts the padded batch replays (routes moved away from the router's own, so a misaligned one shows)."""
    from factory.model.logprobs import pack_tensors, packing_unsupported

    assert packing_unsupported(moe) is None
    batch = samples()
    for s, r in zip(batch, own_routing(moe, batch)):
        s.routed_experts = [[[(e + 3) % EXPERTS for e in layer] for layer in tok] for tok in r]
    replay = RoutingReplay.install(moe)
    try:
        padded = pad_samples(batch, 0)
        packed = pack_tensors(padded)
        assert packed["routing"].shape == (1, int(padded["attention_mask"].sum()), LAYERS, K)
        replay.set(padded["routing"], padded["attention_mask"])
        want = completion_logprobs(moe, padded)
        agreement = replay.metrics()["train/router_agreement"]
        replay.set(packed["routing"], packed["attention_mask"])
        got = completion_logprobs(moe, packed)
        assert replay.metrics()["train/router_agreement"] == agreement
        # several rows (train.packing: auto on sdpa), two samples in one and padding after the other: the
        # same experts replayed
        in_rows = pack_tensors(padded, [[0, 1], [2]])
        assert in_rows["input_ids"].shape == (2, 23) and in_rows["routing"].shape[:2] == (2, 23)
        replay.set(in_rows["routing"], in_rows["attention_mask"])
        got_rows = completion_logprobs(moe, in_rows)
        assert replay.metrics()["train/router_agreement"] == agreement
    finally:
        replay.remove()
    own = completion_logprobs(moe, pack_tensors(pad_samples(samples(), 0)))  # no hooks: the router's own routes
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.allclose(got_rows, want, atol=1e-5), (got_rows - want).abs().max()
    assert (own - want).abs().max() > 1e-2


def test_replayed_routes_keep_the_routers_gradient_and_survive_activation_checkpointing(moe):
    batch = samples()
    for s, r in zip(batch, own_routing(moe, batch)):
        s.routed_experts = [[[(e + 1) % EXPERTS for e in layer] for layer in tok] for tok in r]
    replay = RoutingReplay.install(moe)
    grads = []
    try:
        for checkpointing in (False, True):
            moe.zero_grad()
            if checkpointing:
                moe.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            moe.train()
            logprobs(moe, batch, replay).sum().backward()
            grads.append([r.weight.grad.clone() for r in moe_routers(moe)])
    finally:
        moe.gradient_checkpointing_disable()
        moe.eval()
        replay.remove()
    assert all(g.abs().sum() > 0 for g in grads[0])
    # the recomputed forward in the backward routes as the first did: the same gradients
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_expert_load_and_the_balancing_loss_measure_how_tokens_spread():
    even = torch.arange(EXPERTS).repeat(4)[:, None]
    probs = torch.full((even.shape[0], EXPERTS), 1.0 / EXPERTS)
    assert load_balancing_loss(probs, even, EXPERTS) == pytest.approx(1.0)
    piled = torch.zeros_like(even)
    peaked = torch.zeros_like(probs)
    peaked[:, 0] = 1.0
    assert load_balancing_loss(peaked, piled, EXPERTS) == pytest.approx(EXPERTS)


def test_the_metrics_report_load_and_the_aux_loss_over_real_tokens_only(moe):
    batch = samples()
    replay = RoutingReplay.install(moe, aux_loss=True)
    try:
        logprobs(moe, batch, replay)
        m = replay.metrics()
        assert "train/router_agreement" not in m  # nothing recorded, nothing compared
        assert 0 < m["train/expert_load"] <= 1 and m["train/expert_load_max"] >= 1
        real = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch)
        assert all(int(st.load.sum()) == real * K for st in replay.stats.values())
        aux = replay.aux()
        assert aux is not None and aux.requires_grad and float(aux.detach()) >= 1.0 - 1e-6
    finally:
        replay.remove()
