"""The seeded-sampling rewind of vllm_site/sitecustomize.py, on the logic alone.

vLLM samples a partially prefilled request at every partial step, discards its token, and then rewinds
that request's seeded generator by its CUDA Philox offset, which a CPU generator does not have (the
engine core died). The patch keeps the CPU generator's state before sampling and puts it back after
vLLM's bookkeeping. A small stand-in runner here holds the two methods as vLLM writes them (the
end-to-end check on a real server is tests/integration/test_real_shapes.py, where float batch effects
make whole-completion equality a majority, not an exact, property)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

SITE = Path(__file__).resolve().parents[2] / "factory" / "rollout" / "vllm_site" / "sitecustomize.py"


@pytest.fixture(scope="module")
def site():
    before = list(sys.meta_path)
    spec = importlib.util.spec_from_file_location("factory_sitecustomize_under_test", SITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.meta_path[:] = before  # drop its import hook: this process is not a vLLM server
    return module


class Batch:
    def __init__(self, generators: dict[int, torch.Generator]):
        self.generators = generators
        self.num_reqs = len(generators)


def stand_in_module(discard: list[bool]) -> types.SimpleNamespace:
    """A runner with vLLM's two methods: `_sample` draws from each request's generator; `_bookkeeping_sync`
    rewinds the generators of the discarded requests by their offset, as vllm/v1/worker/gpu_model_runner.py does."""

    class GPUModelRunner:
        def __init__(self, generators):
            self.input_batch = Batch(generators)
            self.discard_request_mask = types.SimpleNamespace(np=np.array(discard))

        def _sample(self):
            return {i: torch.rand(4, generator=g) for i, g in self.input_batch.generators.items()}

        def _bookkeeping_sync(self):
            for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
                gen = self.input_batch.generators.get(int(i))
                if gen is not None:
                    gen.set_offset(gen.get_offset() - 4)

    return types.SimpleNamespace(GPUModelRunner=GPUModelRunner)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def test_vllms_own_rewind_fails_on_a_cpu_generator():
    module = stand_in_module([False, True])
    runner = module.GPUModelRunner({0: seeded(1), 1: seeded(2)})
    runner._sample()
    with pytest.raises(RuntimeError, match="does not use offset"):
        runner._bookkeeping_sync()


def test_a_discarded_requests_generator_is_put_back_and_the_others_advance(site, monkeypatch):
    monkeypatch.delenv("FACTORY_CPU_SEEDED_REWIND", raising=False)
    module = stand_in_module([False, True, False])
    site._patch_seeded_rewind(module)
    gens = {0: seeded(1), 1: seeded(2), 2: seeded(3)}
    runner = module.GPUModelRunner(gens)
    for _ in range(3):  # three partial prefill steps of request 1
        runner._sample()
        runner._bookkeeping_sync()
    assert runner.input_batch.generators is gens  # the batch's own dict is back in place
    # request 1 draws next what a generator that never sampled draws; 0 and 2 moved on by three draws
    assert torch.equal(torch.rand(4, generator=gens[1]), torch.rand(4, generator=seeded(2)))
    ahead = seeded(1)
    for _ in range(3):
        torch.rand(4, generator=ahead)
    assert torch.equal(torch.rand(4, generator=gens[0]), torch.rand(4, generator=ahead))
    assert not torch.equal(torch.rand(4, generator=gens[2]), torch.rand(4, generator=seeded(3)))


def test_the_switch_gives_back_vllms_own_rewind(site, monkeypatch):
    monkeypatch.setenv("FACTORY_CPU_SEEDED_REWIND", "0")
    module = stand_in_module([True])
    site._patch_seeded_rewind(module)
    runner = module.GPUModelRunner({0: seeded(1)})
    runner._sample()
    with pytest.raises(RuntimeError, match="does not use offset"):
        runner._bookkeeping_sync()


def test_the_installed_vllm_still_rewinds_as_the_stand_in_does():
    """The stand-in is only as good as its likeness: the installed vLLM's runner still samples every
    discarded request and rewinds its generator by offset in `_bookkeeping_sync` (else the patch is stale)."""
    spec = importlib.util.find_spec("vllm")
    source = (Path(spec.origin).parent / "v1" / "worker" / "gpu_model_runner.py").read_text()
    bookkeeping = source[source.index("def _bookkeeping_sync("):]
    bookkeeping = bookkeeping[: bookkeeping.index("\n    def ", 10)]
    assert "self.discard_request_mask.np[:num_reqs]" in bookkeeping
    assert "gen.set_offset(gen.get_offset() - 4)" in bookkeeping
    assert "def _sample(" in source
