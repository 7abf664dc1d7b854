"""Inside a vLLM worker: which experts every MoE layer sent each token of each request to.

vLLM 0.32 returns this itself (`CompletionOutput.routed_experts`) only on its Model Runner V2,
which needs Triton and so never runs on CPU. Its parts below the runner run anywhere, and this
module uses them: `RoutedExpertsCapturer` (a preallocated [max_batched_tokens, layers, top_k]
buffer each MoE router writes its top-k into, in the forward pass) bound to the routers by
`bind_routed_experts_capturer`. What Model Runner V2 adds, mapping each step's rows to requests,
is done here around the V1 runner's `execute_model`: its rows are the scheduled tokens of
`input_batch.req_ids`, in that order, each request's starting at the position the scheduler says
it has computed so far.

    capture = RoutingCapture(worker.model_runner)     # once, after the model loaded
    ... vLLM steps ...
    capture.take(["group/0/call/3"])                 # {external request id: (bytes, [positions, layers, top_k])}

A request's routing covers the positions its steps computed, from its first token: the prompt
(the engine turns prefix caching off while it records, so no prompt position is served from a
cache) and every response token fed back in, i.e. all but the last; steps the engine ran past a
stop string too, which the engine actor cuts off (`rlactors.rollout.generation.add_captured_routing`).
A position never computed
holds the dtype's largest value, and expert ids are uint8 or uint16 by expert count
(`rlactors.models.routes.routing_dtype`, `unrecorded_expert`).
"""

from __future__ import annotations

import numpy as np

from rlactors.models.routes import routing_dtype, unrecorded_expert

MAX_KEPT_REQUESTS = 8192  # routing of requests nobody took (an engine actor that died) is dropped oldest first


class RoutingCapture:
    def __init__(self, runner):
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )

        config = runner.vllm_config
        self.capturer = RoutedExpertsCapturer(config.scheduler_config.max_num_batched_tokens, config)
        bind_routed_experts_capturer(runner.get_model(), self.capturer)
        self.dtype = routing_dtype(config.model_config.get_num_experts())
        self.shape_per_token = self.capturer.shape_per_token  # (layers, top_k)
        self.runner = runner
        self.pieces: dict[str, list[tuple[int, np.ndarray]]] = {}  # internal request id -> (start, rows)
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            output = execute(scheduler_output, *args, **kwargs)
            if scheduler_output.total_num_scheduled_tokens:
                self.commit(scheduler_output)
            return output

        runner.execute_model = execute_model

    def commit(self, scheduler_output) -> None:
        """File this step's rows under their requests (the batch order is `input_batch.req_ids`)."""
        counts = scheduler_output.num_scheduled_tokens
        starts = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        rows = self.capturer.snapshot_routing_data(scheduler_output.total_num_scheduled_tokens)
        rows = rows.numpy().astype(self.dtype)
        offset = 0
        for request_id in self.runner.input_batch.req_ids:
            count = counts.get(request_id, 0) if request_id is not None else 0
            if count:
                self.pieces.setdefault(request_id, []).append((starts[request_id], rows[offset:offset + count]))
                offset += count
        while len(self.pieces) > MAX_KEPT_REQUESTS:
            self.pieces.pop(next(iter(self.pieces)))

    def take(self, request_ids: list[str]) -> dict[str, tuple[bytes, list[int]]]:
        """The routing of each finished request named by its external id (vLLM's internal one adds
        `-<8 characters>`), removed from the store; a request with none recorded is left out."""
        wanted = set(request_ids)
        taken = {}
        for internal in [key for key in self.pieces if key in wanted or key.rpartition("-")[0] in wanted]:
            pieces = self.pieces.pop(internal)
            length = max(start + len(rows) for start, rows in pieces)
            routes = np.full((length, *self.shape_per_token), unrecorded_expert(self.dtype), dtype=self.dtype)
            for start, rows in pieces:  # a recomputed position (after a preemption) keeps its latest rows
                routes[start:start + len(rows)] = rows
            external = internal if internal in wanted else internal.rpartition("-")[0]
            taken[external] = (routes.tobytes(), list(routes.shape))
        return taken
