"""TrainBatch, batch planning and micro-batch tensors: pure functions, no Ray."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlactors.trainer.batch import (
    ROLLOUT_LOGPROBS,
    TrainBatch,
    build_micro_batch,
    train_batch_from_groups,
    unpad_rows,
)
from rlactors.trainer.plan import equalize_micro_batch_counts, plan_mini_batches
from rlactors.types import Group, PromptRequest, Sample


def _group(prompt_id, responses, score=1.0):
    request = PromptRequest(prompt_id=prompt_id, prompt_token_ids=[5, 6, 7])
    samples = [Sample(prompt_id, k, [5, 6, 7], response, [-0.5] * len(response), [0] * len(response), score=score)
               for k, response in enumerate(responses)]
    return Group(request, samples)


def test_train_batch_from_groups_flattens_in_order():
    batch = train_batch_from_groups([_group("a", [[10, 11], [12]]), _group("b", [[13, 14, 15]], score=0.0)])
    assert batch.response_token_ids == [[10, 11], [12], [13, 14, 15]]
    assert batch.group_ids == [0, 0, 1]
    assert batch.prompt_ids == ["a", "a", "b"]
    assert batch.sample_indices == [0, 1, 0]
    assert batch.scores == [1.0, 1.0, 0.0]
    assert [t.tolist() for t in batch.token_field(ROLLOUT_LOGPROBS)] == [[-0.5, -0.5], [-0.5], [-0.5] * 3]
    assert batch.sequence_lengths == [5, 4, 6]


def test_train_batch_from_groups_names_bad_samples():
    unscored = _group("p7", [[1, 2]], score=None)
    with pytest.raises(ValueError, match="p7.*sample_index 0.*no score"):
        train_batch_from_groups([unscored])
    mismatched = _group("p8", [[1, 2], [3]])
    mismatched.samples[1].response_logprobs = []
    with pytest.raises(ValueError, match="p8.*sample_index 1.*0 response_logprobs for 1"):
        train_batch_from_groups([mismatched])
    failed = _group("p9", [[1]])
    failed.samples[0].error = "engine died"
    with pytest.raises(ValueError, match="p9.*engine died"):
        train_batch_from_groups([failed])


def test_a_scoring_failure_trains_with_its_zero_score():
    group = _group("p10", [[1, 2], [3]])
    group.samples[1].score, group.samples[1].score_error = 0.0, "prompt_id=p10 sample_index=1: ValueError: bad"
    assert train_batch_from_groups([group]).scores == [1.0, 0.0]


def test_fields_are_checked_and_padding_round_trips():
    batch = TrainBatch([[1], [2, 3]], [[4, 5, 6], [7]], [0, 1], prompt_ids=["x", "y"])
    with pytest.raises(ValueError, match="'advantages'.*prompt_id 'y'.*expected \\(1,\\)"):
        batch.set_field("advantages", [torch.zeros(3), torch.zeros(2)])
    with pytest.raises(KeyError, match="no token field 'returns'"):
        batch.token_field("returns")
    batch.set_field("advantages", [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])])
    padded, mask = batch.padded_field("advantages")
    assert padded.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]
    batch.set_padded_field("doubled", padded * 2)
    assert [t.tolist() for t in batch.token_field("doubled")] == [[2, 4, 6], [8]]
    sub = batch.select([1])
    assert sub.prompt_ids == ["y"] and sub.token_field("doubled")[0].tolist() == [8]


def test_a_batch_pickles_to_its_own_data_and_back_exactly():
    import copy
    import pickle

    n, width = 64, 32
    lengths = [i % width for i in range(n)]  # an empty response among them
    batch = TrainBatch([[1, 2]] * n, [[3] * k for k in lengths], [i // 8 for i in range(n)],
                       prompt_ids=[f"p{i}" for i in range(n)], sample_indices=[i % 8 for i in range(n)],
                       scores=[float(i) for i in range(n)])
    batch.set_field(ROLLOUT_LOGPROBS, [-torch.rand(k) for k in lengths])
    batch.set_padded_field("advantages", torch.randn(n, width))  # rows are views of one [n, width] tensor
    blob = pickle.dumps(batch)
    data_bytes = 2 * 4 * sum(lengths)  # two float32 fields
    assert len(blob) < data_bytes + 16_000  # not n copies of the padded tensor (n * n * width * 4 bytes)
    back = pickle.loads(blob)
    for name in ("prompt_token_ids", "response_token_ids", "group_ids", "prompt_ids", "sample_indices", "scores"):
        assert getattr(back, name) == getattr(batch, name)
    for name in (ROLLOUT_LOGPROBS, "advantages"):
        assert [t.tolist() for t in back.token_field(name)] == [t.tolist() for t in batch.token_field(name)]
    sub = pickle.loads(pickle.dumps(back.select([5, 1])))  # a sub-batch of split rows: its own rows only
    assert [t.tolist() for t in sub.token_field("advantages")] == [batch.token_field("advantages")[i].tolist()
                                                                    for i in (5, 1)]
    assert len(pickle.dumps(back.select([5, 1]))) < 2_000
    empty = pickle.loads(pickle.dumps(TrainBatch([], [], [], token_fields={"advantages": []})))
    assert len(empty) == 0 and empty.token_field("advantages") == []
    copied = copy.deepcopy(batch)
    assert [t.tolist() for t in copied.token_field("advantages")] == [t.tolist() for t in batch.token_field("advantages")]


def test_micro_batch_positions_predict_response_tokens():
    batch = TrainBatch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], [0, 0])
    batch.set_field("advantages", [torch.tensor([0.5, 0.6]), torch.tensor([0.7, 0.8, 0.9])])
    micro = build_micro_batch(batch, [1, 0], ("advantages",), pad_token_id=0)
    assert micro.input_ids.tolist() == [[4, 7, 8, 9, 0], [1, 2, 3, 5, 6]]
    # input_ids[row, position + 1] is the label: the logits at `position` predict it.
    for row in range(2):
        for t in range(int(micro.mask[row].sum())):
            assert micro.input_ids[row, micro.response_positions[row, t] + 1] == micro.labels[row, t]
    assert micro.mask.tolist() == [[True, True, True], [True, True, False]]
    assert micro.fields["advantages"][1].tolist() == pytest.approx([0.5, 0.6, 0.0])
    assert [(i, v.tolist()) for i, v in unpad_rows(micro.fields["advantages"], micro)] == [
        (1, pytest.approx([0.7, 0.8, 0.9])), (0, pytest.approx([0.5, 0.6]))]
    filler = build_micro_batch(batch, [], ("advantages",))
    assert filler.num_tokens == 0 and filler.input_ids.shape == (1, 1)


def test_equalize_splits_before_adding_fillers():
    assert equalize_micro_batch_counts([[[1, 2, 3, 4]], [[5], [6], [7]]]) == [[[1], [2], [3, 4]], [[5], [6], [7]]]
    assert equalize_micro_batch_counts([[[1]], [[2], [3]]]) == [[[1], []], [[2], [3]]]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=4, max_size=40),
    num_mini_batches=st.integers(1, 4),
    num_ranks=st.integers(1, 4),
    max_tokens=st.integers(1, 200),
)
def test_plan_covers_every_sequence_once_within_budget(lengths, num_mini_batches, num_ranks, max_tokens):
    sequence_lengths = [p + r for p, r in lengths]
    response_lengths = [r for _, r in lengths]
    plans = plan_mini_batches(sequence_lengths, response_lengths, num_mini_batches, num_ranks, max_tokens)
    assert len(plans) == num_mini_batches
    seen = []
    for plan in plans:
        assert len(plan.micro_batches) == num_ranks
        assert len({len(rank) for rank in plan.micro_batches}) == 1  # equal counts on all ranks
        indices = [i for rank in plan.micro_batches for micro in rank for i in micro]
        assert plan.num_tokens == sum(response_lengths[i] for i in indices)
        assert plan.num_sequences == sum(response_lengths[i] > 0 for i in indices)
        for rank in plan.micro_batches:
            for micro in rank:
                if len(micro) > 1:
                    assert len(micro) * max(sequence_lengths[i] for i in micro) <= max_tokens
        seen += sorted(indices)
    assert seen == list(range(len(lengths)))  # contiguous mini-batches, nothing lost or repeated


def test_plan_rejects_more_mini_batches_than_sequences():
    with pytest.raises(ValueError, match="3 sequences cannot make 4 mini-batches"):
        plan_mini_batches([5, 5, 5], [2, 2, 2], 4, 1, 100)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=2, max_size=40).filter(lambda x: len(x) % 2 == 0),
    num_mini_batches=st.integers(1, 3),
    num_ranks=st.integers(1, 3),
    max_tokens=st.integers(1, 200),
)
def test_a_preference_plan_keeps_each_pair_whole_and_in_order(lengths, num_mini_batches, num_ranks, max_tokens):
    """Every pair (2p chosen, 2p+1 rejected) once, both halves adjacent in one micro-batch, chosen
    first; micro-batches within budget; equal counts on every rank; counts are pairs."""
    from rlactors.trainer.plan import plan_preference_pairs

    num_pairs = len(lengths) // 2
    if num_pairs < num_mini_batches:
        return
    seen = []
    for plan in plan_preference_pairs(lengths, num_mini_batches, num_ranks, max_tokens):
        assert len({len(rank) for rank in plan.micro_batches}) == 1
        indices = [i for rank in plan.micro_batches for micro in rank for i in micro]
        assert plan.num_tokens == plan.num_sequences == len(indices) // 2
        for rank in plan.micro_batches:
            for micro in rank:
                assert [i % 2 for i in micro] == [0, 1] * (len(micro) // 2)
                assert all(micro[k + 1] == micro[k] + 1 for k in range(0, len(micro), 2))
                if len(micro) > 2:
                    assert len(micro) * max(lengths[i] for i in micro) <= max_tokens
        seen += indices
    assert sorted(seen) == list(range(len(lengths)))
    with pytest.raises(ValueError, match="even number of sequences, got 3"):
        plan_preference_pairs([1, 2, 3], 1, 1, 10)
