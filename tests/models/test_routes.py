"""A sample's MoE routing (`rlactors.models.routes`): joined across the vLLM requests of one response,
decoded for the trainer with -1 where nothing was recorded, and kept whole by the buffer's
checkpoint tables."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from rlactors.buffer.storage import GROUPS_SCHEMA, _group_from, _group_row
from rlactors.models import routes
from rlactors.trainer.batch import build_micro_batch, train_batch_from_groups
from rlactors.types import Group, PromptRequest, Sample

UNRECORDED = 255  # uint8's largest value: a position the engine never ran


def _request_routes(first: int, last: int) -> tuple[bytes, list[int]]:
    """A request's record of positions 0..last-1 (2 layers, top-2), expert ids `first + position`."""
    values = np.array([[[first + p, p % 8]] * 2 for p in range(last)], dtype=np.uint8)
    return values.tobytes(), list(values.shape)


def test_a_resumed_response_keeps_each_positions_own_routing():
    sample = Sample("p", 0, [5, 6, 7], [8, 9])
    routes.merge(sample, *_request_routes(0, 4))  # first request: the prompt and the first token
    routes.merge(sample, *_request_routes(100, 6))  # resumed under new weights: ran every position again
    kept = routes.decode(sample.routed_experts, sample.routed_experts_shape)
    assert kept.shape == (6, 2, 2) and kept.dtype == np.uint8
    assert list(kept[:, 0, 0]) == [0, 1, 2, 3, 104, 105]  # positions 0-3 from the first request
    routes.truncate(sample, 4)  # a turn restarted from scratch drops what it had added
    assert routes.decode(sample.routed_experts, sample.routed_experts_shape).shape == (4, 2, 2)
    with pytest.raises(ValueError, match=r"routing of shape \[3, 2\] \(uint8\) after \[2, 2\]"):
        routes.merge(sample, np.zeros((5, 3, 2), dtype=np.uint8).tobytes(), [5, 3, 2])
    with pytest.raises(ValueError, match="do not hold shape"):
        routes.decode(b"abc", [2, 2, 2])


def test_the_trainer_reads_unrecorded_positions_as_minus_one_and_pads_them():
    recorded = Sample("p", 0, [5, 6, 7], [8, 9], response_logprobs=[-1.0, -1.0], token_policy_versions=[0, 0],
                      score=1.0)
    values = np.array([[[1, 2], [3, 4]]] * 4, dtype=np.uint8)
    values[2, 1] = UNRECORDED
    recorded.routed_experts, recorded.routed_experts_shape = values.tobytes(), [4, 2, 2]
    as_tensor = routes.as_tensor(recorded, 5)
    assert as_tensor.dtype == torch.int16 and as_tensor.shape == (5, 2, 2)
    assert as_tensor[2, 1].tolist() == [-1, -1] and as_tensor[4].eq(-1).all() and as_tensor[0].tolist() == [[1, 2], [3, 4]]
    # A sample without a record beside one with: all -1, routed by the trainer itself.
    plain = Sample("q", 0, [5], [8], response_logprobs=[-1.0], token_policy_versions=[0], score=0.0)
    batch = train_batch_from_groups([Group(PromptRequest("p", [5, 6, 7]), [recorded]), Group(PromptRequest("q", [5]), [plain])])
    assert [tuple(r.shape) for r in batch.routes] == [(5, 2, 2), (2, 2, 2)] and batch.routes[1].eq(-1).all()
    import pickle

    again = pickle.loads(pickle.dumps(batch))  # flattened and split again on the way to the ranks
    assert all(torch.equal(a, b) for a, b in zip(again.routes, batch.routes, strict=True))
    micro = build_micro_batch(batch, [1, 0])
    assert micro.routes.shape == (2, 5, 2, 2) and micro.routes[0, 2:].eq(-1).all()
    assert torch.equal(micro.routes[1], batch.routes[0])


def test_the_buffer_checkpoint_keeps_the_routing_bytes():
    sample = Sample("p", 0, [5, 6, 7], [8, 9])
    routes.merge(sample, *_request_routes(0, 4))
    group = Group(PromptRequest("p", [5, 6, 7]), [sample])
    table = pa.Table.from_pylist([_group_row(group, epoch=0, batch_id=1)], schema=GROUPS_SCHEMA)
    back = _group_from(table.to_pylist()[0]).samples[0]
    assert back.routed_experts == sample.routed_experts and back.routed_experts_shape == [4, 2, 2]


def test_a_turn_requeued_from_position_0_takes_the_next_requests_routing_whole():
    # A single response interrupted in its first request and requeued keeps no position of it.
    sample = Sample("p", 0, [5, 6, 7])
    routes.merge(sample, *_request_routes(0, 4))
    routes.truncate(sample, 0)
    routes.merge(sample, *_request_routes(100, 5))  # the requeued request, under new weights
    again = routes.decode(sample.routed_experts, sample.routed_experts_shape)
    assert again.dtype == np.uint8 and again.shape == (5, 2, 2)
    assert np.array_equal(again, routes.decode(*_request_routes(100, 5)))


def test_routing_of_no_positions_is_stored_as_none():
    sample = Sample("p", 0, [5, 6, 7])
    routes.merge(sample, *_request_routes(0, 4))
    routes.truncate(sample, 0)
    assert sample.routed_experts == b"" and sample.routed_experts_shape == []  # no stale [0, layers, top_k]
    assert routes.as_tensor(sample, 3) is None
    # A request that routed nothing (aborted before vLLM scheduled it) adds none either.
    routes.merge(sample, b"", [0, 2, 2])
    assert sample.routed_experts == b"" and sample.routed_experts_shape == []
