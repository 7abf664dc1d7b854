"""The records that travel between actors: their compact pickling round-trips every field."""

from __future__ import annotations

import dataclasses
import pickle

import ray.cloudpickle

from rlactors.types import Group, PromptRequest, Sample


def make_group() -> Group:
    request = PromptRequest("gsm8k/train/7", [5, 6, 7], "gsm8k/train/7#0.1", "gsm8k", "42", {"split": "train", "n": [1, 2]})
    samples = [
        Sample(request.prompt_id, 0, [5, 6, 7], [8, 9], [-0.25, -1.5], [3, 4], "length", None, "ab", 1.0, {"acc": True}),
        Sample(request.prompt_id, 1, [5, 6, 7], [], [], [], "error", "prompt_id='gsm8k/train/7': engine died",
               score_error="ValueError: no answer"),
    ]
    return Group(request, samples)


def test_group_pickles_and_unpickles_every_field():
    group = make_group()
    for dumps in (pickle.dumps, ray.cloudpickle.dumps):
        copy = pickle.loads(dumps(group))
        assert copy == group and copy is not group
        assert dataclasses.asdict(copy) == dataclasses.asdict(group)
        assert copy.samples[0].oldest_policy_version == 3 and copy.policy_versions == [3, 4]


def test_a_group_with_a_greedy_baseline_pickles_it_too():
    group = dataclasses.replace(make_group(), baseline=Sample("gsm8k/train/7", 2, [5, 6, 7], [9], [-0.5], [3], score=0.5))
    for dumps in (pickle.dumps, ray.cloudpickle.dumps):
        copy = pickle.loads(dumps(group))
        assert copy == group and copy.baseline == group.baseline and copy.baseline is not group.baseline


def test_unpickled_group_is_independent_of_the_original():
    group = make_group()
    copy = pickle.loads(pickle.dumps(group))
    copy.samples[0].response_token_ids.append(10)
    copy.request.extra_info["split"] = "test"
    assert group.samples[0].response_token_ids == [8, 9] and group.request.extra_info["split"] == "train"
