"""`repack_shared_weights`: after an in-place reload, a layer whose weight is another's (a tied output
layer) is re-packed from it, and no other layer is touched."""

from __future__ import annotations

import torch

from factory.model.weightsync import repack_shared_weights


class Packing:
    """Stands in for vLLM's per-layer method that packs a weight for the CPU kernels."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packed = layer.weight.detach().clone()


def test_only_layers_sharing_a_weight_are_repacked():
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(5, 3), "mid": torch.nn.Linear(3, 3),
                                 "head": torch.nn.Linear(3, 5, bias=False)})
    model["head"].weight = model["embed"].weight  # tied
    for layer in model.values():
        layer.quant_method = Packing()
        layer.quant_method.process_weights_after_loading(layer)
    with torch.no_grad():  # an in-place reload of the embedding and the middle layer
        model["embed"].weight.add_(1.0)
        model["mid"].weight.add_(1.0)
    assert repack_shared_weights(model) == 2
    assert torch.equal(model["head"].packed, model["embed"].weight)
    assert not torch.equal(model["mid"].packed, model["mid"].weight)  # the reload itself re-packs loaded layers
