"""The engine's bookkeeping of its requests in vLLM: which a caller's abort reaches, and where its
time goes; how a request's routing joins its sample's, and where it cannot."""

from __future__ import annotations

import asyncio

import numpy as np

from rlactors.config import RolloutConfig
from rlactors.models import routes
from rlactors.rollout.admission import AdmissionGate
from rlactors.rollout.generation import (
    GenerateCall,
    Requests,
    add_captured_routing,
    add_routing,
    routing_source,
    take_routing,
)
from rlactors.types import Sample


def test_an_abort_marks_the_named_groups_and_returns_their_requests_in_flight():
    requests = Requests(in_flight={"g1/0/c/0": "g1", "g1/1/c/1": "g1", "g2/0/c/2": "g2"})
    assert requests.abort(["g1", "g3"]) == ["g1/0/c/0", "g1/1/c/1"]
    assert requests.user_aborted == {"g1", "g3"}  # g3 not yet in vLLM: its samples end "abort" on arrival
    assert requests.abort(None) == ["g1/0/c/0", "g1/1/c/1", "g2/0/c/2"]
    assert requests.user_aborted == {"g1", "g2", "g3"}


def test_the_engine_clock_is_paused_while_the_gate_is_closed_else_generating_while_requests_are_in():
    async def states() -> list[str]:
        gate, requests, seen = AdmissionGate(), Requests(), []

        def note() -> None:
            requests.note_activity(gate)
            seen.append(requests.clock.state)

        note()
        requests.in_flight["g1/0/c/0"] = "g1"
        note()
        await gate.close(timeout_s=1.0)  # a weight update: what is in flight waits or was interrupted
        note()
        requests.in_flight.clear()
        note()  # still paused: nothing may enter
        gate.open()
        note()
        return seen

    assert asyncio.run(states()) == ["idle", "generating", "paused", "paused", "idle"]


def _routing(positions: int, layers: int) -> tuple[bytes, list[int]]:
    values = np.ones((positions, layers, 2), dtype=np.uint8)
    return values.tobytes(), list(values.shape)


def test_a_routing_that_does_not_fit_the_samples_fails_that_sample_alone_naming_its_prompt():
    sample = Sample("synthetic/arithmetic/train/1180", 4, [5, 6, 7])
    assert add_routing(sample, "g/4/c/0", _routing(4, layers=2))
    assert not add_routing(sample, "g/4/c/1", _routing(5, layers=3))  # no raise: the other samples go on
    assert sample.error == ("prompt_id='synthetic/arithmetic/train/1180' sample 4: request 'g/4/c/1': "
                            "routing of shape [3, 2] (uint8) after [2, 2] (uint8)")
    assert sample.routed_experts_shape == [4, 2, 2]  # what it had is kept


def _output(token_ids: list[int], routed_experts=None):
    """A finished vLLM request's output (vLLM's own dataclass), as interrupted."""
    from vllm.outputs import CompletionOutput

    return CompletionOutput(0, "", token_ids, None, None, routed_experts=routed_experts, finish_reason="abort")


def test_a_request_without_routing_routed_nothing_only_if_it_made_no_token():
    # GPUs: vLLM returns the routing; a request aborted before it was ever scheduled returns none
    # and routed nothing (there is no capture in the worker to ask), but one with tokens must have.
    assert routing_source(_output([], np.zeros((3, 2, 2))), routing_in_worker=False) == "vllm"
    assert routing_source(_output([]), routing_in_worker=False) == "none"
    assert routing_source(_output([8, 9]), routing_in_worker=False) == "missing"
    # CPU: our capture in vLLM's worker holds it.
    assert routing_source(_output([]), routing_in_worker=True) == "worker"
    assert routing_source(_output([8, 9]), routing_in_worker=True) == "worker"


def test_where_vllm_returns_routing_a_request_without_any_asks_the_engine_nothing():
    # No engine here (llm None): a call into it would raise out of take_routing.
    gpu = GenerateCall(None, AdmissionGate(), Requests(), lambda: (0, None), RolloutConfig(record_routing=True),
                       vocab_size=16, model_path="", error_file="", routing_in_worker=False)
    sample = Sample("synthetic/arithmetic/train/1180", 4, [5, 6, 7])
    assert asyncio.run(take_routing(gpu, sample, "g/4/c/0", _output([])))
    assert sample.error is None and sample.routed_experts_shape == []
    # One that made tokens fails its sample alone, naming its prompt.
    assert not asyncio.run(take_routing(gpu, sample, "g/4/c/1", _output([8, 9])))
    assert sample.error == ("prompt_id='synthetic/arithmetic/train/1180' sample 4: vLLM returned no routing "
                            "for the 2 token(s) of request 'g/4/c/1'")


def _captured(first: int, num_positions: int) -> tuple[bytes, list[int]]:
    """A captured request's rows for positions 0..num_positions-1 (1 layer, top-2): expert `first + position`."""
    values = np.array([[[first + p, 0]] for p in range(num_positions)], dtype=np.uint8)
    return values.tobytes(), list(values.shape)


def test_captured_routing_is_cut_to_the_prompt_and_the_tokens_vllm_returned():
    sample = Sample("p", 0, [5, 6, 7])
    # vLLM returned 2 tokens (the second ended a stop string) but its engine ran 2 more steps.
    assert add_captured_routing(sample, "r0", _captured(0, 3 + 2 + 2), num_returned=2)
    assert sample.routed_experts_shape == [5, 1, 2]
    sample.response_token_ids += [8, 9, 20, 21]  # the turn's tokens, then an observation
    assert add_captured_routing(sample, "r1", _captured(100, 7), num_returned=1)  # the next turn, from the whole sequence
    kept = routes.decode(sample.routed_experts, sample.routed_experts_shape)[:, 0, 0]
    assert list(kept) == [0, 1, 2, 3, 4, 105, 106]  # the observation's rows are its own, not the overrun's
