"""The lean step: chunked completion logprobs equal the full-logits formula (values and gradients),
micro-batches add up to the whole batch's update for every aggregation, the plan balances ranks and
groups similar lengths, and LoRA merges stream to what PEFT's merge gives."""

from __future__ import annotations

import pytest
import torch

from factory.algo.losses import AGGREGATIONS
from factory.training.parallel import (
    padding_share,
    plan_micro_batches,
    plan_packed_rows,
    plan_row_packs,
    row_layout,
    step_metrics_merge,
)
from factory.recipe import recipe_from_dict
from factory.core.types import Batch, Group, Sample, Task

from .conftest import tiny_model_dir

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, "tiny2",
                          hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=128)


def trainer_for(model_path, *overrides):
    from factory.training.trainer import Trainer

    recipe = recipe_from_dict({}, overrides=["rollout.max_new_tokens=12", "train.lr=1e-2", *overrides])
    return Trainer(model_path, recipe.algorithm, recipe.train, recipe.rollout)


def ragged_batch(seed: int = 0, n: int = 8) -> Batch:
    """Groups of two samples of mixed prompt and completion lengths, a masked (tool) token, stale
    behaviour logprobs, rewards 0/1."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        t = int(torch.randint(2, 12, (1,), generator=g))
        p = int(torch.randint(3, 9, (1,), generator=g))
        mask = [1] * t
        if t > 3:
            mask[1] = 0
        samples.append(Sample(f"s{i}", f"g{i // 2}", "t", prompt_ids=torch.randint(5, 60, (p,), generator=g).tolist(),
                              completion_ids=torch.randint(5, 60, (t,), generator=g).tolist(),
                              logprobs=(-torch.rand(t, generator=g) * 4).tolist(), loss_mask=mask, versions=[0] * t,
                              reward=float(i % 2)))
    return Batch(0, [Group(f"g{j}", Task("t", "f", "q", "a"), samples[2 * j: 2 * j + 2]) for j in range(n // 2)])


def naive_logprobs(model, tensors, temperature=1.0):
    """The formula written out over full [B, L, V] logits (what the lean path must equal)."""
    logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits.float() / temperature
    out = torch.zeros(tensors["input_ids"].shape[0], tensors["t_max"])
    for i in range(out.shape[0]):
        p, n = int(tensors["prompt_lens"][i]), int(tensors["completion_lens"][i])
        for j in range(n):
            row = logits[i, p + j - 1]
            out[i, j] = row[tensors["input_ids"][i, p + j]] - torch.logsumexp(row, 0)
    return out


def test_chunked_logprobs_and_gradients_equal_the_full_logits_formula(model_path):
    from factory.model.logprobs import completion_logprobs, pad_samples

    trainer = trainer_for(model_path)
    tensors = pad_samples(ragged_batch().samples, 0)
    model = trainer.model
    lean = completion_logprobs(model, tensors, 0.7, chunk_tokens=5)  # several chunks, checkpointed
    lean.sum().backward()
    lean_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    naive = naive_logprobs(model, tensors, 0.7)
    naive.sum().backward()
    assert torch.allclose(lean, naive, atol=1e-5), (lean - naive).abs().max()
    for a, b in zip(lean_grads, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    beyond = torch.arange(tensors["t_max"])[None, :] >= tensors["completion_lens"][:, None]
    assert (lean[beyond] == 0).all()  # nothing past a completion's end


def grads_after_step(trainer, batch) -> list[torch.Tensor]:
    trainer.train_step(batch)
    return [p.grad.clone() for p in trainer.model.parameters()]


ICEPOP_KL = ["algorithm.proximal=current", "algorithm.corrections=[{name: icepop, low: 0.5, high: 2.0}]",
             "algorithm.kl_coef=0.1"]


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("extra", [[], ICEPOP_KL], ids=["plain", "icepop+kl"])
def test_micro_batches_give_the_whole_batch_update(model_path, aggregation, extra):
    """Token budget 40 splits the batch into several micro-batches; the accumulated gradient equals
    the whole batch's (before clipping, which scales both alike), for every registered aggregation,
    also when a correction drops tokens by the current policy's ratio."""
    over = [f"algorithm.aggregation={aggregation}", "train.grad_clip=1e9", "train.packing=false", *extra]
    whole = trainer_for(model_path, *over, "train.micro_batch_tokens=0")
    micro = trainer_for(model_path, *over, "train.micro_batch_tokens=40")
    batch = ragged_batch(1)
    a, b = grads_after_step(whole, batch), grads_after_step(micro, batch)
    out = micro.train_step(ragged_batch(2))
    assert out["train/micro_batches"] > 2
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-4), (x - y).abs().max()


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("extra", [[], ICEPOP_KL], ids=["plain", "icepop+kl"])
@pytest.mark.parametrize("packing", ["true", "auto"], ids=["one-row", "rows"])
def test_packed_rows_give_the_unpacked_update(model_path, aggregation, extra, packing):
    """Packed micro-batches of at most 40 tokens give the gradient, loss and kept tokens of the unpacked
    whole batch, for every aggregation, also with a correction that drops tokens by the current policy's
    ratio and KL to a reference: one packed row each (`true`: several micro-batches, several samples
    each, positions restarting per sample), or on sdpa at `auto` several rows each, as wide as the
    micro-batch's longest sample, with what padding the rows leave."""
    over = [f"algorithm.aggregation={aggregation}", "train.grad_clip=1e9", *extra]
    whole = trainer_for(model_path, *over, "train.micro_batch_tokens=0", "train.packing=false")
    packed = trainer_for(model_path, *over, "train.micro_batch_tokens=40", f"train.packing={packing}")
    assert packed.packing == (True if packing == "true" else "rows") and not whole.packing
    batch = ragged_batch(1)
    out_w, out_p = whole.train_step(batch), packed.train_step(batch)
    a = [p.grad.clone() for p in whole.model.parameters()]
    b = [p.grad.clone() for p in packed.model.parameters()]
    assert out_p["train/micro_batches"] > 1
    if packing == "true":
        assert out_p["train/micro_batches"] < sum(1 for _ in batch.samples)  # of several samples each
        assert out_p["train/padding_share"] == 0.0 < out_w["train/padding_share"]
    else:
        assert out_p["train/padding_share"] < out_w["train/padding_share"]
    assert out_p["train/loss"] == pytest.approx(out_w["train/loss"], abs=1e-6)
    assert out_p["train/tokens"] == out_w["train/tokens"]
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-4), (x - y).abs().max()


