"""Which device a component computes on: the recipe says auto, cpu or cuda."""

from __future__ import annotations


def resolve_device(wanted: str) -> str:
    """'auto' -> 'cuda' when this process sees a GPU, else 'cpu'; 'cuda' without one is a one-line error."""
    import torch

    has_cuda = torch.cuda.is_available()
    if wanted == "auto":
        return "cuda" if has_cuda else "cpu"
    if wanted == "cuda" and not has_cuda:
        raise RuntimeError("device 'cuda' was asked for but this node has no usable GPU (torch.cuda.is_available() "
                           "is false); set train.device / rollout.device to auto or cpu, or place the actor on a "
                           "GPU node (placement.<role>: {GPU: 1})")
    if wanted not in ("cpu", "cuda"):
        raise ValueError(f"device: unknown {wanted!r}; choose auto, cpu or cuda")
    return wanted
