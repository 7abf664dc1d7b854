"""The engine's bookkeeping of its requests in vLLM: which a caller's abort reaches, and where its
time goes; how a request's routing joins its sample's, and where it cannot."""

from __future__ import annotations

import asyncio

import numpy as np

from rlactors.rollout.admission import AdmissionGate
from rlactors.rollout.generation import Requests, add_routing
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

