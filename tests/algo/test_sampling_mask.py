"""Keep-sampling mask: the trainer renormalises its policy over the sampler's candidate set."""

from __future__ import annotations

import torch

from factory.rollout.engine import support_from
from factory.model.logprobs import completion_logprobs, pad_samples
from factory.core.types import Sample


class Table(torch.nn.Module):
    """A 'model' whose next-token logits are a fixed table row per position."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask=None):
        b, length = input_ids.shape
        return type("Out", (), {"logits": self.logits[:length].unsqueeze(0).expand(b, -1, -1)})()


def sample(support):
    return Sample("s", "g", "t", prompt_ids=[0], completion_ids=[2, 1], logprobs=[0.0, 0.0], loss_mask=[1, 1],
                  versions=[0, 0], support=support)


def test_logprob_is_renormalised_over_the_recorded_candidates():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [0.0, 1.0, -1.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    model = Table(logits.clone())
    full = completion_logprobs(model, pad_samples([sample([])], 0))
    masked = completion_logprobs(model, pad_samples([sample([[1, 2], []])], 0))
    # token 2 at step 0 over {1, 2}: 3 - log(e^2 + e^3); step 1 unknown: full softmax of row 1
    assert torch.isclose(masked[0, 0], torch.tensor(3.0) - torch.logsumexp(torch.tensor([2.0, 3.0]), 0))
    assert torch.isclose(masked[0, 1], full[0, 1])
    assert torch.isclose(full[0, 0], torch.log_softmax(logits[0], 0)[2])


def test_gradient_stays_finite_with_unknown_sets():
    model = Table(torch.randn(3, 4))
    out = completion_logprobs(model, pad_samples([sample([[2, 3], []]), sample([[], []])], 0))
    out.sum().backward()
    assert torch.isfinite(model.logits.grad).all()
    # outside the set {2, 3}, step 0's logits get no gradient from the masked logprob
    masked_only = Table(torch.randn(3, 4))
    completion_logprobs(masked_only, pad_samples([sample([[2, 3], [1, 3]])], 0))[0, 0].backward()
    assert masked_only.logits.grad[0, 0] == 0 and masked_only.logits.grad[0, 1] == 0


def test_support_from_drops_masked_candidates_and_distrusts_a_full_list():
    assert support_from([(5, -0.1), (7, -2.0), (9, -9999.0)], 3) == [5, 7]
    assert support_from([(5, -0.1), (7, -2.0), (9, -3.0)], 3) == []  # all k unmasked: may be cut off
