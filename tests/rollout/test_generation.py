"""The engine's bookkeeping of its requests in vLLM: which a caller's abort reaches."""

from __future__ import annotations

from rlactors.rollout.generation import Requests


def test_an_abort_marks_the_named_groups_and_returns_their_requests_in_flight():
    requests = Requests(in_flight={"g1/0/c/0": "g1", "g1/1/c/1": "g1", "g2/0/c/2": "g2"})
    assert requests.abort(["g1", "g3"]) == ["g1/0/c/0", "g1/1/c/1"]
    assert requests.user_aborted == {"g1", "g3"}  # g3 not yet in vLLM: its samples end "abort" on arrival
    assert requests.abort(None) == ["g1/0/c/0", "g1/1/c/1", "g2/0/c/2"]
    assert requests.user_aborted == {"g1", "g2", "g3"}
