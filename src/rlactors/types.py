"""The records that travel between actors (by value or inside Ray object refs).

A `PromptRequest` goes to a rollout engine; a `Group` (the n `Sample`s answering one prompt)
comes back, is scored in place by the reward scorers (`Sample.score`), buffered, and trained whole.
Plain dataclasses: cheap to pickle, no torch needed to read them.
"""

from __future__ import annotations

import json
import math
import operator
import pickle
from dataclasses import dataclass, field, fields
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]


def json_text(value, where: str, allow_nan: bool = True) -> str:
    """JSON for a free-form dict, refusing values JSON would not give back identically (and, with
    `allow_nan=False`, NaN and infinities, which strict JSON and most readers refuse); the error
    names `where` and the key path."""

    def check(item, path: str) -> None:
        if isinstance(item, float) and not allow_nan and not math.isfinite(item):
            raise ValueError(f"{where}{path}: {item!r} is not a finite number; store null for a missing value")
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise ValueError(f"{where}{path}: key {key!r} is not a string; it would not round-trip")
                check(child, f"{path}.{key}")
        elif isinstance(item, list):
            for i, child in enumerate(item):
                check(child, f"{path}[{i}]")
        elif item is not None and type(item) not in (bool, int, float, str):
            raise ValueError(f"{where}{path}: {type(item).__name__} value {item!r} cannot be saved exactly")

    check(value, "")
    return json.dumps(value)


@dataclass
class PromptRequest:
    """One prompt to answer `num_samples` times. `prompt_id` is stable across epochs and resumes;
    `group_id` names this particular attempt (a re-issued prompt gets a new group_id)."""

    prompt_id: str
    prompt_token_ids: list[int]
    group_id: str = ""
    data_source: str = ""
    ground_truth: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = f"{self.prompt_id}#0"


@dataclass
class Sample:
    """One response. Per-token lists are aligned with `response_token_ids`."""

    prompt_id: str
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    # Version of the weights that produced each response token; a response resumed across a
    # weight update carries two or more versions.
    token_policy_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    error: str | None = None  # rollout error (bad prompt, dead engine), naming the prompt_id
    text: str = ""
    # Filled by reward scoring:
    score: float | None = None
    score_details: dict[str, Any] = field(default_factory=dict)
    score_error: str | None = None
    # Multi-turn episodes (`rlactors.environments`): the response interleaves model turns and
    # observation tokens. `loss_mask` is aligned with `response_token_ids` (1 on model tokens, 0 on
    # observation tokens); empty means every response token is the model's. Observation tokens carry
    # logprob 0.0 and the policy version of the model turn before them, so staleness is unchanged.
    loss_mask: list[int] = field(default_factory=list)
    num_turns: int = 1  # model turns
    num_tool_calls: int = 0
    # The sum of the environment's per-turn rewards; None when it gave none (the reward function scores).
    episode_reward: float | None = None
    # The environment raised, hung or crashed: the episode ended there. Its tokens so far train with
    # score 0 and this error recorded, like a failing reward function (the rest of the group is kept).
    environment_error: str | None = None
    # MoE routing replay (`rlactors.models.routes`): the experts the engine routed each position of prompt +
    # response to, per layer: uint8/uint16 bytes of shape `routed_experts_shape` [positions, layers,
    # top_k]; empty unless the engine records routing. A position the engine never ran (the last token)
    # holds the dtype's largest value. A response resumed under new weights keeps each position's own.
    routed_experts: bytes = b""
    routed_experts_shape: list[int] = field(default_factory=list)

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask) if self.loss_mask else len(self.response_token_ids)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_token_ids)

    @property
    def oldest_policy_version(self) -> int | None:
        return min(self.token_policy_versions) if self.token_policy_versions else None


@dataclass
class Group:
    """The responses to one prompt: the unit that is buffered, filtered, sampled and trained."""

    request: PromptRequest
    samples: list[Sample]
    # ReMax: the greedy response to the prompt (`sampling.greedy_baseline`), scored like the samples
    # and never trained; its score is the baseline of the group's advantages. None otherwise.
    baseline: Sample | None = None

    @property
    def prompt_id(self) -> str:
        return self.request.prompt_id

    @property
    def group_id(self) -> str:
        return self.request.group_id

    @property
    def policy_versions(self) -> list[int]:
        return sorted({v for s in self.samples for v in s.token_policy_versions})

    @property
    def oldest_policy_version(self) -> int | None:
        versions = [s.oldest_policy_version for s in self.samples if s.oldest_policy_version is not None]
        return min(versions) if versions else None

    @property
    def scores(self) -> list[float | None]:
        return [s.score for s in self.samples]

    def __reduce__(self):
        # Groups cross process boundaries by the thousand (engine -> scorer -> buffer -> trainer).
        # Ray pickles with cloudpickle, whose per-object Python hook is slow on many small
        # dataclasses, and unpickling field dicts is slower than positional tuples: one plain
        # pickle blob of tuples takes ~20% less time both ways (64 groups of 8 x 64 tokens).
        baseline = None if self.baseline is None else _sample_values(self.baseline)
        packed = (_request_values(self.request), [_sample_values(s) for s in self.samples], baseline)
        return _group_from_blob, (pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL),)


# Field values in declaration order (a tuple, not copied; `dataclasses.astuple` deep-copies).
_request_values = operator.attrgetter(*(f.name for f in fields(PromptRequest)))
_sample_values = operator.attrgetter(*(f.name for f in fields(Sample)))


def _group_from_blob(blob: bytes) -> Group:
    request, samples, baseline = pickle.loads(blob)
    return Group(PromptRequest(*request), [Sample(*sample) for sample in samples],
                 None if baseline is None else Sample(*baseline))