def test_packed_lora_step_gives_the_unpacked_update(model_path):
    over = ["train.lora.enabled=true", "train.lora.rank=4", "rollout.weight_sync=lora", "train.grad_clip=1e9"]
    grads = []
    for packing in ("false", "true"):
        trainer = trainer_for(model_path, *over, "train.micro_batch_tokens=40", f"train.packing={packing}")
        with torch.no_grad():  # B starts at zero: give it values so the adapter's path carries gradient to A
            torch.manual_seed(0)
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
        trainer.train_step(ragged_batch(6))
        grads.append([p.grad.clone() for p in trainer.model.parameters() if p.requires_grad])
    assert any(g.abs().sum() > 0 for g in grads[0])
    for x, y in zip(*grads):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-4), (x - y).abs().max()


def test_packed_logprobs_equal_the_padded_ones_and_the_probe_refuses_a_model_that_ignores_positions(model_path):
    from factory.model.logprobs import completion_logprobs, pack_tensors, packing_unsupported, pad_samples

    trainer = trainer_for(model_path, "train.packing=true")
    assert trainer.packing and trainer.settings()["packing"] is True  # asked for: the tiny Llama (sdpa) packs
    # auto: not into one row on sdpa, whose dense [row, row] mask costs row^2, but into rows; and it says so
    auto = trainer_for(model_path)
    assert auto.packing == "rows" and "dense [row, row] mask" in auto.settings()["packing_why"]
    samples = ragged_batch().samples
    tensors = pad_samples(samples, 0)
    packed = pack_tensors(tensors)
    assert packed["input_ids"].shape == (1, int(tensors["attention_mask"].sum()))
    assert packed["position_ids"][0, : int(tensors["attention_mask"][0].sum()) + 1].tolist()[-1] == 0  # restarts
    lean = completion_logprobs(trainer.model, tensors, 0.7, chunk_tokens=5)
    assert torch.allclose(completion_logprobs(trainer.model, packed, 0.7, chunk_tokens=5), lean, atol=1e-5)
    # rows as wide as the longest sample, several samples in some, padding (positions restarting) after
    lengths = [int(n) for n in tensors["attention_mask"].sum(1)]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    longest_first = {k: v[order] if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    rows = row_layout([lengths[i] for i in order])
    assert len(rows) < len(lengths) and max(len(r) for r in rows) > 1
    in_rows = pack_tensors(longest_first, rows)
    assert in_rows["input_ids"].shape == (len(rows), max(lengths))
    assert int(in_rows["attention_mask"].sum()) == sum(lengths)
    assert torch.allclose(completion_logprobs(trainer.model, in_rows, 0.7, chunk_tokens=5), lean[order], atol=1e-5)
    assert packing_unsupported(trainer.model) is None

    class Blind(torch.nn.Module):
        """A body that drops the positions (so the mask): one causal sequence over the whole row."""

        def __init__(self, body):
            super().__init__()
            self.body = body

        def forward(self, input_ids, position_ids=None, **kw):
            return self.body(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kw)

    class BlindLM(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm, self.config, self.blind = lm, lm.config, Blind(lm.get_decoder())

        def get_decoder(self):
            return self.blind

        def get_output_embeddings(self):
            return self.lm.get_output_embeddings()

    why = packing_unsupported(BlindLM(trainer.model))
    assert why is not None and why.startswith("BlindLM (attention sdpa) does not confine attention to each packed sample")


def test_packing_true_on_a_model_that_cannot_is_a_one_line_error_and_auto_says_why(model_path, monkeypatch):
    import factory.training.trainer as trainer_module
    from factory.training.parallel import TrainerSetupError

    monkeypatch.setattr(trainer_module, "packing_unsupported", lambda model: "LlamaForCausalLM cannot (test)")
    one_line = r"^train.packing: LlamaForCausalLM cannot \(test\); set train.packing to false or auto$"
    with pytest.raises(TrainerSetupError, match=one_line):
        trainer_for(model_path, "train.packing=true")
    auto = trainer_for(model_path)
    assert not auto.packing and auto.settings()["packing_why"] == "off: LlamaForCausalLM cannot (test)"
    assert auto.train_step(ragged_batch(7))["train/padding_share"] > 0  # the grouped step instead


def test_plan_packs_rows_first_fit_decreasing_within_the_budget():
    lengths = [30, 5, 22, 8, 12, 17, 50]
    plan = plan_packed_rows(lengths, ranks=1, budget_tokens=40)
    rows = plan[0]
    assert sorted(i for row in rows for i in row) == list(range(7))
    assert [sum(lengths[i] for i in row) for row in rows] == [50, 38, 39, 17]  # 50 alone: over the budget
    assert rows[1] == [0, 3] and rows[2] == [2, 5]  # 30+8, 22+17, then 12 and 5 go to the first with room
    assert plan_packed_rows(lengths, 1, 0) == [[sorted(range(7), key=lambda i: -lengths[i])]]  # no budget: one row
    two = plan_packed_rows(lengths, ranks=2, budget_tokens=64)
    loads = [sum(lengths[i] for row in shard for i in row) for shard in two]
    assert abs(loads[0] - loads[1]) <= 12 and all(sum(lengths[i] for i in r) <= 64 for s in two for r in s)
    assert padding_share(plan, lengths, packed=True) == 0.0


def test_plan_row_packs_fills_rows_as_wide_as_each_micro_batchs_longest():
    lengths = [30, 5, 22, 8, 12, 17, 50, 40]
    plan = plan_row_packs(lengths, ranks=1, budget_tokens=100)  # 50 wide: two rows a micro-batch
    assert sorted(i for mb in plan[0] for i in mb) == list(range(8))
    first, second = plan[0]
    # 50 wide, two rows: 50 | 40 + 8 (30, 22, 17, 12, 5 fit in neither); then 30 wide, three rows
    assert first == [6, 7, 3] and second == [0, 2, 5, 4, 1]
    assert [[mb[k] for k in row] for mb in plan[0] for row in row_layout([lengths[i] for i in mb])] == \
        [[6], [7, 3], [0], [2, 1], [5, 4]]  # 30 | 22 + 5 | 17 + 12
    assert padding_share(plan, lengths, packed="rows") < padding_share(plan_micro_batches(lengths, 1, 100), lengths)
    assert plan_row_packs(lengths, 1, 0) == [[sorted(range(8), key=lambda i: -lengths[i])]]  # no budget: one
    two = plan_row_packs(lengths, ranks=2, budget_tokens=60)
    assert sorted(i for shard in two for mb in shard for i in mb) == list(range(8))
    for shard in two:
        for mb in shard:
            assert len(row_layout([lengths[i] for i in mb])) * max(lengths[i] for i in mb) <= 60


def test_the_merged_loss_is_the_whole_batch_loss(model_path):
    whole = trainer_for(model_path, "train.micro_batch_tokens=0", "train.packing=false").train_step(ragged_batch(3))
    micro = trainer_for(model_path, "train.micro_batch_tokens=40", "train.packing=false").train_step(ragged_batch(3))
    assert micro["train/loss"] == pytest.approx(whole["train/loss"], abs=1e-6)
    assert micro["train/tokens"] == whole["train/tokens"]
    assert micro["train/padding_share"] < whole["train/padding_share"]  # similar lengths share a micro-batch


def test_plan_balances_ranks_by_tokens_and_keeps_the_budget():
    lengths = [100, 10, 90, 20, 80, 30, 70, 40]
    plan = plan_micro_batches(lengths, ranks=2, budget_tokens=200)
    loads = [sum(lengths[i] for mb in shard for i in mb) for shard in plan]
    assert sorted(i for shard in plan for mb in shard for i in mb) == list(range(8))
    assert abs(loads[0] - loads[1]) <= 10
    for shard in plan:
        for mb in shard:
            assert len(mb) * max(lengths[i] for i in mb) <= 200 or len(mb) == 1
    assert plan_micro_batches(lengths, 1, 10_000) == [[list(range(8))]]  # fits: the batch as it came
    assert plan_micro_batches([500, 5], 1, 100) == [[[0], [1]]]  # too long for the budget: alone
    assert plan_micro_batches([5], ranks=3)[1:] == [[], []]  # fewer samples than ranks: empty shards


def test_padding_share_counts_padded_positions():
    assert padding_share([[[0, 1]]], [10, 5]) == pytest.approx(5 / 20)
    assert padding_share([[[0], [1]]], [10, 5]) == 0.0


def test_metrics_merge_weights_means_and_takes_maxima():
    merged = step_metrics_merge([{"train/loss": 1.0, "staleness/token_max": 2.0, "train/objective_weight": 1.0},
                                 {"train/loss": 4.0, "staleness/token_max": 1.0, "train/objective_weight": 3.0}])
    assert merged == {"train/loss": 3.25, "staleness/token_max": 2.0, "train/objective_weight": 4.0}


def test_streamed_lora_merge_equals_peft_merge(model_path):
    import copy

    trainer = trainer_for(model_path, "train.lora.enabled=true", "train.lora.rank=4", "rollout.weight_sync=lora")
    with torch.no_grad():  # B starts at zero; give it values so the merge shows
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    expected = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    streamed = trainer.named_weights()
    assert list(streamed) == list(expected)
    assert [(k, list(v.shape)) for k, v in streamed.items()] == trainer.weight_shapes()
    for k in expected:
        assert torch.equal(streamed[k], expected[k]), k


def test_bf16_precision_trains_close_to_fp32(model_path):
    batch = ragged_batch(4)
    fp32 = trainer_for(model_path, "train.precision=fp32").train_step(batch)
    bf16 = trainer_for(model_path, "train.precision=bf16").train_step(batch)
    assert bf16["train/loss"] == pytest.approx(fp32["train/loss"], abs=0.05)
    assert bf16["train/grad_norm"] == pytest.approx(fp32["train/grad_norm"], rel=0.1)


def test_activation_checkpointing_gives_the_same_gradients(model_path):
    batch = ragged_batch(5)
    a = grads_after_step(trainer_for(model_path, "train.activation_checkpointing=false"), batch)
    b = grads_after_step(trainer_for(model_path, "train.activation_checkpointing=true"), batch)
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-6)


def test_a_model_without_decoder_blocks_is_a_one_line_error():
    from factory.training.parallel import TrainerSetupError, decoder_blocks

    class Body(torch.nn.Module):
        pass

    class NoBlocks(torch.nn.Module):
        def get_decoder(self):
            return Body()

    with pytest.raises(TrainerSetupError, match=r"^train.ranks: NoBlocks has no decoder `layers` to shard .*train.ranks=1"):
        decoder_blocks(NoBlocks())


def test_compiled_blocks_give_the_eager_step(model_path):
    """train.compile=true on CPU: each decoder block compiled once with dynamic lengths; two steps on
    batches of different shapes (packed rows of other lengths) give the eager step's gradients."""
    eager = trainer_for(model_path, "train.compile=false", "train.micro_batch_tokens=40")
    compiled = trainer_for(model_path, "train.compile=true", "train.micro_batch_tokens=40")
    assert compiled.settings()["compile"] is True and eager.settings()["compile"] is False
    from factory.training.parallel import decoder_blocks

    assert all(b._compiled_call_impl is not None for b in decoder_blocks(compiled.model))
    for seed in (8, 9):
        a, b = grads_after_step(eager, ragged_batch(seed)), grads_after_step(compiled, ragged_batch(seed))
        for x, y in zip(a, b):
            assert torch.allclose(x, y, atol=1e-5, rtol=1e-4), (x - y).abs().max()
