"""Routing replay capture for mixture-of-experts policies on vLLM-CPU (patched in by sitecustomize.py).

For every token a request samples, the experts each MoE layer routed the position whose logits
produced it: the prompt's last position for the first token, then the previous token's. One row per
sampled token, `[n_moe_layers][top_k]` expert ids (layers in model order), returned in the same field
vLLM's own feature uses: `CompletionOutput.routed_experts` (a numpy array `[n_sampled, layers, top_k]`),
which `/v1/completions`, the token endpoint and our `/factory/v1/sample` send as base64 `.npy`.

Only requests that ask get rows: `SamplingParams.extra_args["factory_routing"]` truthy
(`vllm_xargs` on `/v1/completions`). A server whose model has no MoE router binds nothing.

Why not vLLM's own `--enable-return-routed-experts`: vLLM 0.32 wires it into Model Runner V2 only
(`v1/worker/gpu/model_runner.py`: the `AuxOutputWorkerConnector`), which needs Triton; vLLM-CPU runs
the V1 runner (`CPUModelRunner(GPUModelRunner)`), and `VllmConfig` refuses the flag there ("AuxOutput
Connector requires Model Runner V2"). Its worker side also keeps every prompt position's routing in a
block store keyed by the prefix cache's hashes, server-wide for every request. What we keep of it:

- the router hook: vLLM's `BaseRouter.set_capture_fn`, called with each layer's logical `topk_ids`
  (before any EPLB mapping) — the CPU experts (`CPUUnquantizedExperts`) are modular, so every token
  goes through it;
- the way back: the scheduler already copies a per-request array from the model runner's output
  (`ModelRunnerOutput.aux_output_connector_output`) into `EngineCoreOutput.routed_experts` through its
  `aux_output_connector.take_output`, the output processor concatenates the chunks of a request and
  hands them over when it finishes (aborted included), and the servers serialize them. We install a
  scheduler-side relay that does only that (`RoutingRelay`), so nothing else of the feature runs.

Per step, `execute_model` notes the new requests that ask (and drops finished ones) and clears the
captures; the forward calls the hook once per MoE layer (a chunked MoE forward would call it more
often: the pieces are concatenated); `sample_tokens` takes, for each asking request that samples this
step (not a partial prefill chunk, whose token vLLM discards), the row at its logits position
(`query_start_loc[i + 1] - 1`; speculative decoding is not supported here).
"""

from __future__ import annotations

from functools import partial

import numpy as np

FLAG = "factory_routing"  # the SamplingParams.extra_args key that asks for routing


def _wants(sampling_params) -> bool:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return bool(extra.get(FLAG))


class RoutingRelay:
    """The scheduler-side half of vLLM's aux-output connector, reduced to handing our rows over."""

    def build_connector_meta(self, scheduler_output, requests):
        return None

    def take_output(self, request, output):
        if not output:
            return None
        return output.get(request.request_id)

    def request_finished(self, request) -> None:
        pass

    def reset(self) -> None:
        pass


class _Capture:
    """One model runner's routers and this step's captured expert ids."""

    def __init__(self, model):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        routers = []
        for module in model.modules():
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                routers.append((module.layer_id, router))
        routers.sort(key=lambda r: r[0])
        self.layers = len(routers)
        self.pieces: list[list] = [[] for _ in routers]
        self.wanting: set[str] = set()
        for i, (_, router) in enumerate(routers):
            router.set_capture_fn(partial(self._capture, i))

    def _capture(self, layer: int, topk_ids) -> None:
        if self.wanting:  # a copy: a kernel may reuse the tensor it routed into
            self.pieces[layer].append(topk_ids.clone())

    def begin_step(self, scheduler_output) -> None:
        for pieces in self.pieces:
            pieces.clear()
        for new in scheduler_output.scheduled_new_reqs:
            if _wants(new.sampling_params):
                self.wanting.add(new.req_id)
        if self.wanting and scheduler_output.finished_req_ids:
            self.wanting -= scheduler_output.finished_req_ids

    def rows(self, runner) -> dict[str, np.ndarray] | None:
        """{request id: [1, layers, top_k]} for the asking requests that sample this step."""
        if not self.wanting or not self.pieces or not self.pieces[0]:
            return None
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        ids = batch.req_ids[:num_reqs]
        discard = runner.discard_request_mask.np[:num_reqs]
        ends = runner.query_start_loc.np[1: num_reqs + 1]
        picked = [(rid, int(ends[i]) - 1) for i, rid in enumerate(ids) if rid in self.wanting and not discard[i]]
        if not picked:
            return None
        import torch

        index = torch.tensor([row for _, row in picked], dtype=torch.long)
        layers = [(p[0] if len(p) == 1 else torch.cat(p)) for p in self.pieces]
        routing = torch.stack([t.index_select(0, index.to(t.device)) for t in layers], dim=1)
        dtype = torch.uint8 if runner.model_config.get_num_experts() <= 256 else torch.int16
        out = routing.to("cpu", dtype).numpy()
        return {rid: out[j: j + 1] for j, (rid, _) in enumerate(picked)}


def patch_runner(module) -> None:
    """Wrap `GPUModelRunner.execute_model` / `sample_tokens` (the CPU model runner inherits both)."""
    runner_cls = module.GPUModelRunner
    execute, sample = runner_cls.execute_model, runner_cls.sample_tokens

    def execute_model(self, scheduler_output, *args, **kwargs):
        capture = self.__dict__.get("_factory_routing", False)
        if capture is False:  # bound once, on the first step: None where the model has no MoE router
            capture = _Capture(self.get_model())
            self._factory_routing = capture = capture if capture.layers else None
        if capture is not None:
            capture.begin_step(scheduler_output)
        return execute(self, scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        capture = self.__dict__.get("_factory_routing")
        rows = capture.rows(self) if capture is not None and self.execute_model_state is not None else None
        output = sample(self, *args, **kwargs)
        if rows:
            target = getattr(output, "_model_runner_output", None) or output
            target.aux_output_connector_output = rows
        return output

    runner_cls.execute_model, runner_cls.sample_tokens = execute_model, sample_tokens


def patch_scheduler(module) -> None:
    """The scheduler relays our rows (vLLM's own connector is off: its config refuses it on CPU)."""
    scheduler_cls = module.Scheduler
    init = scheduler_cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.aux_output_connector is None:
            self.aux_output_connector = RoutingRelay()

    scheduler_cls.__init__ = __init__
